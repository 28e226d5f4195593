"""Input normalisation inside the model, so that a served model takes raw pixels."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.models.config_layer import SameShapeLayer

IMAGENET_MEAN_RGB = (0.485, 0.456, 0.406)
IMAGENET_STD_RGB = (0.229, 0.224, 0.225)
# ``keras.applications.resnet.preprocess_input`` ("caffe"): BGR order, mean removed.
CAFFE_MEAN_BGR = (103.939, 116.779, 123.68)
MODES = ("torch", "caffe")


@keras.saving.register_keras_serializable(package="tfaploss")
class ImageNetNormalization(SameShapeLayer):
    """Normalise raw RGB pixels in [0, 255] as an ImageNet-trained backbone expects.

    - ``mode="torch"``: ``(x / 255 - mean) / std`` per channel, with the ImageNet
      mean (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.225); the convention of the
      papers' PyTorch code and of their checkpoints.
    - ``mode="caffe"``: RGB -> BGR, then subtract (103.939, 116.779, 123.68); what the
      ``keras.applications`` ResNet-50/101 ImageNet weights were trained with (same
      as ``keras.applications.resnet.preprocess_input``).

    Input and output ``(..., 3)``, channels last. Cost: O(pixels).
    """

    CONFIG = ("mode",)

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


@keras.saving.register_keras_serializable(package="tfaploss")
class ImageRescaling(SameShapeLayer):
    """``x * scale + offset`` on raw RGB pixels in [0, 255], per channel or global.

    The normalisation of a keras-hub preset (its ``ImageConverter``'s ``scale`` and
    ``offset``), inside the model so that a served model still takes raw pixels.
    ``scale``, ``offset``: a number, 3 numbers (R, G, B) or ``None`` (1, 0). Input and
    output ``(..., 3)``, channels last. Cost: O(pixels).
    """

    CONFIG = ("scale", "offset")

    def __init__(self, scale=None, offset=None, **kwargs):
        super().__init__(**kwargs)
        self.scale = _numbers(scale, "scale")
        self.offset = _numbers(offset, "offset")

    def call(self, inputs):
        x = ops.cast(inputs, self.compute_dtype)
        if self.scale is not None:
            x = x * ops.convert_to_tensor(self.scale, dtype=x.dtype)
        if self.offset is not None:
            x = x + ops.convert_to_tensor(self.offset, dtype=x.dtype)
        return x


def _numbers(value, name):
    """``None``, a float, or a list of 3 floats (one per channel)."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    values = [float(v) for v in value]
    if len(values) != 3:
        raise ValueError(f"ImageRescaling: `{name}` must be a number or 3 numbers (R, G, B); "
                         f"received {value!r}")
    return values
