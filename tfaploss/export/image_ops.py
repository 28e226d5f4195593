"""Decoding and evaluation-style resizing of images, inside the serving graph.

These functions use TensorFlow ops only, so that the SavedModel runs them in TF
Serving; they are public so that callers can reproduce the served preprocessing.
"""

from __future__ import annotations

import tensorflow as tf

from tfaploss.data.augment import DEFAULT_CROP_FRACTION  # served as evaluated

# Largest image (width x height, as its header declares it) the serving graph decodes:
# 40 MP covers phone and most camera photos (~600 MB decoded and copied as float32);
# without a limit a 285 KB PNG declaring 10000 x 10000 costs 1.3 GB.
DEFAULT_MAX_PIXELS = 40_000_000
# The default request budget, in max_pixels: four images at the limit, ~2.4 GB decoded.
REQUEST_PIXELS_PER_MAX_PIXELS = 4
# A request in flight holds at most DECODE_BYTES_PER_PIXEL x max_request_pixels +
# REQUEST_OVERHEAD_BYTES beside the model (measured 12-17 bytes a pixel and 1.5-3 MB a
# calling thread; docs/serving.md, "Concurrent requests").
DECODE_BYTES_PER_PIXEL = 20
REQUEST_OVERHEAD_BYTES = 8 << 20
# What the serving signature decodes (tf.io.decode_image), as the docs and --help list it.
IMAGE_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "WebP")


def _check_image_size(image_size):
    if len(image_size) != 2 or any(int(s) < 1 for s in image_size):
        raise ValueError(f"`image_size` must be (height, width) > 0; received {image_size!r}")
    return int(image_size[0]), int(image_size[1])


def resize_and_center_crop(image, image_size=(224, 224), crop_fraction=DEFAULT_CROP_FRACTION,
                           method="bilinear", antialias=True):
    """Evaluation preprocessing of one image: aspect-preserving resize + centre crop.

    The image ``(H, W, C)`` is scaled by ``max(round(h / crop_fraction) / H,
    round(w / crop_fraction) / W)`` (e.g. short side 224 / 0.875 = 256), then the central
    ``h x w`` window is kept: the test transform of ``tfaploss.data``. An image that
    already has the resized size is not resampled (bit-exact pixels).

    Returns float32 ``(h, w, C)`` with the input's value range (0..255 for decoded
    images). Cost: O(H·W + h·w) per image.
    """
    h, w = _check_image_size(image_size)
    if not 0 < crop_fraction <= 1:
        raise ValueError(f"`crop_fraction` must be in (0, 1]; received {crop_fraction!r}")
    image = tf.convert_to_tensor(image)
    size = tf.cast(tf.shape(image)[:2], tf.float32)
    resize_to = tf.constant([round(h / crop_fraction), round(w / crop_fraction)], tf.float32)
    factor = tf.reduce_max(resize_to / size)
    new_size = tf.maximum(tf.cast(tf.round(size * factor), tf.int32), [h, w])
    image = tf.cast(image, tf.float32)
    image = tf.cond(
        tf.reduce_all(tf.equal(new_size, tf.shape(image)[:2])),
        lambda: image,
        lambda: tf.image.resize(image, new_size, method=method, antialias=antialias),
    )
    top = (new_size[0] - h) // 2
    left = (new_size[1] - w) // 2
    image = image[top:top + h, left:left + w]
    return tf.ensure_shape(image, [h, w, None])


def check_max_pixels(max_pixels) -> int:
    """``max_pixels`` as a positive int, or a ValueError naming it."""
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise ValueError(f"`max_pixels` must be a positive integer; received {max_pixels!r}")
    return max_pixels


def check_max_request_pixels(max_request_pixels, max_pixels: int) -> int:
    """``max_request_pixels`` as an int >= ``max_pixels`` (``None``:
    :data:`REQUEST_PIXELS_PER_MAX_PIXELS` x ``max_pixels``), or a ValueError naming it."""
    if max_request_pixels is None:
        return REQUEST_PIXELS_PER_MAX_PIXELS * max_pixels
    if (isinstance(max_request_pixels, bool) or not isinstance(max_request_pixels, int)
            or max_request_pixels < max_pixels):
        raise ValueError("`max_request_pixels` must be an integer >= max_pixels="
                         f"{max_pixels} (one allowed image must fit a request); received "
                         f"{max_request_pixels!r}")
    return max_request_pixels


def _decode_within(data, declared, image_size, crop_fraction, method, antialias, max_pixels):
    """Decode one image, never past ``max_pixels``: ``(image, pixels)``, ``image`` zeros
    when over. A JPEG's size comes first from libjpeg itself (no header trick can show
    it another size), the other formats' from the header walk (``declared``); the
    decoded shape is checked again before the float32 resize.
    """
    h, w = image_size
    empty = tf.zeros([h, w, 3], tf.float32)
    is_jpeg = tf.equal(tf.strings.substr(data, 0, 3), b"\xff\xd8\xff")

    def jpeg_pixels():
        shape = tf.cast(tf.image.extract_jpeg_shape(data), tf.float64)
        return shape[0] * shape[1]

    pixels = tf.cond(is_jpeg, jpeg_pixels, lambda: declared)

    def decode():
        image = tf.io.decode_image(data, channels=3, expand_animations=False)
        shape = tf.cast(tf.shape(image), tf.float64)
        got = shape[0] * shape[1]
        return tf.cond(
            got <= max_pixels,
            lambda: resize_and_center_crop(image, (h, w), crop_fraction, method, antialias),
            lambda: empty), got

    return tf.cond(pixels <= max_pixels, decode, lambda: (empty, pixels))


