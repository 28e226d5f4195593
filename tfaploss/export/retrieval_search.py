"""The search behind the ``retrieve`` signatures: an index held as SavedModel variables
and searched inside the serving graph.

Backends (``index_backend``): ``"brute_force"`` (default: exact, stock TensorFlow ops,
a stable top-k per chunk of ``chunk_rows`` rows and one over the chunks, so ties come in
catalogue order) and ``"scann"`` (ScaNN's TensorFlow ops, approximate; TF Serving must
link them, and Python must import ``scann`` first: :func:`load_op_libraries`).

Memory while serving: the index (N x D x 4 bytes for brute force), the keys and labels,
and per request ``batch x chunk_rows x 4`` bytes of scores for each chunk in flight.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np

from tfaploss.evaluation.arrays import check_int

logger = logging.getLogger(__name__)

RETRIEVE_SIGNATURE = "retrieve"
RETRIEVE_PIXELS_SIGNATURE = "retrieve_pixels"
K_INPUT = "k"
KEYS_OUTPUT, SCORES_OUTPUT, LABELS_OUTPUT = "keys", "scores", "labels"
INDEX_COLLECTION = "retrieval_index"  # the variables, as tf.saved_model.load restores them
BACKENDS = ("brute_force", "scann")
DEFAULT_K = 10
# Rows scored at once (32 MB at D = 128); larger chunks were no faster (benchmarks/serving.py).
DEFAULT_CHUNK_ROWS = 65536
_SCANN_OPS = "scann.scann_ops.py.scann_ops"


def check_backend(backend: str) -> str:
    """``backend`` if it is one of :data:`BACKENDS` and can run here: a ValueError for
    an unknown name, a MissingExtraError for ``"scann"`` where ScaNN's TensorFlow ops
    do not load."""
    if backend not in BACKENDS:
        raise ValueError(f"`index_backend` must be one of {', '.join(BACKENDS)}; "
                         f"received {backend!r}")
    if backend == "scann":
        _scann_ops()
    return backend


def _scann_ops():
    from tfaploss import extras

    return extras.import_extra(
        "scann", "index_backend='scann' (ScaNN's TensorFlow ops inside the SavedModel; "
        "TF Serving then needs a build with those ops, stock TF Serving cannot load it: "
        "use index_backend='brute_force' there)", _SCANN_OPS)


def load_op_libraries(backend: str) -> None:
    """Load the custom ops a SavedModel of ``backend`` needs before
    ``tf.saved_model.load`` (none for brute force)."""
    if backend == "scann":
        _scann_ops()


def _search(searcher, queries, k):
    """Both searchers' ``search``: the signature's outputs for ``k`` of the searcher's
    ``searcher.k``; a ``k`` outside ``[1, searcher.k]`` fails the request with
    INVALID_ARGUMENT."""
    import tensorflow as tf

    k = tf.convert_to_tensor(k, tf.int32)
    check = tf.debugging.Assert(
        tf.logical_and(k >= 1, k <= searcher.k),
        ["retrieve: `k` must be between 1 and", searcher.k,
         "(the k this model was exported with); received", k])
    scores, rows = searcher.top_k(tf.cast(queries, tf.float32))
    with tf.control_dependencies([check]):
        scores, rows = tf.identity(scores[:, :k]), rows[:, :k]
    return {KEYS_OUTPUT: tf.gather(searcher.keys, rows),
            SCORES_OUTPUT: scores,
            LABELS_OUTPUT: tf.gather(searcher.labels, rows)}


class BruteForceSearch:
    """Exact top-k over an index held in three variables (rows, keys, labels).

    Cost per request: ``batch x N x D`` multiply-adds, a top-k per chunk and one over
    ``n_chunks x k`` candidates.
    """

    backend = "brute_force"

    def __init__(self, index, k: int, chunk_rows: int = DEFAULT_CHUNK_ROWS):
        import tensorflow as tf

        self.k = min(check_int("k", k), index.size)
        self.chunk_rows = check_int("index_chunk_rows", chunk_rows)
        self.size, self.dim = index.size, index.dim
        self.embeddings = tf.Variable(index.embeddings, trainable=False,
                                      name="retrieval_embeddings")
        self.keys, self.labels = _keys_and_labels(index)

    @property
    def variables(self) -> list:
        return [self.embeddings, self.keys, self.labels]

    def top_k(self, queries):
        """``(scores, rows)``, both ``[batch, k]``, sorted by score, ties by row."""
        import tensorflow as tf

        scores, rows = [], []
        for start in range(0, self.size, self.chunk_rows):
            stop = min(start + self.chunk_rows, self.size)
            product = tf.matmul(queries, self.embeddings[start:stop], transpose_b=True)
            s, r = tf.math.top_k(product, k=min(self.k, stop - start), sorted=True)
            scores.append(s)
            rows.append(r + start)
        if len(scores) == 1:
            return scores[0], rows[0]
        # Earlier chunks first: top_k keeps the lower position of equal scores, which is
        # then the lower row.
        best, position = tf.math.top_k(tf.concat(scores, 1), k=self.k, sorted=True)
        return best, tf.gather(tf.concat(rows, 1), position, batch_dims=1)

    search = _search


class ScannSearch:
    """ScaNN's tree + asymmetric hashing + exact re-ordering, as TF ops (approximate).

    Results are re-sorted by score with ties by row, like brute force, but a row ScaNN
    does not find is missing: check recall on your data before serving it.
    """

    backend = "scann"

    def __init__(self, index, k: int, chunk_rows: int = DEFAULT_CHUNK_ROWS):
        from tfaploss.evaluation.scann_search import configure_ah, scann_ah_params

        ops = _scann_ops()
        self.k = min(check_int("k", k), index.size)
        self.size, self.dim = index.size, index.dim
        params = scann_ah_params(index.size, index.dim)
        builder = configure_ah(ops.builder(index.embeddings, self.k, "dot_product"), params,
                               max(params["reorder_num_neighbors"], self.k))
        self._ops = ops
        self.state = builder.build().serialize_to_module()
        self.keys, self.labels = _keys_and_labels(index)

    @property
    def variables(self) -> list:
        return [*self.state.variables, self.keys, self.labels]

    def top_k(self, queries):
        import tensorflow as tf

        handle = self.state.recreate_handle()
        rows, scores = self._ops.scann_search_batched(handle, queries, self.k, -1, -1, False)
        rows = tf.cast(rows, tf.int32)
        # ScaNN leaves the order of equal scores open: by row first, then (stable) by score.
        by_row = tf.argsort(rows, axis=1, stable=True)
        rows = tf.gather(rows, by_row, batch_dims=1)
        scores = tf.gather(scores, by_row, batch_dims=1)
        by_score = tf.argsort(scores, axis=1, direction="DESCENDING", stable=True)
        return (tf.gather(scores, by_score, batch_dims=1),
                tf.gather(rows, by_score, batch_dims=1))

    search = _search


def _keys_and_labels(index):
    """The index's keys and labels as the variables every search holds."""
    import tensorflow as tf

    raw = np.array([str(key).encode("utf-8") for key in index.keys], dtype=object)
    return (tf.Variable(raw, trainable=False, dtype=tf.string, name="retrieval_keys"),
            tf.Variable(index.labels, trainable=False, dtype=tf.int64,
                        name="retrieval_labels"))


def make_search(index, k: int, backend: str = "brute_force",
                chunk_rows: int = DEFAULT_CHUNK_ROWS):
    """The searcher of ``backend`` over ``index`` (a
    :class:`~tfaploss.export.retrieval_index.RetrievalIndex`). Cost: a copy of the index
    into variables (and for ScaNN, training its tree and codebooks)."""
    backend = check_backend(backend)
    if k > index.size:
        logger.warning("retrieve: k=%d is more than the index's %d rows; k=%d is exported",
                       k, index.size, index.size)
    return (ScannSearch if backend == "scann" else BruteForceSearch)(index, k, chunk_rows)


def variables_digest(variables) -> str:
    """SHA-256 (hex) of the values of ``variables`` in order: what an export records of
    its index and :func:`tfaploss.export.load_retriever` checks. Cost: one pass."""
    digest = hashlib.sha256(b"tfaploss-retrieval-variables-v1")
    for variable in variables:
        value = np.asarray(variable.numpy())  # a scalar string variable gives bytes
        digest.update(f"{value.dtype.str}{value.shape}".encode())
        if value.dtype == object:
            for item in value.reshape(-1):
                digest.update(len(item).to_bytes(8, "little"))
                digest.update(item)
        else:
            digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()
