"""Multi-staged backpropagation (Revaud et al., "Learning with Average Precision:
Training Image Retrieval with a Listwise Loss", ICCV 2019, §3.3).

An AP loss ranks every image of a batch against every other one, and retrieval
results keep improving up to batches of ~4096 images, which cannot be backpropagated
at once. The gradient of a batch loss ``L(E)`` with ``E = f_theta(X)`` factors as

    dL/dtheta = sum_chunks  (d e_chunk / d theta)^T  G[chunk],   G = dL/dE  (B x d),

so it is computed exactly in three stages:

1. embed the batch chunk by chunk, keeping no activations;
2. evaluate the loss on the B embeddings under a tape and take ``G = dL/dE`` (cheap:
   B x d numbers);
3. re-embed each chunk under a tape and accumulate
   ``tape.gradient(e_chunk, theta, output_gradients=G[chunk])``;

then apply one optimizer update per batch. Peak activation memory is that of one chunk;
the price is a second forward pass (time ~ (2 fwd + 1 bwd) / (1 fwd + 1 bwd) ~ 4/3).
Keras's ``gradient_accumulation_steps`` is not this: it averages separate per-chunk
losses, while AP must rank over the whole batch.

Exact only if stage 3 sees what stage 1 saw: augment in the input pipeline (never
inside the model), no dropout, and BatchNorm with frozen statistics
(:func:`tfaploss.training.freeze_batch_norm`).
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import tree
from keras.src.losses.loss import unscale_loss_for_distribution

from tfaploss.training.checks import check_deterministic
from tfaploss.training.xbm import CrossBatchMemory


def _rows(x, start, size):
    """Rows ``start:start+size`` of every tensor in ``x``, with a static row count."""
    # `start + range(size)` keeps the shape a compile-time constant under XLA.
    index = start + tf.range(size)
    return tree.map_structure(lambda t: tf.gather(t, index), x)


def _tail(x, start):
    return tree.map_structure(lambda t: t[start:], x)


def _batch_size(x):
    """Static batch size if known, else a scalar tensor."""
    first = tree.flatten(x)[0]
    static = first.shape[0]
    return static if static is not None else tf.shape(first)[0]


def _dense(gradient, variable):
    if gradient is None:
        return tf.zeros(variable.shape, variable.dtype)
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


@keras.saving.register_keras_serializable(package="tfaploss")
class MultiStageModel(keras.Model):
    """Train an embedding model on very large batches with the exact batch gradient.

    Wraps ``embedding_model`` (images -> embeddings); ``compile`` it with a batch-level
    ranking loss (e.g. ``tfaploss.losses.APLoss()``) and ``fit`` on (images, labels)
    batches as usual. With ``chunk_size`` set, ``train_step`` runs the three stages
    of multi-staged backpropagation (module docstring); with ``chunk_size=None`` it is
    an ordinary single-pass step. Either way the update equals that of one plain step
    on the whole batch, and ``optimizer.iterations`` (hence learning-rate schedules)
    counts batches, not chunks.

    ``call``, ``predict`` and ``evaluate`` run the embedding model; ``save`` stores it
    inside this wrapper (``keras.saving.load_model`` gives a ``MultiStageModel`` back),
    and ``embedding_model`` is the model to export.

    Under ``tf.distribute.MirroredStrategy`` the loss ranks the GLOBAL batch: every
    replica all-gathers the embeddings and labels, evaluates the loss on all of them,
    and backpropagates the rows it owns; the optimizer's all-reduce sums the replicas'
    parts into the global gradient. The compiled losses must then be batch-level
    ranking losses (``tfaploss.losses.RetrievalLoss``), which Keras does not rescale
    per replica. ``evaluate`` stays per replica.

    Mixed precision (``mixed_float16``): the losses compute in float32, the loss is
    scaled by the (``LossScaleOptimizer``) optimizer before ``G`` is taken, and the
    optimizer unscales the accumulated gradient and skips non-finite steps.

    Cross-batch memory: with ``xbm_size > 0`` the last ``xbm_size`` embeddings and
    labels of previous batches are kept (detached) and the loss gains
    ``xbm_weight * loss.query_database_loss(batch, memory)``; the memory is updated
    after the step with the batch's stage-1 embeddings. ``xbm_size=0`` is the plain
    loss.

    Args:
        embedding_model: a Keras model mapping inputs to (B, d) embeddings.
        chunk_size: images per forward/backward chunk (int >= 1), or ``None`` for a
            single-pass step. Batches need not be a multiple of it.
        xbm_size: cross-batch memory slots (0 = no memory).
        xbm_weight: weight of the query-vs-memory loss.
        xbm_loss: loss for the memory term (must have ``query_database_loss``);
            defaults to the compiled loss.
        on_nondeterministic: what to do when ``embedding_model`` is random in training
            mode (dropout, batch-statistics BatchNorm, augmentation layers) and
            ``chunk_size`` is set: ``"warn"`` (default), ``"raise"`` or ``"ignore"``.
        check_stages: debug check; stage 3 also measures the largest absolute
            difference between its embeddings and stage 1's, asserts it is <=
            ``stage_atol`` (outside XLA, where asserts are dropped) and reports it as
            the metric ``stage_max_abs_diff`` (per-step maximum, averaged over the
            epoch).
        stage_atol: tolerance of ``check_stages``.

    Example::

        model = freeze_batch_norm(models.build_embedding_model("resnet101", "gem"))
        trainer = MultiStageModel(model, chunk_size=32)
        trainer.compile(optimizer=keras.optimizers.Adam(1e-4), loss=APLoss())
        trainer.fit(dataset_of_4096_image_batches, epochs=...)
        model.save("embedder.keras")  # the plain embedding model, for export

    Cost per step with chunk size c: 2 forward passes + 1 backward pass of the
    embedding model, one loss evaluation with its gradient; activation memory of one
    chunk of c images plus O(B·d) for the embeddings and ``G``.
    """

    def __init__(
        self,
        embedding_model,
        chunk_size=None,
        xbm_size=0,
        xbm_weight=1.0,
        xbm_loss=None,
        on_nondeterministic="warn",
        check_stages=False,
        stage_atol=1e-5,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(embedding_model, keras.layers.Layer):
            raise TypeError(
                "MultiStageModel: `embedding_model` must be a Keras model or layer, "
                f"received {type(embedding_model).__name__}"
            )
        if chunk_size is not None and (
            not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
        ):
            raise ValueError(
                "MultiStageModel: `chunk_size` must be an int >= 1 or None, received "
                f"chunk_size={chunk_size!r}"
            )
        if not isinstance(xbm_size, int) or isinstance(xbm_size, bool) or xbm_size < 0:
            raise ValueError(
                f"MultiStageModel: `xbm_size` must be an int >= 0, received xbm_size={xbm_size!r}"
            )
        if xbm_loss is not None and not hasattr(xbm_loss, "query_database_loss"):
            raise ValueError(
                "MultiStageModel: `xbm_loss` must have a `query_database_loss` method "
                f"(a tfaploss.losses.RetrievalLoss), received {type(xbm_loss).__name__}"
            )
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
            raise ValueError(
                "MultiStageModel: `on_nondeterministic` must be 'warn', 'raise' or "
                f"'ignore', received on_nondeterministic={on_nondeterministic!r}"
            )
        # A single-pass step embeds once, so randomness cannot make it inexact.
        problems = check_deterministic(
            embedding_model, on_nondeterministic if chunk_size is not None else "ignore")
        self.nondeterministic_layers = tuple(problems)

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
        known = isinstance(dim, int)
        if not known:
            raise ValueError(
                "MultiStageModel: cross-batch memory needs the embedding width; build "
                f"`embedding_model` ({self.embedding_model.name!r}) first (give it an "
                "input shape or call it once) so that its output_shape is known"
            )
        return dim

    # -- inference delegates to the embedding model -------------------------------

    def call(self, inputs, training=None):
        return self.embedding_model(inputs, training=training)

    def compute_output_shape(self, input_shape):
        return self.embedding_model.compute_output_shape(input_shape)

    # -- training -------------------------------------------------------------------

    def _embed(self, x):
        return self.embedding_model(x, training=True)

    def _embedding_spec(self, x, rows):
        spec = tree.map_structure(
            lambda t: keras.KerasTensor((rows,) + tuple(t.shape[1:]), dtype=t.dtype.name), x)
        return self.embedding_model.compute_output_spec(spec)

    def _embed_in_chunks(self, x):
        """Stage 1: embeddings of the whole batch, no activations kept."""
        c = self.chunk_size
        batch = _batch_size(x)
        n_full = batch // c
        spec = self._embedding_spec(x, c)

        def body(i, parts):
            return i + 1, parts.write(i, self._embed(_rows(x, i * c, c)))

        parts = tf.TensorArray(spec.dtype, size=n_full, element_shape=spec.shape)
        # One chunk at a time: parallel iterations would keep several chunks alive.
        _, parts = tf.while_loop(lambda i, _: i < n_full, body, (tf.constant(0), parts),
                                 parallel_iterations=1)
        full = tf.reshape(parts.stack(), (-1,) + tuple(spec.shape[1:]))
        start = n_full * c
        width = tuple(spec.shape[1:])
        if isinstance(batch, int):
            if batch == start:
                return full
            return tf.concat([full, self._embed(_tail(x, start))], axis=0)
        tail = tf.cond(batch > start, lambda: self._embed(_tail(x, start)),
                       lambda: tf.zeros((0,) + width, spec.dtype))
        return tf.concat([full, tail], axis=0)

    def _backprop_chunk(self, x_chunk, g_chunk, e_stage1, variables):
        with tf.GradientTape() as tape:
            e_chunk = self._embed(x_chunk)
        grads = tape.gradient(e_chunk, variables, output_gradients=g_chunk)
        grads = [_dense(g, v) for g, v in zip(grads, variables)]
        diff = tf.constant(0.0)
        if self.check_stages:
            gap = tf.abs(tf.cast(e_chunk, "float32") - tf.cast(e_stage1, "float32"))
            diff = tf.reduce_max(tf.concat([tf.reshape(gap, [-1]), [0.0]], axis=0))
        return grads, diff

    def _backprop_in_chunks(self, x, grad_embeddings, embeddings, variables):
        """Stage 3: sum over chunks of (d e_chunk/d theta)^T G[chunk]."""
        c = self.chunk_size
        batch = _batch_size(x)
        n_full = batch // c

        def body(i, acc, diff):
            grads, d = self._backprop_chunk(
                _rows(x, i * c, c), _rows(grad_embeddings, i * c, c),
                _rows(embeddings, i * c, c), variables)
            return i + 1, [a + g for a, g in zip(acc, grads)], tf.maximum(diff, d)

        zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
        _, acc, diff = tf.while_loop(
            lambda i, *_: i < n_full, body, (tf.constant(0), zeros, tf.constant(0.0)),
            parallel_iterations=1)
        start = n_full * c

        def tail():
            grads, d = self._backprop_chunk(
                _tail(x, start), grad_embeddings[start:], embeddings[start:], variables)
            return [a + g for a, g in zip(acc, grads)], tf.maximum(diff, d)

        if isinstance(batch, int):
            if batch > start:
                acc, diff = tail()
        else:
            acc, diff = tf.cond(batch > start, tail, lambda: (acc, diff))
        return acc, diff

    def _gather(self, embeddings, y, sample_weight):
        """All-gather the replicas' rows; returns global tensors and this replica's offset."""
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas == 1:
            return embeddings, y, sample_weight, 0
        self._check_distributed_losses()
        context = tf.distribute.get_replica_context()
        local = tf.shape(embeddings)[0]
        sizes = context.all_gather(tf.reshape(local, [1]), axis=0)
        offset = tf.reduce_sum(sizes[: context.replica_id_in_sync_group])

        def gather(t):
            return None if t is None else context.all_gather(t, axis=0)

        return (gather(embeddings), tree.map_structure(gather, y),
                tree.map_structure(gather, sample_weight), offset)

    def _check_distributed_losses(self):
        losses = [l for l in tree.flatten(self.loss) if l is not None]
        bad = [l for l in losses if not hasattr(l, "query_database_loss")]
        if bad:
            raise ValueError(
                "MultiStageModel ranks the global batch under a distribution strategy, "
                "which needs batch-level ranking losses (tfaploss.losses.RetrievalLoss); "
                f"received loss={bad[0]!r}. Compile with a tfaploss loss or train on "
                "one replica."
            )

    def _memory_loss_fn(self):
        if self.xbm_loss is not None:
            return self.xbm_loss
        losses = [l for l in tree.flatten(self.loss) if l is not None]
        if len(losses) == 1 and hasattr(losses[0], "query_database_loss"):
            return losses[0]
        raise ValueError(
            "MultiStageModel: cross-batch memory needs a loss with a query-vs-database "
            "form; compile with one tfaploss.losses.RetrievalLoss or pass `xbm_loss`. "
            f"Compiled loss: {self.loss!r}"
        )

    def _loss_and_output_gradient(self, y, embeddings, sample_weight):
        """Stage 2: the loss on the (global) embeddings and G = d(scaled loss)/dE.

        Weight regularisation losses depend on the variables directly; their gradient
        is returned alongside, computed from the same tape.
        """
        variables = self.trainable_variables
        memory_loss_fn = self._memory_loss_fn() if self.memory is not None else None
        with tf.GradientTape() as tape:
            tape.watch(embeddings)
            loss = self._compile_loss(y, embeddings, sample_weight)
            if loss is None:
                raise ValueError(
                    "MultiStageModel: no loss to compute. Provide `loss` in `compile()`.")
            tracked = loss
            if self.memory is not None:
                memory_loss = self.memory.query_loss(memory_loss_fn, y, embeddings)
                self.xbm_loss_tracker.update_state(memory_loss)
                memory_loss = tf.cast(memory_loss, loss.dtype) * self.xbm_weight
                loss = loss + memory_loss
                tracked = tracked + memory_loss
            for extra in self.losses:
                extra = self._aggregate_additional_loss(extra)
                loss = loss + extra
                tracked = tracked + unscale_loss_for_distribution(extra)
            scaled = self.optimizer.scale_loss(loss) if self.optimizer is not None else loss
        grads = tape.gradient(scaled, [embeddings] + list(variables))
        direct = [_dense(g, v) for g, v in zip(grads[1:], variables)]
        return tracked, grads[0], direct

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        variables = self.trainable_variables
        if not variables:
            raise ValueError("MultiStageModel: the embedding model has no trainable weights.")

        if self.chunk_size is None:
            with tf.GradientTape() as tape:
                embeddings = self._embed(x)
        else:
            embeddings = self._embed_in_chunks(x)
        local = tf.shape(embeddings)[0]
        all_embeddings, all_y, all_weights, offset = self._gather(
            tf.stop_gradient(embeddings), y, sample_weight)

        loss, all_grad_embeddings, direct = self._loss_and_output_gradient(
            all_y, all_embeddings, all_weights)
        if isinstance(offset, int) and offset == 0 and all_y is y:
            grad_embeddings = all_grad_embeddings
        else:
            grad_embeddings = all_grad_embeddings[offset: offset + local]
        grad_embeddings = tf.cast(grad_embeddings, embeddings.dtype)

        if self.chunk_size is None:
            grads = tape.gradient(embeddings, variables, output_gradients=grad_embeddings)
            grads = [_dense(g, v) for g, v in zip(grads, variables)]
        else:
            grads, diff = self._backprop_in_chunks(x, grad_embeddings, embeddings, variables)
            if self.check_stages:
                self.stage_diff_tracker.update_state(diff)
                check = tf.debugging.assert_less_equal(
                    diff, tf.constant(self.stage_atol, diff.dtype),
                    message="MultiStageModel(check_stages=True): stage-3 embeddings differ "
                    "from stage-1 embeddings; the model is not deterministic in training "
                    "mode (dropout? batch-statistics BatchNorm? augmentation in the model?)")
                with tf.control_dependencies([check]):
                    grads = [tf.identity(g) for g in grads]
        grads = [g + d for g, d in zip(grads, direct)]
        self.optimizer.apply(grads, variables)

        if self.memory is not None:
            self.memory.enqueue(all_embeddings, all_y)
        self._loss_tracker.update_state(loss, sample_weight=local)
        return self.compute_metrics(x, y, embeddings, sample_weight=sample_weight)

    # -- serialisation --------------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        config.update(
            embedding_model=keras.saving.serialize_keras_object(self.embedding_model),
            chunk_size=self.chunk_size,
            xbm_size=self.xbm_size,
            xbm_weight=self.xbm_weight,
            xbm_loss=(None if self.xbm_loss is None
                      else keras.saving.serialize_keras_object(self.xbm_loss)),
            on_nondeterministic=self.on_nondeterministic,
            check_stages=self.check_stages,
            stage_atol=self.stage_atol,
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["embedding_model"] = keras.saving.deserialize_keras_object(
            config["embedding_model"])
        if config.get("xbm_loss") is not None:
            config["xbm_loss"] = keras.saving.deserialize_keras_object(config["xbm_loss"])
        return cls(**config)
