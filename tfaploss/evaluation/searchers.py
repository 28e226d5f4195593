"""The interfaces of a search backend: :class:`Searcher` (every backend; restored by
:func:`load_searcher`) and :class:`SearchSpace` (what the tuner needs of a backend),
with the cost model the backends share. Each backend has its own module
(``exact_search``, ``scann_search``, ``faiss_search``).

Scores are inner products, higher is better; every backend returns the ``k`` best
indices per query sorted by score with **ties broken by index** (lower first), so
backends agree on tied scores. ``exclude`` removes one database index per query *by
index* (self-retrieval): removing "the first neighbour" instead is wrong when the
database holds exact duplicates of the query. Saved searchers are JSON plus ``.npy``
files read with ``allow_pickle=False``: loading one runs no code.

**Cost model.** Per query, in multiply-adds of exact search's BLAS product: a 4-bit
lookup (ScaNN's AH, faiss's fast-scan PQ) costs about a quarter of one, a float32
multiply-add outside BLAS about 1.5-2, plus a fixed cost of some microseconds a query.
The tuner never tries a setting the model puts at or above exact search.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, ClassVar, Protocol

import numpy as np

from tfaploss.durable import atomic
from tfaploss.evaluation.arrays import as_matrix, check_exclude, check_int

_METADATA_FILE = "searcher.json"
_FORMAT_VERSION = 1
_LOADERS: dict[str, type] = {}  # saved backend name -> the Searcher class that loads it


def sort_by_score_then_index(indices: np.ndarray, scores: np.ndarray):
    """Sort each row by score (descending), ties by index; padding (-1, -inf) last."""
    order = np.lexsort((indices, -scores.astype(np.float64)), axis=-1)
    return (np.take_along_axis(indices, order, axis=-1),
            np.take_along_axis(scores, order, axis=-1))


class Searcher:
    """Base class: a database of embeddings that answers top-k inner-product queries.

    Subclasses implement :meth:`_search` (no exclusion, any tie order) and the
    (de)serialisation hooks; this class checks inputs, excludes and orders ties.
    """

    backend: str = "base"
    # False when every search returns the exact top-k (reports then need no lower bound).
    approximate: bool = False
    # The backend names in saved metadata that this class restores (see load_searcher).
    _restores: ClassVar[tuple[str, ...]] = ()
    # True when _search already returns rows sorted by (score desc, index asc).
    _returns_tie_order: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A registry: every backend imports this module, so it cannot import them.
        for name in cls.__dict__.get("_restores", ()):
            _LOADERS[name] = cls

    def __init__(self, database):
        self._take(database)

    def _take(self, database) -> np.ndarray:
        """``database`` checked and as float32; sets ``size`` and ``dim``. The backends
        call this instead of ``__init__`` and index what it returns, so a database is
        checked, and converted, once."""
        database = as_matrix(database, "database")
        if database.shape[0] == 0:
            raise ValueError("`database` is empty; a searcher needs at least one row.")
        self.size, self.dim = database.shape
        return database

    def _search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _config(self) -> dict[str, Any]:
        raise NotImplementedError

    def _save(self, directory: str) -> None:
        raise NotImplementedError

    def search(self, queries, k: int, exclude=None) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(indices, scores)``, both (num_queries, k'), best first, ties by index.

        ``k' = min(k, database size - (1 if exclude is given else 0))``; ``exclude``:
        optional (num_queries,) ints, a database index removed from each query's results
        (``-1``: none).
        """
        queries = as_matrix(queries, "queries")
        if queries.shape[1] != self.dim:
            raise ValueError(
                f"`queries` have dimension {queries.shape[1]} but the database has "
                f"dimension {self.dim}."
            )
        exclude = check_exclude(exclude, queries.shape[0], self.size)
        n_avail = self.size - (1 if exclude is not None else 0)
        if n_avail < 1:
            raise ValueError("nothing to retrieve: the database has one row and it is excluded.")
        k = min(check_int("k", k), n_avail)
        if queries.shape[0] == 0:
            return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
        fetch = min(k + (1 if exclude is not None else 0), self.size)
        idx, sc = self._search(queries, fetch)
        idx = np.asarray(idx, np.int64)
        sc = np.asarray(sc, np.float32)
        if self._returns_tie_order:
            if exclude is not None:
                # The excluded index moves last; else the one extra fetched is dropped.
                order = np.argsort(idx == exclude[:, None], axis=1, kind="stable")
                idx = np.take_along_axis(idx, order, 1)
                sc = np.take_along_axis(sc, order, 1)
            return np.ascontiguousarray(idx[:, :k]), np.ascontiguousarray(sc[:, :k])
        if exclude is not None:
            hit = idx == exclude[:, None]
            sc = np.where(hit, -np.inf, sc)
            idx = np.where(hit, -1, idx)
        idx, sc = sort_by_score_then_index(idx, sc)
        return idx[:, :k], sc[:, :k]

    def describe(self) -> str:
        """The setting in words, as reports write it."""
        return self.backend

    def get_config(self) -> dict[str, Any]:
        """The backend name and the parameters that rebuild this searcher."""
        return {"backend": self.backend, **self._config()}

    def serialize(self, directory: str) -> str:
        """Save the searcher into ``directory`` (created if missing); returns it.

        Each file is written whole or not at all, the metadata last, so a save that a
        full disk stops (a :class:`~tfaploss.durable.atomic.DiskFullError`, fault point
        ``searcher``) leaves the previous searcher loadable.
        """
        os.makedirs(directory, exist_ok=True)
        self._save(directory)
        meta = {"format_version": _FORMAT_VERSION, "size": self.size, "dim": self.dim,
                **self.get_config()}
        atomic.atomic_write_text(os.path.join(directory, _METADATA_FILE),
                                 json.dumps(meta, indent=2), fault="searcher")
        return directory

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, dim={self.dim}, {self._config()})"


