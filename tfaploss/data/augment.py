"""Image transforms of the papers' recipes, written for ``tf.data``.

Train: RandomResizedCrop decoded straight from the JPEG crop window, then optionally a
horizontal flip. Test: the shorter side resized to ``resize_size``, the centre
``image_size`` crop (or the original size). Float32 pixels in [0, 255]; randomness is
stateless (``seed`` a shape-[2] int tensor), so a dataset is reproducible from its seed.
"""

from __future__ import annotations

import tensorflow as tf

# The share of the resized short side that the evaluation crop keeps (224 of 256): the
# ImageNet evaluation convention the papers' recipes follow. The serving graph
# (tfaploss.export) and the CLI's description of preprocessing use this one value.
DEFAULT_CROP_FRACTION = 0.875
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def decode_rgb(encoded: tf.Tensor) -> tf.Tensor:
    """Decode JPEG/PNG bytes to ``uint8 [H, W, 3]``."""
    image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
    image.set_shape([None, None, 3])
    return image


def _decode_window(encoded: tf.Tensor, window: tf.Tensor) -> tf.Tensor:
    """Decode only ``window`` = [y, x, h, w] of a JPEG (any format via a slower path)."""
    def jpeg():
        return tf.io.decode_and_crop_jpeg(encoded, window, channels=3)

    def other():
        return tf.image.crop_to_bounding_box(decode_rgb(encoded), window[0], window[1],
                                             window[2], window[3])

    image = tf.cond(tf.io.is_jpeg(encoded), jpeg, other)
    image.set_shape([None, None, 3])
    return image


def image_shape(encoded: tf.Tensor) -> tf.Tensor:
    """[height, width] of JPEG/PNG bytes without decoding JPEGs."""
    def jpeg():
        return tf.io.extract_jpeg_shape(encoded)[:2]

    def other():
        return tf.shape(decode_rgb(encoded))[:2]

    return tf.cond(tf.io.is_jpeg(encoded), jpeg, other)


def random_resized_crop(encoded: tf.Tensor, image_size: int, seed: tf.Tensor,
                        scale=(0.16, 1.0), ratio=(3 / 4, 4 / 3)) -> tf.Tensor:
    """RandomResizedCrop from encoded bytes to float32 ``[image_size, image_size, 3]``.

    A window covering ``scale`` of the area with aspect ratio in ``ratio`` (10 attempts,
    then the whole image), decoded alone and resized (:func:`_resize`). Costs one JPEG
    decode of the window (an antialiased bilinear filter would cost as much again:
    ``benchmarks/input_pipeline.py``).
    """
    shape = image_shape(encoded)
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.concat([shape, [3]], 0), bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=seed, min_object_covered=0.0, aspect_ratio_range=ratio, area_range=scale,
        max_attempts=10, use_image_if_no_bounding_boxes=True)
    window = tf.stack([begin[0], begin[1], size[0], size[1]])
    image = _decode_window(encoded, window)
    return _resize(image, image_size, shrinks=tf.reduce_all(size[:2] >= image_size))


def _resize(image: tf.Tensor, image_size: int, shrinks: tf.Tensor) -> tf.Tensor:
    """Square resize: box-averaged when ``shrinks`` (antialiased at a third of the
    antialiased bilinear filter's cost), else bilinear."""
    size = [image_size, image_size]
    return tf.cond(shrinks, lambda: tf.image.resize(image, size, method="area"),
                   lambda: tf.image.resize(image, size, method="bilinear"))


def random_flip(image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """Mirror left-right with probability 1/2 (stateless). Separate from the crops so
    that it can be turned off: flipping mislabels classes that are mirror images."""
    return tf.image.stateless_random_flip_left_right(image, seed)


def center_crop(encoded: tf.Tensor, image_size: int | None,
                resize_size: int | None = None) -> tf.Tensor:
    """Test transform: shorter side to ``resize_size`` (default ``image_size /
    DEFAULT_CROP_FRACTION``, i.e. 256 for 224), then the centre ``image_size`` square.
    ``image_size=None`` keeps the original image. Returns float32 in [0, 255]."""
    image = tf.cast(decode_rgb(encoded), tf.float32)
    if image_size is None:
        return image
    resize_size = resize_size or round(image_size / DEFAULT_CROP_FRACTION)
    shape = tf.cast(tf.shape(image)[:2], tf.float32)
    factor = resize_size / tf.reduce_min(shape)
    new = tf.cast(tf.round(shape * factor), tf.int32)
    new = tf.maximum(new, image_size)
    image = tf.image.resize(image, new, method="bilinear", antialias=True)
    return tf.image.resize_with_crop_or_pad(image, image_size, image_size)


def normalize(image: tf.Tensor, mode: str | None) -> tf.Tensor:
    """``mode=None``: unchanged raw [0, 255] pixels; ``"imagenet"``: (x/255 - mean) / std."""
    if mode is None:
        return image
    if mode == "imagenet":
        mean = tf.constant(IMAGENET_MEAN, image.dtype) * 255.0
        std = tf.constant(IMAGENET_STD, image.dtype) * 255.0
        return (image - mean) / std
    raise ValueError(f"normalize must be None or 'imagenet', got {mode!r}")
