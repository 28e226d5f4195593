"""Multi-staged backpropagation (Revaud et al., "Learning with Average Precision:
Training Image Retrieval with a Listwise Loss", ICCV 2019, §3.3).

An AP loss ranks every image of a batch against every other one, and retrieval
results keep improving up to batches of ~4096 images, which cannot be backpropagated
at once. The gradient of a batch loss ``L(E)`` with ``E = f_theta(X)`` factors as

    dL/dtheta = sum_chunks  (d e_chunk / d theta)^T  G[chunk],   G = dL/dE  (B x d),

so it is computed exactly in three stages: (1) embed the batch chunk by chunk, keeping
no activations; (2) take ``G = dL/dE`` of the loss on the B embeddings (B x d
numbers); (3) re-embed each chunk and accumulate ``(d e_chunk / d theta)^T G[chunk]``;
then one optimizer update per batch. Keras's ``gradient_accumulation_steps`` is not
this: it averages per-chunk losses.

Exact only if stage 3 sees what stage 1 saw (:mod:`tfaploss.training.checks`). Stages
2 and 3 need the backend's autodiff: ``multistage_tf``, ``multistage_jax``,
``multistage_torch``; the rest is here, in ``keras.ops``.
"""

from __future__ import annotations

import logging

import keras
from keras import ops, tree

from tfaploss._keras_compat import unscale_loss_for_distribution  # private Keras API
from tfaploss.losses.base import RetrievalLoss
from tfaploss.losses.xbm import CrossBatchMemory
from tfaploss.ops.distribute import global_batch
from tfaploss.training.checks import batch_statistics_layers, check_deterministic

logger = logging.getLogger(__name__)


def _backend_steps():
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from tfaploss.training.multistage_tf import TensorFlowSteps as steps
    elif backend == "jax":
        from tfaploss.training.multistage_jax import JaxSteps as steps
    elif backend == "torch":
        from tfaploss.training.multistage_torch import TorchSteps as steps
    else:
        class steps:
            def train_step(self, *args, **kwargs):
                raise NotImplementedError(
                    "MultiStageModel trains on the tensorflow, jax and torch backends; "
                    f"KERAS_BACKEND is {backend!r}")
    return steps


