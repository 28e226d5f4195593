"""BatchNorm with frozen statistics and trainable affine parameters (re-exported by
``tfaploss.training``, where multi-staged backpropagation needs it); any backend.
"""

from __future__ import annotations

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfaploss")
class FrozenBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization that always normalises with its moving statistics.

    ``gamma`` and ``beta`` stay trainable (Keras's ``trainable=False`` would freeze them
    too): the AP-loss papers' setting, deterministic in training mode.
    """

    def call(self, inputs, training=None, mask=None):
        if keras.backend.standardize_dtype(inputs.dtype) != "float64":
            return super().call(inputs, training=False, mask=mask)
        # Keras's BatchNormalization computes in result_type(inputs, float32), which
        # on JAX and torch is float32 even for float64 inputs; the moving statistics
        # need no batch reduction, so float64 is kept here (the same formula).
        def param(weight):
            return None if weight is None else ops.cast(weight, "float64")

        return ops.batch_normalization(
            inputs, param(self.moving_mean), param(self.moving_variance), axis=self.axis,
            offset=param(self.beta if self.center else None),
            scale=param(self.gamma if self.scale else None), epsilon=self.epsilon)


def freeze_batch_norm(model: keras.layers.Layer) -> keras.layers.Layer:
    """Make every BatchNormalization in ``model`` (nested models included) use its
    moving statistics, in place; gamma and beta stay trainable, and the change survives
    ``.keras`` saving. Returns the same model, for chaining."""
    count = 0
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if type(layer) is keras.layers.BatchNormalization:
            # Re-classing keeps the layer's weights, name and place in the graph.
            layer.__class__ = FrozenBatchNormalization
            count += 1
    model._tfaploss_frozen_bn_count = count
    return model


def has_training_batch_norm(model: keras.layers.Layer) -> bool:
    """Whether ``model`` holds a BatchNormalization that uses batch statistics."""
    return any(
        isinstance(layer, keras.layers.BatchNormalization)
        and not isinstance(layer, FrozenBatchNormalization)
        and layer.trainable
        for layer in model._flatten_layers(include_self=True, recursive=True)
    )
