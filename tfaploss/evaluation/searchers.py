"""The interfaces of a search backend: :class:`Searcher`, which every backend answers
(and :func:`load_searcher`, which restores a saved one), and :class:`SearchSpace`, what
a backend the tuner can tune gives it, with the cost model those backends share.

The backends live one module each, with their searcher, tuning space and costs:
:mod:`~tfaploss.evaluation.exact_search` (``"exact"``),
:mod:`~tfaploss.evaluation.scann_search` (``"scann"``, ``"scann_ah"``) and
:mod:`~tfaploss.evaluation.faiss_search` (``"faiss"``).

Scores are inner products (cosine similarity for L2-normalised embeddings), higher is
better. Every backend returns, per query, the ``k`` best database indices sorted by
score (descending) with **ties broken by index** (the lower database index first), so
results are deterministic and backends agree on tied scores.

``exclude`` removes one database index per query *by index* (used when the query set
is the database: a query must not retrieve itself). Removing "the first neighbour"
instead is wrong when the database holds exact duplicates of the query.

Searchers are saved with :meth:`Searcher.serialize` and restored with
:func:`load_searcher`; the metadata is JSON and arrays are ``.npy`` files read with
``allow_pickle=False`` (nothing in a saved searcher can run code when loaded).

**Cost model.** Costs are counted per query in units of one multiply-add of exact
search's BLAS product: a 4-bit lookup (ScaNN's AH, faiss's fast-scan PQ: SIMD LUT16)
costs about a quarter of one; a float32 multiply-add outside BLAS (scores inside
partitions, re-scoring gathered rows) about 1.5-2; a query has a fixed cost besides
(dispatch, heaps, copies) of some microseconds. The tuner orders each space's settings
by this model, cheapest first, and never tries a setting it puts at or above exact
search.
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
    """Sort each row by score (descending), ties by index (ascending).

    Rows may carry padding (index ``-1``, score ``-inf``), which sorts last.
    """
    order = np.lexsort((indices, -scores.astype(np.float64)), axis=-1)
    return (np.take_along_axis(indices, order, axis=-1),
            np.take_along_axis(scores, order, axis=-1))


class Searcher:
    """Base class: a database of embeddings that answers top-k inner-product queries.

    Subclasses implement :meth:`_search` (no exclusion; may return ``k`` results with
    arbitrary tie order) and the (de)serialisation hooks. This class does the shared
    work: input checks, by-index exclusion, chunking of queries and tie ordering.
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
        # A registry rather than an import of each backend here: every backend's
        # module imports this one, so load_searcher cannot import them back.
        for name in cls.__dict__.get("_restores", ()):
            _LOADERS[name] = cls

    def __init__(self, database):
        database = as_matrix(database, "database")
        if database.shape[0] == 0:
            raise ValueError("`database` is empty; a searcher needs at least one row.")
        self.size, self.dim = database.shape

    # -- to implement ------------------------------------------------------------------
    def _search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _config(self) -> dict[str, Any]:
        raise NotImplementedError

    def _save(self, directory: str) -> None:
        raise NotImplementedError

    # -- public ------------------------------------------------------------------------
    def search(self, queries, k: int, exclude=None) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(indices, scores)``, both (num_queries, k'), best first.

        Args:
          queries: (num_queries, dim) float array.
          k: number of neighbours wanted; ``k' = min(k, database size - (1 if exclude
            is given else 0))``.
          exclude: optional int array (num_queries,): a database index to remove from
            each query's results (``-1``: remove nothing).

        Ties are broken by database index (lower first).
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
                # Move the excluded index (where it was returned) to the end, keeping
                # the order of the rest; otherwise the last result is dropped (one
                # more than needed was fetched).
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

        Each file is written whole or not at all, the metadata last (what a load reads
        first), so a save that a full disk stops leaves the previous searcher loadable:
        :class:`~tfaploss.durable.atomic.DiskFullError` names the file (fault point
        ``searcher``).
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
    # Every backend's module is imported by the package's __init__, so each has
    # registered its class here before any load.
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
    """Cost of one query that picks ``probed`` of ``parts`` partitions (``parts * d``;
    ``parts=None``: no partition, every point scanned) and scans their
    ``n * probed / parts`` points: exact float32 scores (``codes=None``,
    ``BRUTE_COST * d`` each), or ``codes`` 4-bit lookups each and then ``rescored``
    candidates (at most ``n``) scored exactly (``REORDER_COST * d`` each)."""
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
    """What the tuner needs from a backend: settings in order of cost, and how to build.

    A setting is a frozen dataclass with ``build_key`` (settings sharing it share one
    built index) and ``describe()``.
    """

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
