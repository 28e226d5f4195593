"""Nearest-neighbour search backends for retrieval evaluation.

The backends share one small interface (:class:`Searcher`):

* ``"exact"`` -- :class:`ExactSearcher`: inner products by matrix multiplication and
  a top-k, blocked over queries *and* database so that a 1M x 512 database never
  needs a (queries x database) matrix in memory. NumPy/BLAS with a threshold top-k
  on CPUs (0.63-0.79 of the bare float32 product's speed), ahead of it through a
  bfloat16 prefilter on CPUs with bfloat16 units; TensorFlow on a GPU.
* ``"scann"`` -- :class:`ScannSearcher` with ``mode="brute_force"``: ScaNN's exact
  float32 brute force.
* ``"scann_ah"`` -- :class:`ScannSearcher` with ``mode="ah"``: ScaNN's partitioning
  tree + anisotropic asymmetric hashing + exact re-ordering, the fast default for
  large databases. Its parameters are chosen from the database size
  (:func:`scann_ah_params`) and every one can be overridden.
* ``"faiss"`` -- :class:`tfaploss.evaluation.faiss_search.FaissSearcher`: faiss's
  flat, IVF-Flat, IVF-PQ and HNSW indexes, on a GPU where faiss-gpu sees one.

:func:`tfaploss.evaluation.tuner.build_searcher` picks one of them by name, or tunes
ScaNN or faiss to a target recall.

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
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, ClassVar

import numpy as np

from tfaploss import extras
from tfaploss.durable import atomic

_METADATA_FILE = "searcher.json"
_FORMAT_VERSION = 1
_LOADERS: dict[str, type] = {}  # saved backend name -> the Searcher class that loads it


def _as_matrix(x, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"`{name}` must be a 2-D (n, dim) array; received shape {x.shape}.")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"`{name}` must hold floats; received dtype {x.dtype}.")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"`{name}` contains NaN or infinite values.")
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_k(k, n: int) -> int:
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"`k` must be a positive integer; received {k!r}.")
    return int(min(k, n))


def _check_exclude(exclude, num_queries: int, n: int) -> np.ndarray | None:
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
        # A registry rather than an import of each backend here: the faiss module
        # imports this one, so load_searcher cannot import it back.
        for name in cls.__dict__.get("_restores", ()):
            _LOADERS[name] = cls

    def __init__(self, database):
        database = _as_matrix(database, "database")
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
        queries = _as_matrix(queries, "queries")
        if queries.shape[1] != self.dim:
            raise ValueError(
                f"`queries` have dimension {queries.shape[1]} but the database has "
                f"dimension {self.dim}."
            )
        exclude = _check_exclude(exclude, queries.shape[0], self.size)
        n_avail = self.size - (1 if exclude is not None else 0)
        if n_avail < 1:
            raise ValueError("nothing to retrieve: the database has one row and it is excluded.")
        k = _check_k(k, n_avail)
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


class ExactSearcher(Searcher):
    """Exact inner-product search: blocked products + top-k.

    Engines:

    * ``"numpy"``: BLAS products over (query block x database block) tiles and a
      threshold top-k that looks at most scores once (see
      :mod:`tfaploss.evaluation.exact_search`), in a thread pool. On a CPU this runs
      at close to the speed of the bare product ``queries @ database.T``.
    * ``"tensorflow"``: ``tf.matmul`` + ``tf.math.top_k`` per chunk (use it on a GPU).
    * ``"auto"`` (default): ``"tensorflow"`` when TensorFlow is already imported and
      sees a GPU, else ``"numpy"``.

    On CPUs with bfloat16 matrix units (AMX, AVX512-BF16) the numpy engine can run a
    **bfloat16 prefilter** (:mod:`tfaploss.evaluation.bfloat16_prefilter`): a bfloat16
    product (PyTorch's where installed, else TensorFlow's) picks every candidate that a
    rigorous error bound cannot rule out, and float32 re-scores them. The result is the
    exact top-k all the same (the bound also covers float32's own rounding); on 300k x
    128, k = 100 it ran at 1.2-1.8x the speed of the bare float32 product with PyTorch,
    0.9-1.15x with TensorFlow, against 0.66-0.74x without it (four runs; docs/search.md).
    Its first search in a process also pays one-off costs: the import of the product's
    framework (PyTorch cold: 2.0-2.5 s on 2 cores) unless imported already, and the
    bfloat16 copy of the database (about 0.3 s at 300k x 128, then held by the
    searcher). So ``prefilter="auto"`` takes it only when, for this call, those one-off
    costs plus its estimated time come in under float32 alone's estimate, both from
    the call's ``Q * N * D`` multiply-adds
    (:func:`tfaploss.evaluation.bfloat16_prefilter.cheapest`): the first call is never
    slower than ``"none"`` by the estimate, and a 2,000-query search of 300k x 128 in a
    fresh process stays in float32 (PyTorch's import pays from about 5,000 queries;
    with TensorFlow imported, its prefilter from about 1,200). :meth:`resolved_prefilter`
    says which path a search of ``Q`` queries takes.

    Cost: ``O(Q * N * D)`` multiply-adds; memory ``O(query_chunk * database_chunk)``
    per thread for the score tile plus ``O(Q * k)`` for the results, so a 1M x 512
    database (2 GB of float32) is searched with a few tens of MB on top.

    Args:
      database: (N, D) embeddings (copied to float32).
      query_chunk: queries scored at once (default 512 numpy, 1024 tensorflow).
      database_chunk: database rows scored at once; the running top-k of earlier
        chunks is merged with each new chunk (default 8192 numpy, 65536 tensorflow).
      engine: ``"auto"``, ``"numpy"`` or ``"tensorflow"``.
      num_threads: threads of the numpy engine (0: every core this process may use).
      prefilter: ``"auto"`` (default: the bfloat16 prefilter when the CPU has
        bfloat16 units, the product is checked to accumulate in float32, a search has
        at least 2^32 multiply-adds and D >= 32, and it wins this call with its
        one-off costs counted, above), ``"bfloat16"`` (always; a ValueError where it
        cannot run), ``"bfloat16-torch"`` / ``"bfloat16-tensorflow"`` (always, with that
        product) or ``"none"``. The numpy engine only.
    """

    backend = "exact"
    _restores = ("exact",)
    _returns_tie_order = True  # both engines order ties by index (see _tf_chunk_topk)
    _PREFILTERS = ("auto", "bfloat16", "bfloat16-torch", "bfloat16-tensorflow", "none")
    _DEFAULT_CHUNKS: ClassVar[dict[str, tuple[int, int]]] = {
        # numpy: 512 query rows per BLAS call; 128 spent ~35 % more CPU on the product
        # (300k x 128, k = 100; docs/search.md)
        "numpy": (512, 8192), "tensorflow": (1024, 65536)}

    def __init__(self, database, query_chunk: int | None = None,
                 database_chunk: int | None = None, engine: str = "auto",
                 num_threads: int = 0, prefilter: str = "auto"):
        super().__init__(database)
        if prefilter not in self._PREFILTERS:
            raise ValueError(f"`prefilter` must be one of {', '.join(self._PREFILTERS)}; "
                             f"received {prefilter!r}.")
        if prefilter.startswith("bfloat16"):
            from tfaploss.evaluation import bfloat16_prefilter

            if engine == "tensorflow":
                raise ValueError(f"`prefilter={prefilter!r}` runs on the numpy engine; "
                                 f"received engine={engine!r}.")

            product, why = bfloat16_prefilter.choose_product(_prefilter_product(prefilter))
            if product is None:
                raise ValueError(f"`prefilter={prefilter!r}` cannot run here: {why}.")
        if engine not in ("auto", "tensorflow", "numpy"):
            raise ValueError(f"`engine` must be 'auto', 'tensorflow' or 'numpy'; "
                             f"received {engine!r}.")
        for name, v in (("query_chunk", query_chunk), ("database_chunk", database_chunk)):
            if v is not None and (not isinstance(v, (int, np.integer)) or v < 1):
                raise ValueError(f"`{name}` must be a positive integer; received {v!r}.")
        if not isinstance(num_threads, (int, np.integer)) or num_threads < 0:
            raise ValueError(f"`num_threads` must be an integer >= 0; received {num_threads!r}.")
        self.database = _as_matrix(database, "database")
        self.engine = engine
        self.query_chunk = None if query_chunk is None else int(query_chunk)
        self.database_chunk = None if database_chunk is None else int(database_chunk)
        self.num_threads = int(num_threads)
        self.prefilter = prefilter
        self._tf_db = None
        self._prepared = None  # the database in bfloat16, made at the first prefiltered search
        self._prepared_failed = False

    @property
    def resolved_engine(self) -> str:
        """The engine searches run on (``"auto"`` resolved)."""
        if self.engine != "auto":
            return self.engine
        tf = sys.modules.get("tensorflow")
        if tf is not None and tf.config.list_physical_devices("GPU"):
            return "tensorflow"
        return "numpy"

    def _chunks(self, engine: str) -> tuple[int, int]:
        q, d = self._DEFAULT_CHUNKS[engine]
        return self.query_chunk or q, self.database_chunk or d

    def _config(self):
        return {"query_chunk": self.query_chunk, "database_chunk": self.database_chunk,
                "engine": self.engine, "num_threads": self.num_threads,
                "prefilter": self.prefilter}

    def resolved_prefilter(self, num_queries: int) -> str | None:
        """The bfloat16 product a search of ``num_queries`` queries prefilters with
        (``"torch"`` or ``"tensorflow"``), or None when it runs in float32 alone; the
        one place the searcher decides (its searches ask it). Queries whose scores
        could come near float32's range still run in float32 alone.

        With ``prefilter="auto"`` the answer depends on the state of the process and
        of this searcher (which frameworks are imported, whether it holds its bfloat16
        copy: :func:`tfaploss.evaluation.bfloat16_prefilter.choose_for_search`). Cost:
        microseconds, unless it chooses a product whose framework is not imported yet:
        then it imports it (a second or two, once a process), as the search would.
        """
        if self.prefilter == "none" or self.resolved_engine != "numpy" or self._prepared_failed:
            return None
        from tfaploss.evaluation import bfloat16_prefilter

        if self.prefilter == "auto":
            held = None if self._prepared is None else self._prepared.product.name
            return bfloat16_prefilter.choose_for_search(num_queries, self.size, self.dim,
                                                        held)
        return bfloat16_prefilter.choose_product(_prefilter_product(self.prefilter))[0]

    def _save(self, directory):
        atomic.atomic_write(os.path.join(directory, "database.npy"),
                            lambda tmp: np.save(tmp, self.database), fault="searcher",
                            needed=self.database.nbytes)

    @classmethod
    def _load(cls, directory, meta):
        db = np.load(os.path.join(directory, "database.npy"), allow_pickle=False)
        return cls(db, query_chunk=meta["query_chunk"], database_chunk=meta["database_chunk"],
                   engine=meta["engine"], num_threads=meta.get("num_threads", 0),
                   prefilter=meta.get("prefilter", "auto"))

    def _search(self, queries, k):
        engine = self.resolved_engine
        if engine == "numpy":
            from tfaploss.evaluation.exact_search import exact_topk

            prepared = self._prepared_database(len(queries))
            if prepared is not None and prepared.fits(queries):
                from tfaploss.evaluation import bfloat16_prefilter

                scores, idx = bfloat16_prefilter.exact_topk(
                    queries, prepared, k, query_block=self.query_chunk
                    or bfloat16_prefilter.QUERY_BLOCK, threads=self.num_threads)
                return idx, scores
            qc, dc = self._chunks(engine)
            scores, idx = exact_topk(queries, self.database, k, query_block=qc,
                                     database_block=dc, threads=self.num_threads)
            return idx, scores
        return self._search_tf(queries, k)

    def _prepared_database(self, num_queries: int):
        product = self.resolved_prefilter(num_queries)
        if product is None:
            return None
        if self._prepared is None or self._prepared.product.name != product:
            from tfaploss.evaluation import bfloat16_prefilter

            try:
                self._prepared = None  # a copy for another product: freed first
                self._prepared = bfloat16_prefilter.PreparedDatabase(
                    self.database, product,
                    self.database_chunk or bfloat16_prefilter.DATABASE_BLOCK,
                    self.num_threads)
            except OverflowError:  # rows beyond bfloat16's range: float32 alone
                self._prepared_failed = True
                return None
        return self._prepared

    def _search_tf(self, queries, k):
        import tensorflow as tf

        qc, dc = self._chunks("tensorflow")
        if self._tf_db is None:
            self._tf_db = [tf.constant(self.database[d0:d0 + dc])
                           for d0 in range(0, self.size, dc)]
        offsets = list(range(0, self.size, dc))
        out_i, out_s = [], []
        for q0 in range(0, len(queries), qc):
            i, s = _tf_chunk_topk(tf.constant(queries[q0:q0 + qc]), self._tf_db, offsets, k)
            out_i.append(i.numpy())
            out_s.append(s.numpy())
        return np.concatenate(out_i), np.concatenate(out_s)


def _prefilter_product(prefilter: str) -> str | None:
    """The product a ``prefilter`` setting names (``"bfloat16-torch"``: ``"torch"``), or
    None for any."""
    return prefilter.partition("-")[2] or None


def _tf_chunk_topk(q, db_chunks, offsets, k):
    """Running top-k over database chunks.

    ``tf.math.top_k`` is stable (equal values: lower position first). The running
    top-k (from earlier chunks, hence lower database indices) is placed *before* the
    new chunk's candidates, so the merged order is (score desc, index asc).
    """
    import tensorflow as tf

    best_s = tf.zeros((q.shape[0], 0), tf.float32)
    best_i = tf.zeros((q.shape[0], 0), tf.int64)
    for chunk, off in zip(db_chunks, offsets):
        s = tf.matmul(q, chunk, transpose_b=True)
        kk = min(k, chunk.shape[0])
        cs, ci = tf.math.top_k(s, k=kk, sorted=True)
        cand_s = tf.concat([best_s, cs], axis=1)
        cand_i = tf.concat([best_i, tf.cast(ci, tf.int64) + off], axis=1)
        kk = min(k, cand_s.shape[1])
        best_s, pos = tf.math.top_k(cand_s, k=kk, sorted=True)
        best_i = tf.gather(cand_i, pos, batch_dims=1)
    return best_i, best_s


def _unit_rows(database, tolerance: float = 1e-3) -> bool:
    """True when every row of ``database`` has an L2 norm within ``tolerance`` of 1."""
    norms = np.linalg.norm(database, axis=1)
    return bool(norms.size) and bool(np.all(np.abs(norms - 1) <= tolerance))


def scann_ah_params(num_database: int, dim: int) -> dict[str, Any]:
    """Tree + AH + reorder parameters for a database of ``num_database`` x ``dim``.

    * ``num_leaves`` about sqrt(N) (at most 4,000) and ``num_leaves_to_search`` =
      max(50, 5 % of them): a leaf then holds about sqrt(N) points, so the share of the
      database scanned falls as N grows, at the same recall.
    * ``tree_training_sample_size`` = 250 points per leaf (all of a smaller set): the
      k-means behind the tree is what recall depends on most.
    * AH: 2 dimensions per 4-bit block, anisotropic threshold 0.2 (for unit-norm data),
      codebooks trained on at most 100k points (``training_sample_size``).
    * exact re-ordering of at least 250 candidates (``10 * k`` when more are asked for).

    Below 100,000 points the tree is skipped: scanning every 4-bit AH code is already
    fast there, and a tree costs recall, badly so on embeddings without cluster
    structure. The measurements behind each value are in ``docs/search.md``.
    """
    n = int(num_database)
    params: dict[str, Any] = {
        "dimensions_per_block": 2,
        "anisotropic_quantization_threshold": 0.2,
        "reorder_num_neighbors": 250,
        "training_sample_size": min(n, 100_000),
        "num_leaves": None,
        "num_leaves_to_search": None,
        "tree_training_sample_size": None,
    }
    if n >= 100_000:
        num_leaves = int(min(round(math.sqrt(n)), 4000))
        params["num_leaves"] = num_leaves
        params["num_leaves_to_search"] = min(num_leaves, max(50, math.ceil(0.05 * num_leaves)))
        params["tree_training_sample_size"] = min(n, 250 * num_leaves)
    return params


class ScannSearcher(Searcher):
    """ScaNN search: exact brute force (``mode="brute_force"``) or tree + asymmetric
    hashing + re-ordering (``mode="ah"``).

    AH cost per query: ``num_leaves * D`` to pick leaves, then a 4-bit LUT scan of
    ``N * num_leaves_to_search / num_leaves`` codes and an exact re-scoring of
    ``reorder_num_neighbors`` candidates. Parameters not given are taken from
    :func:`scann_ah_params`.

    Args:
      database: (N, D) embeddings.
      mode: ``"brute_force"`` or ``"ah"``.
      num_neighbors: default k stored in the ScaNN config (searches may ask more).
      num_leaves, num_leaves_to_search, dimensions_per_block,
      anisotropic_quantization_threshold, reorder_num_neighbors, training_sample_size
        (AH codebooks), tree_training_sample_size (k-means of the tree): ScaNN
        parameters (``mode="ah"`` only); ``num_leaves=None`` disables the tree.
      leaf_scoring: ``"ah"`` (default: 4-bit AH codes + exact re-ordering) or
        ``"brute_force"`` (exact float32 scores of every point of the leaves searched;
        no re-ordering needed).
      reorder_factor: a search for ``k`` re-orders ``max(reorder_factor * k,
        reorder_num_neighbors)`` candidates (default 10; the tuner of
        :mod:`tfaploss.evaluation.tuner` sets 1 to choose the re-order size itself).
      anisotropic_quantization_threshold: ``None`` turns the anisotropic loss off
        (plain AH).
      spherical: spherical k-means for the tree (unit-norm centres). ``None``
        (default): when every database row has norm 1 (± 1e-3), as the embeddings of
        the losses do. Dot products with raw k-means centres favour the centres of
        tight clusters, so a query's neighbours land in other leaves
        (``docs/search.md``).
      num_threads: search/training threads (0 = ScaNN's default, all cores).
    """

    backend = "scann"
    _restores = ("scann", "scann_ah")
    _AH_KEYS = ("num_leaves", "num_leaves_to_search", "dimensions_per_block",
                "anisotropic_quantization_threshold", "reorder_num_neighbors",
                "training_sample_size", "tree_training_sample_size", "leaf_scoring",
                "reorder_factor", "spherical")
    # Defaults of the keys scann_ah_params leaves out (and saved searchers may lack).
    _EXTRA_DEFAULTS: ClassVar[dict[str, Any]] = {"leaf_scoring": "ah", "reorder_factor": 10,
                                                 "spherical": None}

    def __init__(self, database, mode: str = "ah", num_neighbors: int = 100,
                 num_threads: int = 0, _searcher=None, **ah_params):
        super().__init__(database if _searcher is None else np.zeros((1, 1), np.float32))
        if mode not in ("brute_force", "ah"):
            raise ValueError(f"`mode` must be 'brute_force' or 'ah'; received {mode!r}.")
        unknown = set(ah_params) - set(self._AH_KEYS)
        if unknown:
            raise ValueError(f"unknown ScaNN parameter(s) {sorted(unknown)}; "
                             f"allowed: {list(self._AH_KEYS)}.")
        if mode == "brute_force" and ah_params:
            raise ValueError(f"parameters {sorted(ah_params)} only apply to mode='ah'.")
        self.mode = mode
        self.num_neighbors = int(num_neighbors)
        self.num_threads = int(num_threads)
        self.backend = "scann" if mode == "brute_force" else "scann_ah"
        self.approximate = mode == "ah"
        if _searcher is not None:  # restored by load_searcher
            self._searcher, self.size, self.dim, self.params = _searcher
            return
        database = _as_matrix(database, "database")
        self.params = {}
        if mode == "ah":
            self.params = {**scann_ah_params(*database.shape), **self._EXTRA_DEFAULTS,
                           **ah_params}
            if self.params["leaf_scoring"] not in ("ah", "brute_force"):
                raise ValueError(f"`leaf_scoring` must be 'ah' or 'brute_force'; received "
                                 f"{self.params['leaf_scoring']!r}.")
            factor = self.params["reorder_factor"]
            if not isinstance(factor, (int, np.integer)) or factor < 1:
                raise ValueError(f"`reorder_factor` must be a positive integer; received "
                                 f"{factor!r}.")
            if self.params["spherical"] is None:
                self.params["spherical"] = _unit_rows(database)
            leaves = self.params.get("num_leaves")
            if leaves:
                if not 1 <= int(leaves) <= database.shape[0]:
                    raise ValueError(f"`num_leaves` must be in [1, {database.shape[0]}] (the "
                                     f"database size); received {leaves!r}.")
                if not self.params.get("num_leaves_to_search"):
                    self.params["num_leaves_to_search"] = math.ceil(0.1 * int(leaves))
                if "tree_training_sample_size" not in ah_params:
                    self.params["tree_training_sample_size"] = min(database.shape[0],
                                                                   250 * int(leaves))
        self._searcher = self._build(database)

    def _build(self, db):
        scann = extras.import_extra(
            "scann", f"ScaNN search (backend {self.backend!r}, or a tuned target_recall)")

        nn = max(1, min(self.num_neighbors, db.shape[0]))
        builder = scann.scann_ops_pybind.builder(db, nn, "dot_product")
        if self.mode == "brute_force":
            builder = builder.score_brute_force()
        else:
            p = self.params
            if p.get("num_leaves"):
                builder = builder.tree(
                    num_leaves=int(p["num_leaves"]),
                    num_leaves_to_search=int(p["num_leaves_to_search"]),
                    training_sample_size=int(p["tree_training_sample_size"]),
                    spherical=bool(p.get("spherical")))
            if p.get("leaf_scoring", "ah") == "brute_force":
                builder = builder.score_brute_force()
            else:
                threshold = p["anisotropic_quantization_threshold"]
                builder = builder.score_ah(
                    int(p["dimensions_per_block"]),
                    anisotropic_quantization_threshold=(
                        float("nan") if threshold is None else float(threshold)),
                    training_sample_size=int(p["training_sample_size"]))
                builder = builder.reorder(int(p["reorder_num_neighbors"]))
        builder.set_n_training_threads(self.num_threads)
        searcher = builder.build()
        if self.num_threads:
            searcher.set_num_threads(self.num_threads)
        return searcher

    def _config(self):
        return {"mode": self.mode, "num_neighbors": self.num_neighbors,
                "num_threads": self.num_threads, **self.params}

    def set_search_params(self, num_leaves_to_search: int | None = None,
                          reorder_num_neighbors: int | None = None) -> ScannSearcher:
        """Change the speed/recall trade-off of later searches without rebuilding."""
        if self.mode != "ah":
            raise ValueError("search parameters only apply to mode='ah'.")
        if num_leaves_to_search is not None:
            if not self.params.get("num_leaves"):
                raise ValueError("`num_leaves_to_search` needs a tree (num_leaves was None).")
            if not 1 <= num_leaves_to_search <= self.params["num_leaves"]:
                raise ValueError(f"`num_leaves_to_search` must be in [1, "
                                 f"{self.params['num_leaves']}]; received "
                                 f"{num_leaves_to_search!r}.")
            self.params["num_leaves_to_search"] = int(num_leaves_to_search)
        if reorder_num_neighbors is not None:
            if reorder_num_neighbors < 1:
                raise ValueError(f"`reorder_num_neighbors` must be >= 1; received "
                                 f"{reorder_num_neighbors!r}.")
            self.params["reorder_num_neighbors"] = int(reorder_num_neighbors)
        return self

    def _search(self, queries, k):
        kwargs = {}
        if self.mode == "ah":
            if self.params.get("leaf_scoring", "ah") == "ah":
                kwargs["pre_reorder_num_neighbors"] = max(
                    int(self.params.get("reorder_factor", 10)) * k,
                    int(self.params["reorder_num_neighbors"]))
            if self.params.get("num_leaves"):
                kwargs["leaves_to_search"] = int(self.params["num_leaves_to_search"])
        idx, dist = self._searcher.search_batched_parallel(
            queries, final_num_neighbors=k, **kwargs)
        idx = np.asarray(idx, np.int64)
        dist = np.asarray(dist, np.float32)
        # Batched ScaNN pads a row it cannot fill (fewer points in the leaves searched
        # than asked for) with index 0 and a NaN score: padding, not neighbours.
        pad = np.isnan(dist)
        if pad.any():
            idx = np.where(pad, -1, idx)
            dist = np.where(pad, -np.inf, dist).astype(np.float32)
        if idx.shape[1] < k:  # ScaNN may return fewer rows than asked (tiny leaves)
            pad = k - idx.shape[1]
            idx = np.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
            dist = np.pad(dist, ((0, 0), (0, pad)), constant_values=-np.inf)
        return idx, dist

    def _save(self, directory):
        sub = os.path.join(directory, "scann")
        os.makedirs(sub, exist_ok=True)
        # relative_path=True: the assets file names the artefacts relative to `sub`, so
        # the directory can be moved or copied.
        try:
            self._searcher.searcher.serialize(sub, True)
        except Exception as err:  # ScaNN reports a full disk in a RuntimeError's text
            if atomic.is_disk_full(err):
                raise atomic.DiskFullError(sub, None, atomic.free_bytes(directory)) \
                    from None
            raise

    @classmethod
    def _load(cls, directory, meta):
        # importing scann puts scann_pybind on sys.path
        extras.import_extra("scann", f"loading the ScaNN searcher of {directory!r}")
        from scann.scann_ops.py import scann_ops_pybind

        sub = os.path.join(directory, "scann")
        with open(os.path.join(sub, "scann_assets.pbtxt"), encoding="utf-8") as f:
            assets = f.read()
        # Built directly rather than through scann's load_searcher, which unpickles an
        # optional docids file with plain pickle.
        raw = scann_ops_pybind.scann_pybind.ScannNumpy(sub, assets)
        searcher = scann_ops_pybind.ScannSearcher(raw)
        params = {k: meta[k] for k in cls._AH_KEYS if k in meta}
        if meta["mode"] == "ah":
            params = {**cls._EXTRA_DEFAULTS, **params}
        obj = cls(None, mode=meta["mode"], num_neighbors=meta["num_neighbors"],
                  num_threads=meta["num_threads"],
                  _searcher=(searcher, int(meta["size"]), int(meta["dim"]), params))
        if obj.num_threads:
            searcher.set_num_threads(obj.num_threads)
        return obj


BACKENDS = ("exact", "scann", "scann_ah", "faiss")


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


def probe_counts(parts: int) -> list[int]:
    """How many of ``parts`` partitions (ScaNN leaves, faiss IVF lists) the tuners try to
    search: a share of them (1/64 .. 1/2), and a few whatever their number, since on
    data whose neighbours share a cluster one or two partitions hold them all."""
    return sorted({max(1, math.ceil(parts * f))
                   for f in (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)}
                  | {t for t in (1, 2, 4, 8) if t < parts})
