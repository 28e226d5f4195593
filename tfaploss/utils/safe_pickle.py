"""Restricted unpickling for untrusted ground-truth files.

The revisited Oxford/Paris ground truth (``gnd_roxford5k.pkl``, ``gnd_rparis6k.pkl``)
ships as pickles. A pickle can name any importable callable and have it called while
loading, so ``pickle.load`` on a downloaded file runs whatever the file says. This
module only lets through plain containers, numbers, strings, bytes and numpy arrays
(the pieces numpy itself needs to rebuild an ``ndarray``); anything else raises
:class:`UnsafePickleError` before it is created.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
from typing import Any, BinaryIO

# (module, name) pairs numpy's pickles reference to rebuild arrays and scalars.
_ALLOWED_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("builtins", "bytearray"),
    ("builtins", "bytes"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    ("builtins", "slice"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),  # numpy scalars pickled by Python 2 era files
}


class UnsafePickleError(pickle.UnpicklingError):
    """Raised when a pickle references something outside the allow-list."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that only resolves allow-listed globals."""

    def find_class(self, module: str, name: str) -> Any:
        # Protocol-2 pickles name Python 2 modules (``__builtin__``); check the Python 3 name.
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"refusing to unpickle global '{module}.{name}': only plain containers, "
            "numbers, strings and numpy arrays are allowed in ground-truth files. "
            "If this file is genuine, convert it to JSON with a trusted tool."
        )


def safe_load(file: BinaryIO, *, encoding: str = "latin1") -> Any:
    """Load a pickle from an open binary file, admitting only safe types.

    ``encoding="latin1"`` reads Python 2 pickles (the Oxford/Paris ground truth was
    written by Python 2) including the numpy arrays inside them.
    """
    return RestrictedUnpickler(file, encoding=encoding).load()


def safe_loads(data: bytes, *, encoding: str = "latin1") -> Any:
    """Like :func:`safe_load` for a bytes object."""
    return safe_load(io.BytesIO(data), encoding=encoding)


def safe_load_path(path: str, *, encoding: str = "latin1") -> Any:
    """Open ``path`` (local or any ``tf.io.gfile`` URL) and :func:`safe_load` it."""
    import tensorflow as tf

    with tf.io.gfile.GFile(path, "rb") as f:
        return safe_loads(f.read(), encoding=encoding)
