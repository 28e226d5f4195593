"""Exact search (:class:`ExactSearcher`), the reference every report and every tuned
search is measured against: recall 1, at ``N * D`` multiply-adds a query.
"""

from __future__ import annotations

import os
import sys
from typing import ClassVar

import numpy as np

from tfaploss.durable import atomic
from tfaploss.evaluation.arrays import check_int
from tfaploss.evaluation.exact_topk import exact_topk
from tfaploss.evaluation.searchers import Searcher

__all__ = ["ExactSearcher"]


class ExactSearcher(Searcher):
    """Exact inner-product search: blocked products + top-k.

    Engines:

    * ``"numpy"``: BLAS products over tiles and a threshold top-k
      (:mod:`tfaploss.evaluation.exact_topk`) in a thread pool, at close to the speed
      of the bare product ``queries @ database.T``.
    * ``"tensorflow"``: ``tf.matmul`` + ``tf.math.top_k`` per chunk (use it on a GPU).
    * ``"auto"`` (default): ``"tensorflow"`` when TensorFlow is already imported and
      sees a GPU, else ``"numpy"``.

    On CPUs with bfloat16 matrix units the numpy engine can run a **bfloat16
    prefilter** (:mod:`tfaploss.evaluation.bfloat16_prefilter`): still the exact top-k,
    at 1.2-1.8x the speed of the bare float32 product with PyTorch (docs/search.md).

    Cost: ``O(Q * N * D)`` multiply-adds; memory ``O(query_chunk * database_chunk)``
    per thread plus ``O(Q * k)`` for the results.

    Args:
      database: (N, D) embeddings (copied to float32).
      query_chunk: queries scored at once (default 512 numpy, 1024 tensorflow).
      database_chunk: database rows scored at once; the running top-k of earlier
        chunks is merged with each new chunk (default 8192 numpy, 65536 tensorflow).
      engine: ``"auto"``, ``"numpy"`` or ``"tensorflow"``.
      num_threads: threads of the numpy engine (0: every core this process may use).
      prefilter: ``"auto"`` (default: the bfloat16 prefilter where it can run and its
        one-off costs and time come in under float32's for this call: see
        :meth:`resolved_prefilter`), ``"bfloat16"`` (always; a ValueError where it
        cannot run), ``"bfloat16-torch"`` / ``"bfloat16-tensorflow"`` (that product) or
        ``"none"``. The numpy engine only.
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
        database = self._take(database)
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
        self.query_chunk = check_int("query_chunk", query_chunk, none=True)
        self.database_chunk = check_int("database_chunk", database_chunk, none=True)
        self.num_threads = check_int("num_threads", num_threads, low=0)
        self.database = database
        self.engine = engine
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
        """The bfloat16 product (``"torch"`` or ``"tensorflow"``) a search of
        ``num_queries`` queries prefilters with, or None for float32 alone; the one
        place the searcher decides. With ``"auto"`` it depends on the process and this
        searcher (:func:`tfaploss.evaluation.bfloat16_prefilter.choose_for_search`), and
        may import the chosen product's framework, as the search would.
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
    """``"bfloat16-torch"`` -> ``"torch"``; None for any product."""
    return prefilter.partition("-")[2] or None


def _tf_chunk_topk(q, db_chunks, offsets, k):
    """Running top-k over database chunks, in (score desc, index asc) order:
    ``tf.math.top_k`` is stable and the running top-k (lower indices) goes first."""
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
