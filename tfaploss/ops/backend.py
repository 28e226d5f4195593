"""The few primitives whose fastest form differs between Keras backends; on TensorFlow
they come from :mod:`tfaploss.ops.tensorflow_kernels`, imported only there."""

from __future__ import annotations

import keras
from keras import ops


def on_tensorflow() -> bool:
    return keras.backend.backend() == "tensorflow"


def tf_kernels():
    """:mod:`tfaploss.ops.tensorflow_kernels` on TensorFlow, else None. (No ``:=`` at
    its callers: AutoGraph cannot convert a function that uses it.)"""
    if not on_tensorflow():
        return None
    from tfaploss.ops import tensorflow_kernels

    return tensorflow_kernels


def dim(x, axis):
    """The size of ``x`` along ``axis``: a Python int where known, else a tensor."""
    size = x.shape[axis]
    return int(size) if size is not None else ops.shape(x)[axis]


def descending_order(scores):
    """Per row, the indices by decreasing score; ties keep the lower index first."""
    kernels = tf_kernels()
    if kernels:
        return kernels.descending_order(scores)
    return ops.argsort(-scores, axis=-1)  # a stable sort on every other backend


def take(x, indices, axis=0):
    """``ops.take`` for in-range indices (TensorFlow: a bare ``tf.gather``, without the
    negative-index fix-up pass ``keras.ops.take`` adds)."""
    if on_tensorflow():
        import tensorflow as tf

        return tf.gather(x, indices, axis=axis)
    return ops.take(x, indices, axis=axis)


def gather_rows(x, indices):
    """``out[i, j] = x[i, indices[i, j]]`` (row-wise gather, ``take_along_axis``)."""
    if on_tensorflow():
        import tensorflow as tf

        return tf.gather(x, indices, batch_dims=1)
    return ops.take_along_axis(x, indices, axis=-1)


def inverse_permutations(order):
    """Row-wise inverse of a (Q, N) batch of permutations: ``inverse[i, order[i, p]] =
    p``. O(Q·N) time, not a second sort."""
    kernels = tf_kernels()
    if kernels:
        return kernels.inverse_permutations(order)
    order = ops.cast(order, "int32")
    rows, cols = ops.shape(order)
    row_index = ops.broadcast_to(ops.arange(rows, dtype="int32")[:, None], (rows, cols))
    positions = ops.broadcast_to(ops.arange(cols, dtype="int32")[None, :], (rows, cols))
    indices = ops.stack([ops.reshape(row_index, [-1]), ops.reshape(order, [-1])], axis=1)
    return ops.scatter_update(ops.zeros((rows, cols), "int32"), indices,
                              ops.reshape(positions, [-1]))


def two_bin_counts(index, upper, lower, num_bins):
    """Per row, ``out[i, m] = sum_j upper_ij [index_ij = m] + lower_ij [index_ij + 1 = m]``,
    differentiable in ``upper`` and ``lower``. O(Q·N) time and memory."""
    kernels = tf_kernels()
    if kernels:
        return kernels.two_bin_counts(index, upper, lower, num_bins)
    rows = ops.shape(index)[0]
    offsets = ops.arange(rows, dtype="int32")[:, None] * num_bins
    flat_index = ops.reshape(ops.concatenate([index + offsets, index + 1 + offsets], -1), [-1])
    weights = ops.reshape(ops.concatenate([upper, lower], axis=-1), [-1])
    counts = ops.segment_sum(weights, flat_index, num_segments=rows * num_bins)
    return ops.reshape(counts, (rows, num_bins))
