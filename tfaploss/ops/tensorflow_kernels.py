"""TensorFlow kernels behind :mod:`tfaploss.ops.backend` (imported on TensorFlow only):
ops ``keras.ops`` does not expose that keep this path fast, a weighted ``DenseBincount``
(TF's CPU segment sum is 10-20x slower at B=4096), ``invert_permutation`` and ``top_k``.
"""

from __future__ import annotations

import warnings

import tensorflow as tf


def descending_order(scores):
    return tf.math.top_k(scores, k=tf.shape(scores)[-1], sorted=True).indices


def inverse_permutations(order):
    # Static shapes where known: XLA cannot reshape to a shape computed at run time.
    shape = order.shape if order.shape.is_fully_defined() else tf.shape(order)
    offsets = tf.range(shape[0], dtype=order.dtype)[:, None] * tf.cast(shape[1], order.dtype)
    flat = tf.reshape(order + offsets, [-1])
    return tf.reshape(tf.math.invert_permutation(flat), shape) - offsets


def two_bin_counts(index, upper, lower, num_bins):
    @tf.custom_gradient
    def counts(upper, lower):
        indices = tf.concat([index, index + 1], axis=-1)
        weights = tf.concat([upper, lower], axis=-1)
        out = tf.raw_ops.DenseBincount(input=indices, size=tf.constant(num_bins, tf.int32),
                                       weights=weights, binary_output=False)

        def grad(upstream):
            return (tf.gather(upstream, index, batch_dims=1),
                    tf.gather(upstream, index + 1, batch_dims=1))

        return out, grad

    return counts(upper, lower)


def in_xla_context() -> bool:
    """True while tracing a function compiled with XLA (``jit_compile=True``)."""
    try:
        from tensorflow.python.ops import control_flow_util

        return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except Exception:  # noqa: BLE001 - private API moved: fall back to warning
        return False


_WARNED: set[str] = set()


def _warn_from_graph(message: str) -> bool:
    """The host side of :func:`warn_unless`: one warning per message and process."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return True


def warn_unless(condition, message: str):
    """``condition``, raising the ``RuntimeWarning`` ``message`` when it is False at run
    time (graph mode, not XLA: a ``tf.py_function`` in the false branch of a ``tf.cond``,
    so it goes through ``warnings`` as the eager path's does)."""

    def warn_then():
        done = tf.py_function(lambda: _warn_from_graph(message), [], Tout=tf.bool)
        with tf.control_dependencies([done]):
            return tf.identity(condition)

    return tf.cond(condition, lambda: condition, warn_then)


def assert_same_rows(labels, embeddings, message):
    """``labels`` after a run-time check that both inputs have as many rows."""
    sizes = tf.stack([tf.shape(labels)[0], tf.shape(embeddings)[0]])
    check = tf.debugging.Assert(tf.equal(sizes[0], sizes[1]), [tf.constant(message), sizes])
    with tf.control_dependencies([check]):
        return tf.identity(labels)


# jit-compiled block kernels, one per key: fusing a block's elementwise ops is ~2x
# faster on CPU. Set to False on a device without XLA support.
FUSE_BLOCKS = True
_KERNELS = {}


def _fused(key, forward, backward):
    if tf.executing_eagerly() or not FUSE_BLOCKS:
        return forward, backward  # eager: no compilation per shape
    if key not in _KERNELS:
        _KERNELS[key] = (tf.function(forward, jit_compile=True, autograph=False),
                         tf.function(backward, jit_compile=True, autograph=False))
    return _KERNELS[key]


def blocked_rank_terms(scores, kind, blocks, use_positive, key, forward_block,
                       backward_block):
    """The block loop of :mod:`tfaploss.ops.pair_blocks` on TensorFlow: ``tf.while_loop``
    with TensorArrays (no buffer copy per step)."""
    forward_block, backward_block = _fused(key, forward_block, backward_block)
    block, max_blocks = blocks.block, blocks.max_blocks

    def new_array(dtype):
        return tf.TensorArray(dtype, size=max_blocks, element_shape=[block]
                              if isinstance(block, int) else None)

    @tf.custom_gradient
    def terms(s):
        def body(b, pos_arr, neg_arr):
            flat, valid = blocks.pairs(b)
            pos, neg = forward_block(s, kind, flat, valid)
            if use_positive:
                pos_arr = pos_arr.write(b, pos)
            return b + 1, pos_arr, neg_arr.write(b, neg)

        _, pos_arr, neg_arr = tf.while_loop(
            lambda b, *_: b < blocks.num_blocks, body,
            (tf.constant(0), new_array(s.dtype), new_array(s.dtype)),
            parallel_iterations=1, maximum_iterations=max_blocks)
        neg_above = blocks.to_matrix(neg_arr.stack(), s)
        pos_above = (blocks.to_matrix(pos_arr.stack(), s) if use_positive
                     else tf.zeros_like(s))

        def grad(g_pos, g_neg):
            g_neg = tf.zeros_like(s) if g_neg is None else g_neg
            g_pos = tf.zeros_like(s) if g_pos is None else g_pos

            def back(b, d_s, col_arr):
                flat, valid = blocks.pairs(b)
                rows, w, col = backward_block(s, kind, flat, valid, g_pos, g_neg)
                d_s = tf.tensor_scatter_nd_add(d_s, rows[:, None], w)
                return b + 1, d_s, col_arr.write(b, col)

            _, d_rows, col_arr = tf.while_loop(
                lambda b, *_: b < blocks.num_blocks, back,
                (tf.constant(0), tf.zeros_like(s), new_array(s.dtype)),
                parallel_iterations=1, maximum_iterations=max_blocks)
            return d_rows + blocks.to_matrix(col_arr.stack(), s)

        return (pos_above, neg_above), grad

    return terms(scores)
