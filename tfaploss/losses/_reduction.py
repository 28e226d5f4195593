"""Keras's own reduction of the masked per-query terms a ranking loss computes."""

from __future__ import annotations

import functools

import keras


class _AttachMask(keras.layers.Layer):
    """Returns its input with ``mask`` attached as the Keras mask (Keras exports no
    function for it; a masking layer is the public way, on every backend)."""

    def __init__(self):
        super().__init__(name="query_mask", autocast=False)
        self.supports_masking = True

    def call(self, values, mask=None):
        return values


@functools.cache
def _mask_layer():
    return _AttachMask()


def with_mask(values, mask):
    """``values`` carrying the bool ``mask`` (same shape) as their Keras mask."""
    return _mask_layer()(values, mask=mask)


@keras.saving.register_keras_serializable(package="tfaploss")
class KerasReduction(keras.losses.Loss):
    """Keras's ``Loss.__call__`` (``sample_weight``, mask, ``reduction``, per-replica
    scaling) on per-query terms already computed."""

    def call(self, y_true, y_pred):
        return y_pred
