"""Cross-batch memory (XBM; Wang et al., "Cross-Batch Memory for Embedding Learning",
CVPR 2020), used as a baseline in ROADMAP (Ramzi et al., NeurIPS 2021, Table 2).

The memory is a ring buffer of the last ``size`` embeddings and labels seen in
training, held detached in non-trainable variables so that it works in graph mode,
under XLA and under ``tf.distribute``, and (``keras.ops`` only) on the JAX and PyTorch
backends, where ``MultiStageModel`` threads its variables through the stateless step. Each batch's queries are then also ranked
against the memory, which shows the loss many more negatives for the cost of a
(B x size) score matrix instead of a bigger batch.
"""

from __future__ import annotations

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfaploss")
class CrossBatchMemory(keras.layers.Layer):
    """Ring buffer of the last ``size`` (embedding, label) pairs, without gradients.

    ``enqueue(embeddings, labels)`` writes a batch (its last ``size`` rows if the batch
    is larger than the memory) over the oldest entries. ``query_loss(loss, labels,
    embeddings)`` is ``loss.query_database_loss`` of the queries against the filled
    slots, with the gradient stopped on the memory side; it is 0 while the memory is
    empty.

    Under a distribution strategy every replica must enqueue the same (global) batch:
    the variables keep the first replica's write.

    Args:
        size: number of slots, >= 1.
        embedding_dim: width of the stored embeddings.

    Memory: ``size * (embedding_dim * 4 + 8)`` bytes.
    """

    def __init__(self, size: int, embedding_dim: int, **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"CrossBatchMemory: `size` must be an int >= 1, received size={size!r}")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(
                "CrossBatchMemory: `embedding_dim` must be an int >= 1, received "
                f"embedding_dim={embedding_dim!r}"
            )
        self.size = size
        self.embedding_dim = embedding_dim
        # Replicas all write the same global batch; keep one copy of the write.
        common = {"trainable": False, "aggregation": "only_first_replica"}
        self.embeddings = self.add_weight(
            name="embeddings", shape=(size, embedding_dim), initializer="zeros",
            dtype="float32", **common)
        self.labels = self.add_weight(
            name="labels", shape=(size,), initializer="zeros", dtype="int64", **common)
        self.pointer = self.add_weight(
            name="pointer", shape=(), initializer="zeros", dtype="int32", **common)
        self.filled = self.add_weight(
            name="filled", shape=(), initializer="zeros", dtype="int32", **common)
        self.built = True

    def valid_mask(self):
        """Bool (size,): which slots hold an entry."""
        return ops.arange(self.size, dtype="int32") < ops.convert_to_tensor(self.filled)

    def enqueue(self, embeddings, labels):
        """Write ``embeddings`` (B, D) and ``labels`` (B,) over the oldest slots."""
        embeddings = ops.cast(ops.stop_gradient(embeddings), "float32")
        labels = ops.cast(ops.reshape(labels, (-1,)), "int64")
        n = embeddings.shape[0]
        if n is None:  # a TF graph traced for any batch size
            n = ops.shape(embeddings)[0]
            k = ops.minimum(n, self.size)
        else:
            k = min(n, self.size)
        embeddings, labels = embeddings[n - k:], labels[n - k:]
        pointer = ops.convert_to_tensor(self.pointer)
        slots = ops.mod(pointer + ops.arange(k, dtype="int32"), self.size)[:, None]
        self.embeddings.assign(
            ops.scatter_update(ops.convert_to_tensor(self.embeddings), slots, embeddings))
        self.labels.assign(
            ops.scatter_update(ops.convert_to_tensor(self.labels), slots, labels))
        self.pointer.assign(ops.mod(pointer + ops.cast(k, "int32"), self.size))
        self.filled.assign(
            ops.minimum(ops.convert_to_tensor(self.filled) + ops.cast(k, "int32"), self.size))

    def query_loss(self, loss, query_labels, query_embeddings, sample_weight=None):
        """``loss.query_database_loss`` of the queries against the memory (0 if empty).

        Reduced as ``loss`` reduces its own terms (its ``reduction``), with
        ``sample_weight`` (one weight per query) when given.
        Cost: that of ``loss`` on a (B, size) score matrix.
        """
        memory = ops.stop_gradient(ops.convert_to_tensor(self.embeddings))
        memory_labels = ops.stop_gradient(ops.convert_to_tensor(self.labels))
        query_labels = ops.reshape(query_labels, (-1,))
        if "int" in keras.backend.standardize_dtype(query_labels.dtype):
            memory_labels = ops.cast(memory_labels, query_labels.dtype)
        else:  # float label ids (Keras may hand y as float32): compare as int64
            query_labels = ops.cast(query_labels, "int64")
        candidates = ops.broadcast_to(self.valid_mask()[None, :],
                                      (ops.shape(query_labels)[0], self.size))

        # Passed only when given: a custom loss's query_database_loss may not take it.
        weights = {} if sample_weight is None else {"sample_weight": sample_weight}

        def with_memory():
            value = loss.query_database_loss(
                query_labels, query_embeddings, memory_labels, memory, candidates=candidates,
                **weights)
            return ops.cast(value, "float32")

        return ops.cond(ops.convert_to_tensor(self.filled) > 0, with_memory,
                        lambda: ops.zeros((), "float32"))

    def get_config(self):
        config = super().get_config()
        config.update(size=self.size, embedding_dim=self.embedding_dim)
        return config
