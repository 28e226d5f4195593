"""Generalized-mean (GeM) pooling (Radenović et al., TPAMI 2018)."""

from __future__ import annotations

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfaploss")
class GeM(keras.layers.Layer):
    """Generalized-mean pooling over the spatial axes of a feature map.

    ``GeM(x) = (mean_{h,w} max(x, eps)^p)^(1/p)`` per channel. ``p = 1`` is average
    pooling and ``p -> inf`` tends to max pooling. Revaud et al. learn ``p``
    (initialised to 3) with the rest of the network.

    ``p``: initial exponent, > 0; ``eps``: floor before the power, so that gradients
    stay finite; ``trainable_p``: learn ``p`` (the papers' setting). Input ``(B, H, W,
    C)``, output ``(B, C)``; cost O(B·H·W·C); under mixed precision the power and the
    mean are computed in float32.
    """

    def __init__(self, p=3.0, eps=1e-6, trainable_p=True, data_format=None, **kwargs):
        super().__init__(**kwargs)
        if not p > 0:
            raise ValueError(f"GeM: `p` must be > 0, received p={p!r}")
        if not eps > 0:
            raise ValueError(f"GeM: `eps` must be > 0, received eps={eps!r}")
        self.initial_p = float(p)
        self.eps = float(eps)
        self.trainable_p = bool(trainable_p)
        data_format = data_format or keras.config.image_data_format()
        if data_format not in ("channels_last", "channels_first"):
            raise ValueError(
                "GeM: `data_format` must be 'channels_last' or 'channels_first', "
                f"received data_format={data_format!r}"
            )
        self.data_format = data_format

    def build(self, input_shape):
        if len(input_shape) != 4:
            raise ValueError(
                f"GeM expects a 4-D feature map, received input_shape={input_shape}"
            )
        self.p = self.add_weight(
            name="p",
            shape=(),
            initializer=keras.initializers.Constant(self.initial_p),
            trainable=self.trainable_p,
        )

    def call(self, inputs):
        axes = (1, 2) if self.data_format == "channels_last" else (2, 3)
        # x^p overflows float16 for activations above ~40 (p = 3): under mixed
        # precision the power and the mean run in float32.
        dtype = "float32" if inputs.dtype in ("float16", "bfloat16") else inputs.dtype
        x = ops.cast(inputs, dtype)
        p = ops.cast(self.p, dtype)
        # clip, not ops.maximum: Keras's binary ops on JAX/torch promote float64 to
        # float32 (keras.backend.result_type); clip keeps the input's dtype.
        x = ops.power(ops.clip(x, self.eps, float("inf")), p)
        # sum / count, not ops.mean: on JAX and torch Keras computes the mean of a
        # float64 tensor in float32 (float64 GeM would then be batch-dependent at 1e-7).
        count = ops.cast(ops.shape(x)[axes[0]] * ops.shape(x)[axes[1]], dtype)
        out = ops.power(ops.sum(x, axis=axes) / count, 1.0 / p)
        return ops.cast(out, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        axis = 3 if self.data_format == "channels_last" else 1
        return (input_shape[0], input_shape[axis])

    def get_config(self):
        return {**super().get_config(), "p": self.initial_p, "eps": self.eps,
                "trainable_p": self.trainable_p, "data_format": self.data_format}
