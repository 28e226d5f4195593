"""Input normalisation inside the model, so that a served model takes raw pixels."""

from __future__ import annotations

import keras
from keras import ops

IMAGENET_MEAN_RGB = (0.485, 0.456, 0.406)
IMAGENET_STD_RGB = (0.229, 0.224, 0.225)
# ``keras.applications.resnet.preprocess_input`` ("caffe"): BGR order, mean removed.
CAFFE_MEAN_BGR = (103.939, 116.779, 123.68)
MODES = ("torch", "caffe")


@keras.saving.register_keras_serializable(package="tfaploss")
class ImageNetNormalization(keras.layers.Layer):
    """Normalise raw RGB pixels in [0, 255] as an ImageNet-trained backbone expects.

    - ``mode="torch"``: ``(x / 255 - mean) / std`` per channel, with the ImageNet
      mean (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.225); the convention of the
      papers' PyTorch code and of their checkpoints.
    - ``mode="caffe"``: RGB -> BGR, then subtract (103.939, 116.779, 123.68); what the
      ``keras.applications`` ResNet-50/101 ImageNet weights were trained with (same
      as ``keras.applications.resnet.preprocess_input``).

    Input and output ``(..., 3)``, channels last. Cost: O(pixels).
    """

    def __init__(self, mode="torch", **kwargs):
        super().__init__(**kwargs)
        if mode not in MODES:
            raise ValueError(f"ImageNetNormalization: `mode` must be one of {MODES}; "
                             f"received mode={mode!r}")
        self.mode = mode

    def call(self, inputs):
        x = ops.cast(inputs, self.compute_dtype)
        if self.mode == "caffe":
            x = ops.flip(x, axis=-1)
            return x - ops.convert_to_tensor(CAFFE_MEAN_BGR, dtype=x.dtype)
        mean = ops.convert_to_tensor([255.0 * m for m in IMAGENET_MEAN_RGB], dtype=x.dtype)
        scale = ops.convert_to_tensor([1.0 / (255.0 * s) for s in IMAGENET_STD_RGB],
                                      dtype=x.dtype)
        return (x - mean) * scale

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(mode=self.mode)
        return config
