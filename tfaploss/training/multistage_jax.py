"""MultiStageModel's step on the JAX backend: stateless calls and ``jax.vjp`` per chunk.

Every stage is a pure function of the model state (Keras's JAX trainer): a loop embeds
the chunks, ``jax.value_and_grad`` of ``_objective`` gives ``G``, a second loop
accumulates ``vjp(G[chunk])``. The loops are ``lax.scan`` on accelerators and unrolled
on CPU, where XLA runs convolutions in a loop body ~25x slower (``SCAN_CHUNKS``
overrides). Under a ``keras.distribution`` sharding the batch over D devices, a chunk
is ``chunk_size`` rows of *each* device's shard, so that every device works on every
chunk (the gradient, a sum over chunks, does not depend on the rows' order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
from keras import StatelessScope, tree


def _scope_values(scope, variables, values):
    """The values ``variables`` hold at the end of ``scope`` (``values`` if untouched)."""
    return [value if (new := scope.get_current_value(variable)) is None else new
            for variable, value in zip(variables, values)]


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


def batch_shards():
    """``(D, layout)``: the devices the ``keras.distribution`` shards the batch over and
    the layout of a ``(chunks, rows, ...)`` array sharding ``rows``; else ``(1, None)``."""
    distribution = keras.distribution.distribution()
    name = getattr(distribution, "batch_dim_name", None)
    if distribution is None or name is None:
        return 1, None
    mesh = distribution.device_mesh
    shards = mesh.shape[list(mesh.axis_names).index(name)]

    def layout(ndim):
        return keras.distribution.TensorLayout((None, name) + (None,) * (ndim - 2), mesh)

    return shards, layout


def chunk_plan(batch, chunk_size):
    """``(D, n_full, tail)``: batch shards, full chunks and the tail's rows per shard
    (``chunk_size`` counts rows per device); raises if the batch does not split."""
    shards, _ = batch_shards()
    if batch % shards:
        raise ValueError(
            f"MultiStageModel: the global batch of {batch} rows does not split evenly over "
            f"the {shards} devices of the distribution; use a batch size that is a "
            f"multiple of {shards}.")
    per_shard = batch // shards
    n_full = per_shard // chunk_size
    return shards, n_full, per_shard - n_full * chunk_size


def _split(x, n_full, c):
    """``(full, tail)``: ``n_full`` chunks ``(n_full, D * c, ...)`` of ``c`` rows of
    every device's shard, and the remaining rows of every shard, ``(D * t, ...)``."""
    shards, layout = batch_shards()
    if shards == 1:
        full = tree.map_structure(
            lambda t: jnp.reshape(t[: n_full * c], (n_full, c) + tuple(t.shape[1:])), x)
        tail = tree.map_structure(lambda t: t[n_full * c:], x)
        return full, tail

    def full_of(t):
        rest = tuple(t.shape[1:])
        per_shard = jnp.reshape(t, (shards, -1) + rest)[:, : n_full * c]
        chunks = jnp.moveaxis(jnp.reshape(per_shard, (shards, n_full, c) + rest), 0, 1)
        chunks = jnp.reshape(chunks, (n_full, shards * c) + rest)
        return keras.distribution.distribute_tensor(chunks, layout(chunks.ndim))

    def tail_of(t):
        rest = tuple(t.shape[1:])
        return jnp.reshape(jnp.reshape(t, (shards, -1) + rest)[:, n_full * c:], (-1,) + rest)

    return tree.map_structure(full_of, x), tree.map_structure(tail_of, x)


def _merge(full, tail, n_full, c):
    """The inverse of :func:`_split` for one array: back to the batch's row order."""
    shards, _ = batch_shards()
    parts = []
    if full is not None:
        rest = tuple(full.shape[2:])
        if shards == 1:
            parts.append(jnp.reshape(full, (n_full * c,) + rest))
        else:
            chunks = jnp.moveaxis(jnp.reshape(full, (n_full, shards, c) + rest), 1, 0)
            parts.append(jnp.reshape(chunks, (shards, n_full * c) + rest))
    if tail is not None:
        rest = tuple(tail.shape[1:])
        parts.append(tail if shards == 1 else jnp.reshape(tail, (shards, -1) + rest))
    if shards == 1:
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
    merged = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
    return jnp.reshape(merged, (-1,) + tuple(merged.shape[2:]))


def _rows_of(x):
    return tree.flatten(x)[0].shape[0]


class JaxSteps:
    """``train_step`` of ``MultiStageModel`` for ``KERAS_BACKEND=jax``."""

    def _jax_embed(self, trainable, non_trainable, x):
        """Embeddings of ``x`` in training mode, and the non-trainable values after it."""
        return self.stateless_call(trainable, non_trainable, x, training=True)

    def _jax_stage1(self, trainable, non_trainable, x):
        """Stage 1 over chunks: ``(embeddings, non_trainable)``."""
        c = self.chunk_size
        _, n_full, tail_rows = chunk_plan(_rows_of(x), c)
        full, tail = _split(x, n_full, c)

        def body(carry, x_chunk):
            e, carry = self._jax_embed(trainable, carry, x_chunk)
            return carry, e

        stacked = tail_embeddings = None
        if n_full:
            non_trainable, stacked = _scan(body, non_trainable, full, n_full)
        if tail_rows:
            tail_embeddings, non_trainable = self._jax_embed(trainable, non_trainable, tail)
        return _merge(stacked, tail_embeddings, n_full, c), non_trainable

    def _jax_stage3(self, trainable, non_trainable, x, grad_embeddings, embeddings):
        """Stage 3: ``sum_chunks vjp(G[chunk])`` and the largest stage-1/stage-3 gap."""
        c = self.chunk_size
        _, n_full, tail_rows = chunk_plan(_rows_of(x), c)

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
        if tail_rows:
            (acc, diff), _ = body((acc, diff), (x_tail, g_tail, e_tail))
        return acc, diff

    def _jax_objective(self, embeddings, trainable, non_trainable, optimizer_variables,
                       metrics_variables, y, sample_weight):
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
