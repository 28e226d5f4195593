"""Cross-batch memory (XBM; Wang et al., "Cross-Batch Memory for Embedding Learning",
CVPR 2020): the ring buffer and the loss wrapper that ranks each batch against it."""

from __future__ import annotations

import math

import keras
from keras import ops

from tfaploss._keras_compat import in_symbolic_scope  # private Keras API
from tfaploss.losses._checks import check, check_labels, check_sizes, concrete, integer, is_number
from tfaploss.losses.base import RetrievalLoss
from tfaploss.ops import distribute
from tfaploss.ops.backend import dim


@keras.saving.register_keras_serializable(package="tfaploss")
class CrossBatchMemory(keras.layers.Layer):
    """Ring buffer of the last ``size`` (embedding, label) pairs, without gradients.

    Held in non-trainable variables (graph mode, XLA, every backend). Called as a layer
    it returns its input unchanged and keeps the call's ``training`` flag for the next
    :class:`XBMLoss` call (a Keras loss is not told whether it runs in a training
    step; the model's layers are). Under a distribution strategy every replica must
    enqueue the same (global) batch: the variables keep the first replica's write.

    Args:
        size: number of slots, >= 1.
        embedding_dim: width of the stored embeddings; None: that of the first input
            the layer is built for.

    Memory: ``size * (embedding_dim * 4 + 8)`` bytes.
    """

    def __init__(self, size: int, embedding_dim: int | None = None, **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("trainable", False)
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self.size = integer("CrossBatchMemory", "size", size)
        self.embedding_dim = integer("CrossBatchMemory", "embedding_dim", embedding_dim,
                                     optional=True)
        self.supports_masking = True
        # (replica, shape-only?) -> `training` of the last call not yet taken by a loss.
        self._pending_training = {}
        if embedding_dim is not None:
            self.build((None, embedding_dim))

    def build(self, input_shape):
        dim = input_shape[-1]
        if len(input_shape) != 2 or dim is None:
            raise ValueError(
                "CrossBatchMemory: expects embeddings of shape (batch, dim) with a known "
                f"dim; received input_shape={tuple(input_shape)}")
        if self.embedding_dim is None:
            self.embedding_dim = int(dim)
        elif int(dim) != self.embedding_dim:
            raise ValueError(
                f"CrossBatchMemory: built for embedding_dim={self.embedding_dim}; "
                f"received input_shape={tuple(input_shape)}")
        def weight(name, shape, dtype):
            # Replicas all write the same global batch; keep one copy of the write.
            return self.add_weight(name=name, shape=shape, initializer="zeros", dtype=dtype,
                                   trainable=False, aggregation="only_first_replica")

        self.embeddings = weight("embeddings", (self.size, self.embedding_dim), "float32")
        self.labels = weight("labels", (self.size,), "int64")
        self.pointer = weight("pointer", (), "int32")
        self.filled = weight("filled", (), "int32")
        self.built = True

    def call(self, inputs, training=None):
        """``inputs`` unchanged; keeps ``training`` for the next :class:`XBMLoss` call."""
        key = (distribute.replica_id(), in_symbolic_scope())
        self._pending_training[key] = bool(training)
        return inputs

    def take_training(self):
        """The ``training`` flag of this layer's last call on this replica, or None when
        no call came since the previous take. Shape-only traces are kept apart and not
        taken (PyTorch's shape inference may run model and loss twice)."""
        symbolic = in_symbolic_scope()
        key = (distribute.replica_id(), symbolic)
        pending = self._pending_training
        return pending.get(key) if symbolic else pending.pop(key, None)

    def valid_mask(self):
        """Bool (size,): which slots hold an entry."""
        return ops.arange(self.size, dtype="int32") < ops.convert_to_tensor(self.filled)

    def enqueue(self, embeddings, labels):
        """Write ``embeddings`` (B, D) and ``labels`` (B,) over the oldest slots."""
        embeddings = ops.cast(ops.stop_gradient(embeddings), "float32")
        labels = ops.cast(ops.reshape(labels, (-1,)), "int64")
        n = dim(embeddings, 0)  # a tensor in a TF graph traced for any batch size
        k = min(n, self.size) if isinstance(n, int) else ops.minimum(n, self.size)
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
        """``loss.query_database_loss`` of the queries against the filled slots, the
        gradient stopped on the memory side (0 while empty). Cost: that of ``loss`` on a
        (B, size) score matrix."""
        memory = ops.stop_gradient(ops.convert_to_tensor(self.embeddings))
        if keras.backend.backend() == "torch":
            # PyTorch's assign writes in place; an enqueue after this call (XBMLoss
            # enqueues before the backward pass) must not change the saved tensor.
            memory = ops.copy(memory)
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

        # Both branches must have one shape: one term per query without a reduction.
        per_query = getattr(loss, "reduction", None) in (None, "none")
        empty_shape = (ops.shape(query_labels)[0],) if per_query else ()
        filled = ops.convert_to_tensor(self.filled) > 0
        known = concrete(filled)
        if known is not None:  # eager: no cond to trace (on JAX, traced on every call)
            return with_memory() if bool(known) else ops.zeros(empty_shape, "float32")
        return ops.cond(filled, with_memory, lambda: ops.zeros(empty_shape, "float32"))

    def load_own_variables(self, store):
        # The memory is saved with the model's layers; a reloaded loss's fresh memory
        # finds nothing under the loss and stays empty.
        if len(store) == 0:
            return
        super().load_own_variables(store)

    def get_config(self):
        config = super().get_config()
        config.update(size=self.size, embedding_dim=self.embedding_dim)
        return config


@keras.saving.register_keras_serializable(package="tfaploss")
class XBMLoss(keras.losses.Loss):
    """A ranking loss plus its loss against a cross-batch memory of past batches (Wang et
    al., "Cross-Batch Memory for Embedding Learning", CVPR 2020). With ``L`` the wrapped
    ``loss`` and ``M`` the last ``size`` training embeddings and labels::

        XBMLoss(y, e) = L(y, e) + weight * L.query_database_loss(y, e, M_y, stop_gradient(M_e))

    after which a training step writes the batch's detached ``(e, y)`` over the oldest
    slots of ``M``. The memory term is 0 while the memory is empty; both terms are
    reduced as ``loss`` reduces. The memory is a layer, ``loss.memory``, that must sit
    on the model's embedding output (it returns its input unchanged)::

        xbm = XBMLoss(APLoss(), size=4096)
        outputs = xbm.memory(backbone(inputs))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer, loss=xbm)
        model.fit(...)

    That way its variables are model state (threaded through JAX's jitted step, saved
    with the model) and only training steps write to it. The loss raises RuntimeError
    when the layer was not called since its previous call; in a custom loop call
    ``xbm.memory(embeddings, training=True)`` first. After ``load_model`` compile
    with ``XBMLoss(loss, memory=model.get_layer(name))`` to reuse the loaded memory.
    Under ``tf.distribute`` every replica ranks the gathered global batch and writes
    it; create the loss in ``strategy.scope()``.

    Args:
        loss: the wrapped :class:`~tfaploss.losses.RetrievalLoss` (or its config).
        size: memory slots, an int >= 1 (the paper uses thousands).
        embedding_dim: width of the embeddings; None: taken when the model builds the
            memory layer.
        weight: weight of the memory term, a finite float >= 0.
        memory: a :class:`CrossBatchMemory` to use instead of a new one (``size`` and
            ``embedding_dim`` then default to its own).
        name: name of the loss.

    Cost of a call: the wrapped loss on the (B, B) and on a (B, size) score matrix, and
    a scatter of B rows; the memory holds ``size * (4 * embedding_dim + 8)`` bytes.
    """

    def __init__(self, loss, size=None, embedding_dim=None, weight=1.0, memory=None,
                 name="xbm_loss"):
        if isinstance(loss, dict):
            loss = keras.saving.deserialize_keras_object(loss)
        if not isinstance(loss, RetrievalLoss):
            raise ValueError(  # noqa: TRY004 - the project's argument errors are ValueErrors
                "XBMLoss: `loss` must be a tfaploss.losses.RetrievalLoss (it needs "
                f"query_database_loss), received loss={loss!r} of type {type(loss).__name__}")
        if memory is not None:
            if not isinstance(memory, CrossBatchMemory):
                raise ValueError(
                    f"XBMLoss: `memory` must be a CrossBatchMemory, received memory={memory!r}")
            for arg, value, own in (("size", size, memory.size),
                                    ("embedding_dim", embedding_dim, memory.embedding_dim)):
                if value is not None and value != own:
                    raise ValueError(
                        f"XBMLoss: `{arg}`={value!r} differs from the given memory's "
                        f"{arg}={own!r}")
        self.weight = float(check("XBMLoss", "weight", weight, is_number(weight)
                                  and math.isfinite(weight) and weight >= 0,
                                  "a finite number >= 0"))
        super().__init__(name=name, reduction=loss.reduction, dtype=loss.dtype)
        self.loss = loss
        self.memory = memory if memory is not None else CrossBatchMemory(size, embedding_dim)

    @property
    def size(self):
        return self.memory.size

    def __call__(self, y_true, y_pred, sample_weight=None):
        """The loss of the batch plus ``weight`` times its loss against the memory; a
        training call then enqueues the batch."""
        training = self.memory.take_training()
        if training is None:
            raise RuntimeError(
                f"XBMLoss: its memory layer {self.memory.name!r} was not called since the "
                "loss's previous call, so the loss cannot tell a training step from "
                "evaluation (and on JAX the memory would not be part of the model's "
                "state). Put it on the model's embedding output: `outputs = "
                "xbm.memory(embeddings)`; in a custom loop call `xbm.memory(embeddings, "
                "training=True)` before the loss.")
        if in_symbolic_scope():  # Keras traces the call for its output shapes only
            return self.loss(y_true, y_pred, sample_weight)
        owner = type(self).__name__
        replicas = distribute.replicas_to_gather(owner)
        with keras.name_scope(self.name):
            embeddings = ops.convert_to_tensor(y_pred)
            labels = check_sizes(owner, check_labels(y_true), embeddings)
            self._check_state(embeddings)
            if replicas == 1:
                return self._loss_and_enqueue(labels, embeddings, sample_weight, training)
            # Gathered, weighted and shared as the wrapped loss does.
            return self.loss._rank_global_batch(
                labels, embeddings, sample_weight, replicas,
                lambda labels, embeddings, weights: self._loss_and_enqueue(
                    labels, embeddings, weights, training))

    def _loss_and_enqueue(self, labels, embeddings, sample_weight, training):
        batch = self.loss(labels, embeddings, sample_weight)
        memory = self.memory.query_loss(self.loss, labels, embeddings, sample_weight)
        total = batch + ops.cast(memory, batch.dtype) * ops.cast(self.weight, batch.dtype)
        if training:  # after the memory term: the memory holds earlier batches only
            self.memory.enqueue(embeddings, labels)
        return total

    def _check_state(self, embeddings):
        """Refuse a JAX trace whose threaded state lacks the memory (writes lost)."""
        if keras.backend.backend() != "jax":
            return
        import jax

        if isinstance(embeddings, jax.core.Tracer) and not isinstance(
                ops.convert_to_tensor(self.memory.pointer), jax.core.Tracer):
            raise RuntimeError(  # noqa: TRY004 - a model set up wrongly, not a bad type
                f"XBMLoss: on JAX its memory layer {self.memory.name!r} must be part of the "
                "model that is trained (`outputs = xbm.memory(embeddings)`), so that "
                "Keras threads its variables through the jitted step.")

    def get_config(self):
        return {"loss": keras.saving.serialize_keras_object(self.loss), "size": self.size,
                "embedding_dim": self.memory.embedding_dim, "weight": self.weight,
                "name": self.name}
