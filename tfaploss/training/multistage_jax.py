"""MultiStageModel's step on the JAX backend: stateless calls and ``jax.vjp`` per chunk.

Keras's JAX trainer hands ``train_step`` the model state as arrays and expects the new
state back, so every stage is a pure function of ``(trainable, non_trainable)``:

1. a loop over the full chunks (plus one call for a tail) embeds the batch, keeping
   no activations. On accelerators the loop is a ``lax.scan`` (its body compiled once,
   whatever the number of chunks); on CPU it is unrolled, because XLA:CPU runs
   convolutions inside a loop body ~25x slower than the same convolutions unrolled
   (measured: small CNN, B=64 in chunks of 16, 20 s per step with scan, 0.7 s
   unrolled). ``SCAN_CHUNKS`` overrides the choice.
2. ``jax.value_and_grad`` of ``MultiStageModel._objective`` with respect to the
   embeddings and the trainable variables (whose direct part is the weight
   regularisers' gradient) gives ``G``.
3. A second loop re-embeds each chunk under ``jax.vjp`` and accumulates
   ``vjp(G[chunk])``; the activations of one chunk live at a time.

With ``chunk_size=None`` stage 1 is one ``jax.vjp`` over the batch and stage 3 applies
it. Non-trainable variables (the cross-batch memory, a non-frozen BatchNorm's moving
statistics) follow stage 1; a deterministic model does not change them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
from keras import StatelessScope, tree


def _scope_values(scope, variables, values):
    """The values ``variables`` hold at the end of ``scope`` (``values`` if untouched)."""
    out = []
    for variable, value in zip(variables, values):
        new = scope.get_current_value(variable)
        out.append(value if new is None else new)
    return out


# None: lax.scan over chunks on accelerators, an unrolled loop on CPU; True/False force it.
SCAN_CHUNKS = None


def _scan(body, carry, xs, n):
    """``lax.scan(body, carry, xs)`` over ``n`` chunks, or the same loop unrolled."""
    scan = SCAN_CHUNKS if SCAN_CHUNKS is not None else jax.default_backend() != "cpu"
    if scan:
        return jax.lax.scan(body, carry, xs)
    outputs = []
    for i in range(n):
        carry, out = body(carry, jax.tree_util.tree_map(lambda t, i=i: t[i], xs))
        outputs.append(out)
    if outputs[0] is None:
        return carry, None
    return carry, jax.tree_util.tree_map(lambda *parts: jnp.stack(parts), *outputs)


def _split(x, n_full, c):
    """``x[: n_full * c]`` reshaped to ``(n_full, c, ...)`` and the tail ``x[n_full * c:]``."""
    full = tree.map_structure(
        lambda t: jnp.reshape(t[: n_full * c], (n_full, c) + tuple(t.shape[1:])), x)
    tail = tree.map_structure(lambda t: t[n_full * c:], x)
    return full, tail


def _rows_of(x):
    return tree.flatten(x)[0].shape[0]


class JaxSteps:
    """``train_step`` of ``MultiStageModel`` for ``KERAS_BACKEND=jax``."""

    def _jax_embed(self, trainable, non_trainable, x):
        """Embeddings of ``x`` in training mode, and the non-trainable values after it."""
        embeddings, non_trainable = self.stateless_call(trainable, non_trainable, x,
                                                        training=True)
        return embeddings, non_trainable

    def _jax_stage1(self, trainable, non_trainable, x):
        """Stage 1 over chunks: ``(embeddings, non_trainable)``."""
        batch, c = _rows_of(x), self.chunk_size
        n_full = batch // c
        full, tail = _split(x, n_full, c)

        def body(carry, x_chunk):
            e, carry = self._jax_embed(trainable, carry, x_chunk)
            return carry, e

        parts = []
        if n_full:
            non_trainable, stacked = _scan(body, non_trainable, full, n_full)
            parts.append(jnp.reshape(stacked, (n_full * c,) + tuple(stacked.shape[2:])))
        if batch > n_full * c:
            e, non_trainable = self._jax_embed(trainable, non_trainable, tail)
            parts.append(e)
        embeddings = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
        return embeddings, non_trainable

    def _jax_stage3(self, trainable, non_trainable, x, grad_embeddings, embeddings):
        """Stage 3: ``sum_chunks vjp(G[chunk])`` and the largest stage-1/stage-3 gap."""
        batch, c = _rows_of(x), self.chunk_size
        n_full = batch // c

        def pull_back(x_chunk, g_chunk, e_stage1):
            def embed(t):
                return self._jax_embed(t, non_trainable, x_chunk)[0]

            e_chunk, vjp = jax.vjp(embed, trainable)
            (grads,) = vjp(g_chunk.astype(e_chunk.dtype))
            diff = (self._max_abs_diff(e_chunk, e_stage1) if self.check_stages
                    else jnp.zeros((), "float32"))
            return grads, diff

        def body(carry, inputs):
            acc, diff = carry
            grads, d = pull_back(*inputs)
            return (jax.tree_util.tree_map(jnp.add, acc, grads), jnp.maximum(diff, d)), None

        acc = jax.tree_util.tree_map(jnp.zeros_like, trainable)
        diff = jnp.zeros((), "float32")
        (x_full, x_tail) = _split(x, n_full, c)
        (g_full, g_tail) = _split(grad_embeddings, n_full, c)
        (e_full, e_tail) = _split(embeddings, n_full, c)
        if n_full:
            (acc, diff), _ = _scan(body, (acc, diff), (x_full, g_full, e_full), n_full)
        if batch > n_full * c:
            (acc, diff), _ = body((acc, diff), (x_tail, g_tail, e_tail))
        return acc, diff

    def _jax_objective(self, embeddings, trainable, non_trainable, optimizer_variables,
                       metrics_variables, y, sample_weight):
        """Stage 2's objective as a pure function (for ``jax.value_and_grad``)."""
        mapping = list(zip(self.trainable_variables, trainable))
        mapping += zip(self.non_trainable_variables, non_trainable)
        mapping += zip(self.optimizer.variables, optimizer_variables)
        mapping += zip(self.metrics_variables, metrics_variables)
        with StatelessScope(state_mapping=mapping) as scope:
            scaled, (total, memory_loss) = self._objective(y, embeddings, sample_weight)
        # Compiled-loss metrics (multi-output models) may have been updated.
        metrics_variables = _scope_values(scope, self.metrics_variables, metrics_variables)
        return scaled, (total, memory_loss, metrics_variables)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._check_trainable()

        if self.chunk_size is None:
            def embed(t):
                return self._jax_embed(t, non_trainable, x)

            embeddings, vjp, new_non_trainable = jax.vjp(embed, trainable, has_aux=True)
        else:
            embeddings, new_non_trainable = self._jax_stage1(trainable, non_trainable, x)
        embeddings = jax.lax.stop_gradient(embeddings)

        grad_fn = jax.value_and_grad(self._jax_objective, argnums=(0, 1), has_aux=True)
        (_, (total, memory_loss, metrics_variables)), (grad_embeddings, direct) = grad_fn(
            embeddings, trainable, new_non_trainable, optimizer_variables, metrics_variables,
            y, sample_weight)
        grad_embeddings = grad_embeddings.astype(embeddings.dtype)

        if self.chunk_size is None:
            (grads,) = vjp(grad_embeddings)
            diff = jnp.zeros((), "float32")
        else:
            grads, diff = self._jax_stage3(trainable, non_trainable, x, grad_embeddings,
                                           embeddings)
        grads = jax.tree_util.tree_map(jnp.add, grads, direct)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable)

        mapping = list(zip(self.non_trainable_variables, new_non_trainable))
        mapping += zip(self.metrics_variables, metrics_variables)
        with StatelessScope(state_mapping=mapping) as scope:
            if self.memory is not None:
                self.memory.enqueue(embeddings, y)
            self._update_trackers(total, memory_loss, diff, _rows_of(x))
            logs = self.compute_metrics(x, y, embeddings, sample_weight=sample_weight)
        non_trainable = _scope_values(scope, self.non_trainable_variables, new_non_trainable)
        metrics_variables = _scope_values(scope, self.metrics_variables, metrics_variables)
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)