def decode_images(image_bytes, image_size=(224, 224), crop_fraction=DEFAULT_CROP_FRACTION,
                  method="bilinear", antialias=True, max_pixels=DEFAULT_MAX_PIXELS,
                  max_request_pixels=None):
    """Decode a batch of encoded images (JPEG, PNG, GIF, BMP, WebP) to ``(N, h, w, 3)``
    float32.

    Each image is decoded to RGB (grayscale repeated, alpha dropped, a GIF's first
    frame) and passed through ``resize_and_center_crop``, in parallel, in order.

    No image is decoded past ``max_pixels``, whatever its header says: the declared
    sizes (:func:`tfaploss.export.image_header.declared_pixels`) are checked before
    anything is decoded, then the decoded shapes before the resize. The whole request
    is held to ``max_request_pixels`` (default :data:`REQUEST_PIXELS_PER_MAX_PIXELS` x
    ``max_pixels``) the same way.

    Raises:
        tf.errors.InvalidArgumentError: inputs that declare or decode to more than
            ``max_pixels`` (naming their indexes), a request over
            ``max_request_pixels``, or images that cannot be decoded. The whole request
            fails (nothing is silently dropped) and a server keeps running.
    """
    from tfaploss.export.image_header import declared_pixels

    h, w = _check_image_size(image_size)
    max_pixels = check_max_pixels(max_pixels)
    max_request_pixels = check_max_request_pixels(max_request_pixels, max_pixels)
    image_bytes = tf.convert_to_tensor(image_bytes, tf.string)
    n = tf.shape(image_bytes, out_type=tf.int64)[0]
    indices = tf.range(n)

    pixels = tf.map_fn(declared_pixels, image_bytes, fn_output_signature=tf.float64)
    size_check = _image_check(indices, pixels, "declare", max_pixels,
                              "; downscale them before sending (or export with a larger "
                              "max_pixels)")
    # Unreadable headers count 0 here: they are refused below without being decoded.
    total = tf.reduce_sum(tf.maximum(pixels, 0.0))
    total_check = _request_check(total, "declare", max_request_pixels, "; nothing was decoded")
    with tf.control_dependencies([size_check, total_check]):
        # Only what the header walk recognised and could read is decoded: the rest is
        # reported with the undecodable inputs below.
        readable = tf.identity(pixels > 0)

    def decode(data, index, declared):
        image, got = _decode_within(data, declared, (h, w), crop_fraction, method, antialias,
                                    max_pixels)
        return image, index, got

    # A decoding error would abort the batch without saying which image is bad:
    # drop failures here, then name the missing indices in one assertion.
    decoded = (
        tf.data.Dataset.from_tensor_slices((image_bytes, indices, pixels, readable))
        .filter(lambda data, index, declared, ok: ok)
        .map(lambda data, index, declared, ok: decode(data, index, declared),
             num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        .ignore_errors()
    )
    # A sentinel keeps the single batch non-empty when every image fails.
    sentinel = tf.data.Dataset.from_tensors(
        (tf.zeros([h, w, 3]), tf.constant(-1, tf.int64), tf.constant(0, tf.float64)))
    images, decoded_indices, decoded_pixels = (
        decoded.concatenate(sentinel).batch(n + 1).get_single_element())
    images, decoded_indices = images[:-1], decoded_indices[:-1]
    decode_check = _image_check(decoded_indices, decoded_pixels[:-1], "decode to", max_pixels,
                                ", though their headers declare fewer; nothing larger was "
                                "decoded")
    decoded_total = _request_check(tf.reduce_sum(decoded_pixels), "decode to",
                                   max_request_pixels, ", though they declare fewer")
    bad = tf.sparse.to_dense(tf.sets.difference(indices[None], decoded_indices[None]))[0]
    with tf.control_dependencies([decode_check, decoded_total]):
        check = tf.debugging.Assert(
            tf.equal(tf.size(bad), 0),
            ["image_bytes: could not decode the image(s) at index(es)", bad,
             ("of the batch; each input must be a complete JPEG, PNG, GIF, BMP or WebP "
              "file whose headers agree with its data (see tfaploss.export.image_header for "
              "what is refused)")],
            summarize=64,
        )
    with tf.control_dependencies([check]):
        return tf.identity(images)


def _image_check(indices, pixels, verb: str, max_pixels: int, tail: str):
    """Fails the request naming the ``indices`` whose ``pixels`` exceed ``max_pixels``."""
    over = tf.where(pixels > max_pixels)[:, 0]
    return tf.debugging.Assert(
        tf.equal(tf.size(over), 0),
        ["image_bytes: the image(s) at index(es)", tf.gather(indices, over), verb,
         tf.cast(tf.gather(pixels, over), tf.int64),
         f"pixels, more than max_pixels={max_pixels}{tail}"],
        summarize=64,
    )


def _request_check(total, verb: str, max_request_pixels: int, tail: str):
    return tf.debugging.Assert(
        total <= max_request_pixels,
        ["image_bytes: the request's images", verb, tf.cast(total, tf.int64),
         (f"pixels in all, more than max_request_pixels={max_request_pixels}{tail}; send "
          "fewer or smaller images per request (or export with a larger "
          "max_request_pixels)")],
    )
