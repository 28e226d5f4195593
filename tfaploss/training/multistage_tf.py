"""MultiStageModel's step on the TensorFlow backend: ``tf.GradientTape`` per chunk,
``G[chunk]`` pulled back with ``output_gradients``; under ``tf.distribute`` the
replicas all-gather embeddings and labels. With a static batch size and at most
``UNROLL_CHUNKS`` chunks they are unrolled into the graph; otherwise a
``tf.while_loop`` (traced once) walks the full chunks and the tail is a separate call.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import tree

from tfaploss.ops import distribute

UNROLL_CHUNKS = 8


def _rows(x, start, size):
    """Rows ``start:start+size`` of every tensor in ``x``, with a static row count
    (a compile-time constant under XLA)."""
    index = start + tf.range(size)
    return tree.map_structure(lambda t: tf.gather(t, index), x)


def _slice(x, start, stop):
    return tree.map_structure(lambda t: t[start:stop], x)


def _batch_size(x):
    first = tree.flatten(x)[0]
    static = first.shape[0]
    return static if static is not None else tf.shape(first)[0]


def _dense(gradient, variable):
    if gradient is None:
        return tf.zeros(variable.shape, variable.dtype)
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


class TensorFlowSteps:
    """``train_step`` of ``MultiStageModel`` for ``KERAS_BACKEND=tensorflow``."""

    def _embedding_spec(self, x, rows):
        spec = tree.map_structure(
            lambda t: keras.KerasTensor((rows,) + tuple(t.shape[1:]), dtype=t.dtype.name), x)
        return self.embedding_model.compute_output_spec(spec)

    def _unrolled(self, batch):
        return isinstance(batch, int) and len(self._chunk_bounds(batch)) <= UNROLL_CHUNKS

    def _embed_in_chunks(self, x):
        """Stage 1: embeddings of the whole batch, no activations kept."""
        batch = _batch_size(x)
        if self._unrolled(batch):
            parts = []
            for a, b in self._chunk_bounds(batch):
                # In order, one chunk at a time: a graph would otherwise run chunks side
                # by side and keep their activations alive together.
                with tf.control_dependencies(parts[-1:]):
                    parts.append(self._embed(_slice(x, a, b)))
            return tf.concat(parts, axis=0)
        c = self.chunk_size
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
        if isinstance(batch, int):
            if batch == start:
                return full
            return tf.concat([full, self._embed(_slice(x, start, None))], axis=0)
        width = tuple(spec.shape[1:])
        tail = tf.cond(batch > start, lambda: self._embed(_slice(x, start, None)),
                       lambda: tf.zeros((0,) + width, spec.dtype))
        return tf.concat([full, tail], axis=0)

    def _backprop_chunk(self, x_chunk, g_chunk, e_stage1, variables):
        with tf.GradientTape() as tape:
            e_chunk = self._embed(x_chunk)
        grads = tape.gradient(e_chunk, variables, output_gradients=g_chunk)
        grads = [_dense(g, v) for g, v in zip(grads, variables)]
        diff = tf.constant(0.0)
        if self.check_stages:
            diff = self._max_abs_diff(e_chunk, e_stage1)
        return grads, diff

    def _backprop_in_chunks(self, x, grad_embeddings, embeddings, variables):
        """Stage 3: sum over chunks of (d e_chunk/d theta)^T G[chunk]."""
        batch = _batch_size(x)
        acc = [tf.zeros(v.shape, v.dtype) for v in variables]
        diff = tf.constant(0.0)
        if self._unrolled(batch):
            for i, (a, b) in enumerate(self._chunk_bounds(batch)):
                with tf.control_dependencies(acc if i else []):  # one chunk at a time
                    grads, d = self._backprop_chunk(_slice(x, a, b), grad_embeddings[a:b],
                                                    embeddings[a:b], variables)
                acc = grads if i == 0 else [s + g for s, g in zip(acc, grads)]
                diff = tf.maximum(diff, d)
            return acc, diff

        c = self.chunk_size
        n_full = batch // c

        def body(i, acc, diff):
            grads, d = self._backprop_chunk(
                _rows(x, i * c, c), _rows(grad_embeddings, i * c, c),
                _rows(embeddings, i * c, c), variables)
            return i + 1, [a + g for a, g in zip(acc, grads)], tf.maximum(diff, d)

        _, acc, diff = tf.while_loop(
            lambda i, *_: i < n_full, body, (tf.constant(0), acc, diff),
            parallel_iterations=1)
        start = n_full * c

        def tail():
            grads, d = self._backprop_chunk(
                _slice(x, start, None), grad_embeddings[start:], embeddings[start:], variables)
            return [a + g for a, g in zip(acc, grads)], tf.maximum(diff, d)

        if isinstance(batch, int):
            return tail() if batch > start else (acc, diff)
        return tf.cond(batch > start, tail, lambda: (acc, diff))

    def _gather(self, embeddings, y, sample_weight):
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas == 1:
            return embeddings, y, sample_weight, 0
        self._check_distributed_losses()
        all_y, all_embeddings, all_weights, (offset, _) = distribute.gather_replicas(
            y, embeddings, sample_weight)
        return all_embeddings, all_y, all_weights, offset

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
        if len({self._divided_per_replica(l) for l in losses}) > 1:
            raise ValueError(
                "MultiStageModel ranks the global batch under a distribution strategy "
                "and needs compiled losses that all reduce by a mean or all by a sum; "
                f"received reductions {[l.reduction for l in losses]}."
            )

    def _loss_and_output_gradient(self, y, embeddings, sample_weight, variables):
        """Stage 2: the loss on the (global) embeddings, G, and the regularisers' direct
        gradient with respect to the variables."""
        with tf.GradientTape() as tape:
            tape.watch(embeddings)
            scaled, (total, memory_loss) = self._objective(y, embeddings, sample_weight)
        grads = tape.gradient(scaled, [embeddings] + list(variables))
        direct = [_dense(g, v) for g, v in zip(grads[1:], variables)]
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:
            # Each replica evaluates the whole loss and the optimizer sums the replicas:
            # the variables it reads itself (proxies) take each replica's share.
            read = self._loss_variable_ids()
            direct = [d / replicas if id(v) in read else d for d, v in zip(direct, variables)]
        return total, memory_loss, grads[0], direct

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._check_trainable()
        variables = self.trainable_variables

        if self.chunk_size is None:
            with tf.GradientTape() as tape:
                embeddings = self._embed(x)
        else:
            embeddings = self._embed_in_chunks(x)
        local = tf.shape(embeddings)[0]
        all_embeddings, all_y, all_weights, offset = self._gather(
            tf.stop_gradient(embeddings), y, sample_weight)

        loss, memory_loss, all_grad_embeddings, direct = self._loss_and_output_gradient(
            all_y, all_embeddings, all_weights, variables)
        if isinstance(offset, int) and offset == 0 and all_y is y:
            grad_embeddings = all_grad_embeddings
        else:
            grad_embeddings = all_grad_embeddings[offset: offset + local]
        grad_embeddings = tf.cast(grad_embeddings, embeddings.dtype)

        diff = tf.constant(0.0)
        if self.chunk_size is None:
            grads = tape.gradient(embeddings, variables, output_gradients=grad_embeddings)
            grads = [_dense(g, v) for g, v in zip(grads, variables)]
        else:
            grads, diff = self._backprop_in_chunks(x, grad_embeddings, embeddings, variables)
            # Every update must wait for ALL the gradients: Grappler drops the control
            # edge from the last chunk's read of the head's kernel to the head's update
            # (implied through the all-reduce's IdentityN, which it then removes), so
            # the lower layers could get the updated head's gradient (graph mode
            # without XLA). Identities behind every gradient keep the order.
            barrier = list(grads)
            if self.check_stages:
                barrier.append(tf.debugging.assert_less_equal(
                    diff, tf.constant(self.stage_atol, diff.dtype),
                    message=self._stage_check_message()))
            with tf.control_dependencies(barrier):
                grads = [tf.identity(g) for g in grads]
        grads = [g + d for g, d in zip(grads, direct)]
        self.optimizer.apply(grads, variables)

        if self.memory is not None:
            self.memory.enqueue(all_embeddings, all_y)
        self._update_trackers(loss, memory_loss, diff, local)
        return self.compute_metrics(x, y, embeddings, sample_weight=sample_weight)
