"""The checks of the arrays and counts that the searchers and metrics take: one home, so
that a bad value gets the same error whichever function it reached first."""

from __future__ import annotations

import numpy as np


def as_matrix(x, name: str) -> np.ndarray:
    """``x`` as a contiguous float32 (n, dim) array, or a ValueError naming ``name``."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"`{name}` must be a 2-D (n, dim) array; received shape {x.shape}.")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"`{name}` must hold floats; received dtype {x.dtype}.")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"`{name}` contains NaN or infinite values.")
    return np.ascontiguousarray(x, dtype=np.float32)


def check_int(name: str, value, low: int = 1, none: bool = False) -> int | None:
    """``value`` as an int >= ``low`` (``None`` too with ``none``), else a ValueError
    naming ``name``."""
    if none and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ValueError(f"`{name}` must be {what}{' or None' if none else ''}; received "
                         f"{value!r}.")
    return int(value)


def check_exclude(exclude, num_queries: int, n: int) -> np.ndarray | None:
    """``exclude`` (one database index per query, ``-1``: none) as int64, or None."""
    if exclude is None:
        return None
    exclude = np.asarray(exclude)
    if exclude.shape != (num_queries,) or not np.issubdtype(exclude.dtype, np.integer):
        raise ValueError(
            "`exclude` must be an integer array with one database index per query "
            f"(-1 for none); received shape {exclude.shape} and dtype {exclude.dtype}."
        )
    if np.any(exclude >= n):
        raise ValueError(f"`exclude` holds an index >= the database size {n}.")
    return exclude.astype(np.int64)