@keras.saving.register_keras_serializable(package="tfaploss")
class MultiStageModel(_backend_steps(), keras.Model):
    """Train an embedding model on very large batches with the exact batch gradient.

    Wraps ``embedding_model`` (images -> embeddings, the model to export); ``compile``
    it with a batch-level ranking loss and ``fit`` on (images, labels) batches. With
    ``chunk_size`` set, ``train_step`` runs the module's three stages; either way the
    update equals one plain step on the whole batch (``optimizer.iterations`` counts
    batches).

    Under ``tf.distribute`` every replica gathers the embeddings and labels, ranks the
    GLOBAL batch and backpropagates its own rows; the compiled losses must be
    ``RetrievalLoss``es, all reducing by a mean or all by a sum. Under
    ``torch.distributed`` call ``fit`` on every rank with its shard of each global
    batch, WITHOUT DistributedDataParallel (``multistage_torch``). Mixed precision: the
    optimizer scales the loss before ``G`` is taken and unscales the gradient.

    Cross-batch memory (``xbm_size > 0``): the last ``xbm_size`` stage-1 embeddings and
    labels are kept (detached) and the loss gains ``xbm_weight *
    loss.query_database_loss(batch, memory)``.

    Args:
        embedding_model: a Keras model mapping inputs to (B, d) embeddings.
        chunk_size: images per forward/backward chunk (int >= 1; batches need not be a
            multiple), or ``None`` for a single-pass step. Under data parallelism it
            counts images *per device*.
        xbm_size, xbm_weight: cross-batch memory slots (0 = no memory), and the weight
            of the query-vs-memory loss.
        xbm_loss: loss for the memory term (default: the compiled loss).
        on_nondeterministic: ``"warn"``, ``"raise"`` or ``"ignore"`` when
            ``embedding_model`` is random in training mode and ``chunk_size`` is set.
        check_stages: debug check: the largest difference between stage-3 and stage-1
            embeddings, asserted <= ``stage_atol`` (JAX and XLA only report it) and
            logged as the metric ``stage_max_abs_diff``.
        stage_atol: tolerance of ``check_stages``.

    Only weight regularisers are added to the loss (no single call sees the whole
    batch, so ``add_loss`` is not supported). Cost per step with chunk size c: 2
    forward passes + 1 backward pass (time ~ 4/3 of a plain step), one loss evaluation
    with its gradient; activation memory of one chunk of c images plus O(B·d) for the
    embeddings and ``G``.
    """

    def __init__(self, embedding_model, chunk_size=None, xbm_size=0, xbm_weight=1.0,
                 xbm_loss=None, on_nondeterministic="warn", check_stages=False,
                 stage_atol=1e-5, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(embedding_model, keras.layers.Layer):
            raise TypeError("MultiStageModel: `embedding_model` must be a Keras model or "
                            f"layer, received {type(embedding_model).__name__}")
        if chunk_size is not None and (not isinstance(chunk_size, int)
                                       or isinstance(chunk_size, bool) or chunk_size < 1):
            raise ValueError("MultiStageModel: `chunk_size` must be an int >= 1 or None, "
                             f"received chunk_size={chunk_size!r}")
        if not isinstance(xbm_size, int) or isinstance(xbm_size, bool) or xbm_size < 0:
            raise ValueError("MultiStageModel: `xbm_size` must be an int >= 0, received "
                             f"xbm_size={xbm_size!r}")
        if xbm_loss is not None and not hasattr(xbm_loss, "query_database_loss"):
            raise ValueError("MultiStageModel: `xbm_loss` must have a `query_database_loss` "
                             "method (a tfaploss.losses.RetrievalLoss), received "
                             f"{type(xbm_loss).__name__}")
        if not stage_atol >= 0:
            raise ValueError(f"MultiStageModel: `stage_atol` must be >= 0, received {stage_atol!r}")
        self.embedding_model = embedding_model
        self.chunk_size = chunk_size
        self.xbm_size = xbm_size
        self.xbm_weight = float(xbm_weight)
        self.xbm_loss = xbm_loss
        self.on_nondeterministic = on_nondeterministic
        self.check_stages = bool(check_stages)
        self.stage_atol = float(stage_atol)
        if on_nondeterministic not in ("warn", "raise", "ignore"):
            raise ValueError("MultiStageModel: `on_nondeterministic` must be 'warn', 'raise' "
                             f"or 'ignore', received on_nondeterministic={on_nondeterministic!r}")
        # A single-pass step embeds once, so randomness cannot make it inexact.
        problems = check_deterministic(
            embedding_model, on_nondeterministic if chunk_size is not None else "ignore")
        self.nondeterministic_layers = tuple(problems)
        ghosts = batch_statistics_layers(embedding_model) if chunk_size is not None else []
        if ghosts:
            logger.info(
                "MultiStageModel: %d BatchNorm layer(s) use batch statistics, so each "
                "normalises every chunk of %d images on its own (ghost batch norm; the "
                "gradient is exact for that network): %s", len(ghosts), chunk_size,
                ", ".join(layer.name for layer in ghosts))

        self.memory = None
        if xbm_size:
            self.memory = CrossBatchMemory(
                xbm_size, self._embedding_dim(), name="cross_batch_memory")
            self.xbm_loss_tracker = keras.metrics.Mean(name="xbm_loss")
        if self.check_stages:
            self.stage_diff_tracker = keras.metrics.Mean(name="stage_max_abs_diff")
        if getattr(embedding_model, "built", False):
            self.built = True

    def _embedding_dim(self) -> int:
        try:
            dim = self.embedding_model.output_shape[-1]
        except (AttributeError, ValueError, RuntimeError):
            dim = None
        if not isinstance(dim, int):
            raise ValueError("MultiStageModel: cross-batch memory needs the embedding width; "
                             f"build `embedding_model` ({self.embedding_model.name!r}) first "
                             "(give it an input shape or call it once) so that its "
                             "output_shape is known")
        return dim

    def call(self, inputs, training=None):
        return self.embedding_model(inputs, training=training)

    def compute_output_shape(self, input_shape):
        return self.embedding_model.compute_output_shape(input_shape)

    def _embed(self, x):
        return self.embedding_model(x, training=True)

    def _chunk_bounds(self, batch: int) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` of the chunks of a batch of static size ``batch``."""
        c = self.chunk_size or batch
        return [(start, min(start + c, batch)) for start in range(0, batch, c)]

    def _check_trainable(self):
        if not self.trainable_variables:
            raise ValueError("MultiStageModel: the embedding model has no trainable weights.")

    def _memory_loss_fn(self):
        if self.xbm_loss is not None:
            return self.xbm_loss
        losses = [l for l in tree.flatten(self.loss) if l is not None]
        if len(losses) == 1 and hasattr(losses[0], "query_database_loss"):
            return losses[0]
        raise ValueError("MultiStageModel: cross-batch memory needs a loss with a "
                         "query-vs-database form; compile with one "
                         "tfaploss.losses.RetrievalLoss or pass `xbm_loss`. Compiled loss: "
                         f"{self.loss!r}")

    def _loss_variable_ids(self) -> set:
        """``id``s of the variables the compiled loss reads itself (class proxies)."""
        from tfaploss.losses.proxies import ClassProxies

        found, stack = set(), [self.embedding_model]
        while stack:
            layer = stack.pop()
            if isinstance(layer, ClassProxies):
                found.update(id(v) for v in layer.trainable_variables)
            stack.extend(getattr(layer, "layers", ()))
        return found

    @staticmethod
    def _divided_per_replica(loss_fn) -> bool:
        """Whether Keras divides ``loss_fn``'s value by the replicas (a mean, under
        ``tf.distribute``), which ``_objective`` undoes: every replica ranks the GLOBAL
        batch."""
        return (isinstance(loss_fn, RetrievalLoss)
                and loss_fn.reduction in ("sum_over_batch_size", "mean",
                                          "mean_with_sample_weight"))

    def _objective(self, y, embeddings, sample_weight):
        """Stage 2's function of the (global) embeddings: ``(scaled, (total,
        memory_loss))``, the optimizer-scaled loss to differentiate, the loss to report
        and the unweighted cross-batch memory term (0 without memory)."""
        memory_loss_fn = self._memory_loss_fn() if self.memory is not None else None
        # the step gathered the global batch already: the losses must not gather again
        with global_batch():
            loss = self._compile_loss(y, embeddings, sample_weight)
        if loss is None:
            raise ValueError("MultiStageModel: no loss to compute. Provide `loss` in `compile()`.")
        compiled = [l for l in tree.flatten(self.loss) if l is not None]
        if compiled and all(self._divided_per_replica(l) for l in compiled):
            loss = unscale_loss_for_distribution(loss)
        total = loss
        memory_loss = ops.zeros((), "float32")
        if self.memory is not None:
            with global_batch():
                memory_loss = self.memory.query_loss(memory_loss_fn, y, embeddings,
                                                     sample_weight)
            if self._divided_per_replica(memory_loss_fn):
                memory_loss = unscale_loss_for_distribution(memory_loss)
            weighted = ops.cast(memory_loss, loss.dtype) * self.xbm_weight
            loss = loss + weighted
            total = total + weighted
        for extra in self._get_regularization_losses():
            extra = self._aggregate_additional_loss(extra)
            loss = loss + ops.cast(extra, loss.dtype)
            total = total + ops.cast(unscale_loss_for_distribution(extra), total.dtype)
        scaled = self.optimizer.scale_loss(loss) if self.optimizer is not None else loss
        return scaled, (total, memory_loss)

    def _update_trackers(self, total, memory_loss, diff, batch):
        self._loss_tracker.update_state(total, sample_weight=batch)
        if self.memory is not None:
            self.xbm_loss_tracker.update_state(memory_loss)
        if self.check_stages:
            self.stage_diff_tracker.update_state(diff)

    @staticmethod
    def _max_abs_diff(a, b):
        gap = ops.abs(ops.cast(a, "float32") - ops.cast(b, "float32"))
        return ops.max(ops.concatenate([ops.reshape(gap, (-1,)), ops.zeros((1,), "float32")]))

    def _stage_check_message(self, diff=None) -> str:
        by = "" if diff is None else f" by {float(diff):.3g}"
        return (f"MultiStageModel(check_stages=True): stage-3 embeddings differ from "
                f"stage-1 embeddings{by} (more than stage_atol={self.stage_atol:g}); the "
                "model is not deterministic in training mode (dropout? batch-statistics "
                "BatchNorm? augmentation in the model?)")

    def get_config(self):
        config = super().get_config()
        config.update(
            embedding_model=keras.saving.serialize_keras_object(self.embedding_model),
            chunk_size=self.chunk_size, xbm_size=self.xbm_size, xbm_weight=self.xbm_weight,
            xbm_loss=(None if self.xbm_loss is None
                      else keras.saving.serialize_keras_object(self.xbm_loss)),
            on_nondeterministic=self.on_nondeterministic, check_stages=self.check_stages,
            stage_atol=self.stage_atol)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["embedding_model"] = keras.saving.deserialize_keras_object(
            config["embedding_model"])
        if config.get("xbm_loss") is not None:
            config["xbm_loss"] = keras.saving.deserialize_keras_object(config["xbm_loss"])
        return cls(**config)