def load_searcher(directory: str) -> Searcher:
    """Restore a searcher written by :meth:`Searcher.serialize`."""
    path = os.path.join(directory, _METADATA_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {_METADATA_FILE} in {directory!r}: not a saved searcher.")
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format_version") != _FORMAT_VERSION:
        raise ValueError(f"unsupported searcher format_version {meta.get('format_version')!r}.")
    backend = meta.get("backend")
    # The package's __init__ imports every backend, so each has registered its class.
    cls = _LOADERS.get(backend)
    if cls is None:
        raise ValueError(f"unknown backend {backend!r} in {path}.")
    return cls._load(directory, meta)


# -- what the tuner needs of a backend ---------------------------------------------------
LUT_COST = 0.25
BRUTE_COST = 1.5
REORDER_COST = 2.0
QUERY_OVERHEAD = 20_000.0
MIN_PARTITION_POINTS = 2_000  # below this a partition (ScaNN's tree, faiss's IVF) does not pay


def exact_cost(n: int, d: int) -> float:
    """Cost of one exact query over an (n, d) database: ``n * d``."""
    return float(n) * d


def partitioned_cost(n: int, d: int, parts: int | None, probed: int | None, *,
                     codes: int | None = None, rescored: int = 0) -> float:
    """Cost of one query that picks ``probed`` of ``parts`` partitions (``parts=None``:
    none) and scores their points exactly (``codes=None``) or with ``codes`` 4-bit
    lookups each, then ``rescored`` candidates exactly."""
    units = QUERY_OVERHEAD
    scanned = float(n)
    if parts:
        units += parts * d
        scanned = n * probed / parts
    if codes is None:
        return units + scanned * d * BRUTE_COST
    return units + scanned * codes * LUT_COST + min(rescored, n) * d * REORDER_COST


def probe_counts(parts: int) -> list[int]:
    """How many of ``parts`` partitions (ScaNN leaves, faiss IVF lists) the tuners try to
    search: a share of them (1/64 .. 1/2), and a few whatever their number, since on
    data whose neighbours share a cluster one or two partitions hold them all."""
    return sorted({max(1, math.ceil(parts * f))
                   for f in (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)}
                  | {t for t in (1, 2, 4, 8) if t < parts})


class SearchSpace(Protocol):
    """What the tuner needs from a backend. A setting is a frozen dataclass with
    ``build_key`` (settings sharing it share one built index) and ``describe()``."""

    name: str  # the backend, as the tuner's log lines name it

    def check(self) -> None:
        """Raise before any work when the backend cannot run (e.g. not installed)."""

    def candidates(self, n: int, d: int, k: int) -> list:
        """Every setting for an (n, d) database and top-``k``, cheapest first."""

    def cost(self, setting, n: int, d: int, k: int) -> float:
        """Cost of a query in multiply-adds of exact search (``None``: exact)."""

    def dominates(self, a, b) -> bool:
        """True when ``a`` finds at least every neighbour ``b`` finds."""

    def probe(self, setting):
        """A cheap setting whose miss rules ``setting`` out, or ``None``."""

    def build(self, database, setting, k: int, num_threads: int) -> Searcher:
        """A new searcher with ``setting``."""

    def configure(self, searcher: Searcher, setting) -> None:
        """Give a built searcher the search-time parameters of ``setting``."""
