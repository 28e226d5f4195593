"""Keras's own reduction of the per-query terms a ranking loss computes.

:class:`tfaploss.losses.RetrievalLoss` returns its terms with a Keras mask (the queries
without positives left out) and lets ``keras.losses.Loss.__call__`` apply
``sample_weight``, the mask and the ``reduction``, as for any Keras loss.
"""

from __future__ import annotations

import functools

import keras


class _AttachMask(keras.layers.Layer):
    """Returns its input with ``mask`` attached as the Keras mask.

    Keras reads a mask from the values a loss's ``call`` returns and leaves the masked
    entries out of the reduction, but exports no function to attach one; a layer that
    supports masking is the public way (``Layer.__call__`` attaches ``mask`` to its
    output, on every backend, eager or traced).
    """

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


# Registered as every Keras class of the library is, although no model saves it: a loss
# builds one per call.
@keras.saving.register_keras_serializable(package="tfaploss")
class KerasReduction(keras.losses.Loss):
    """Keras's ``Loss.__call__`` on per-query terms already computed: it applies
    ``sample_weight``, the terms' mask and the ``reduction`` (and, under
    ``tf.distribute``, Keras's per-replica scaling of the mean reductions)."""

    def call(self, y_true, y_pred):
        return y_pred
