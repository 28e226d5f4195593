"""One record file, read record by record: its TFRecord framing (each record's length
and data CRC-32C, as TensorFlow checks them, and a partial last record, which
TensorFlow ignores) and, optionally, every record's features (present, of the schema's
type, label in the manifest's class list, image non-empty, decodable). A
:class:`Damage` says what is wrong and where; :mod:`tfaploss.data.integrity` checks
whole splits with it and turns damage into one error message.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass

from tfaploss.data.framing import FOOTER, HEADER, masked_crc


@dataclass
class Damage:
    """One damaged file of a split: ``problem`` in words, where in the file, when known."""

    path: str
    problem: str
    offset: int | None = None
    record: int | None = None

    def line(self) -> str:
        parts = [f"{what} {at}" for what, at in (("record", self.record), ("byte", self.offset))
                 if at is not None]
        where = f" at {', '.join(parts)}" if parts else ""
        return f"{self.path}{where}: {self.problem}"


def size_damage(path: str, size: int, expect: dict | None) -> Damage | None:
    """The :class:`Damage` of a file whose ``size`` is not the manifest's (``expect``,
    its entry of the file), else None."""
    if expect is None or "bytes" not in expect or size == expect["bytes"]:
        return None
    return Damage(path, f"{size} bytes, the manifest says {expect['bytes']}"
                  + (" (an empty file)" if size == 0 else
                     " (truncated copy?)" if size < expect["bytes"] else ""))


_MAGIC = ((b"\xff\xd8\xff", "a JPEG image"), (b"\x89PNG", "a PNG image"),
          (b"\x1f\x8b", "gzip-compressed (the readers take uncompressed TFRecords)"),
          (b"PK\x03\x04", "a zip archive"), (b"GIF8", "a GIF image"),
          (b"{", "text (JSON?)"), (b"\x89HDF", "an HDF5 file"))


def _foreign(head: bytes) -> str | None:
    """What a file that is not a TFRecord file looks like it is, from its first bytes."""
    for magic, what in _MAGIC:
        if head.startswith(magic):
            return what
    if head and all(32 <= b < 127 or b in b"\t\r\n" for b in head[:64]):
        return "text"
    return None


def scan_shard(path: str, *, layout: str | None = None, classes: set[int] | None = None,
               tally: dict[int, int] | None = None,
               decode: bool = False) -> tuple[int, Damage | None]:
    """One pass over a TFRecord file: ``(records read, first Damage or None)``.

    Checks each record's length and data CRC-32C (what TensorFlow's reader checks) and
    a last record cut short (which TensorFlow's reader takes for the end of the file).
    With ``layout`` ("images" or "by_class") every record is also parsed and its
    features checked (:func:`check_example`). ``tally`` (by-class records): filled as in
    :func:`check_example`. ``decode``: also decode every image (with ``layout``).
    """
    size = os.path.getsize(path)
    if size == 0:
        return 0, None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        offset, n = 0, 0
        while offset < size:
            if offset + HEADER > size:
                return n, Damage(path, f"a record header cut short after {size - offset} "
                                 "of 12 bytes (truncated file)", offset, n)
            head = mm[offset:offset + HEADER]
            (length,) = struct.unpack_from("<Q", head)
            if masked_crc(head[:8]) != struct.unpack_from("<I", head, 8)[0]:
                what = _foreign(bytes(mm[:16])) if n == 0 else None
                problem = (f"not a TFRecord file: it looks like {what}" if what else
                           "corrupted record (its length fails its CRC)")
                return n, Damage(path, problem, offset, n)
            end = offset + HEADER + length + FOOTER
            if end > size:
                return n, Damage(path, f"a record of {length} bytes cut short after "
                                 f"{size - offset - HEADER} (truncated file)", offset, n)
            data = mm[offset + HEADER:offset + HEADER + length]
            if masked_crc(data) != struct.unpack_from("<I", mm, end - FOOTER)[0]:
                return n, Damage(path, "corrupted record (its data fail their CRC)",
                                 offset, n)
            if layout is not None:
                problem = check_example(data, layout, classes, tally, decode=decode)
                if problem:
                    return n, Damage(path, f"invalid record: {problem}", offset, n)
            offset, n = end, n + 1
    return n, None


_IMAGE_KINDS = {"image/encoded": "bytes_list", "image/id": "bytes_list",
                "image/index": "int64_list", "image/height": "int64_list",
                "image/width": "int64_list", "image/class/label": "int64_list",
                "image/class/super_label": "int64_list", "image/bbox": "float_list"}
_CLASS_KINDS = {"class/label": "int64_list", "class/super_label": "int64_list",
                "class/num_images": "int64_list", "image/encoded": "bytes_list",
                "image/id": "bytes_list"}
_REQUIRED = {"images": ("image/encoded", "image/id"),
             "by_class": ("class/label", "class/num_images")}
_LISTS = ("image/bbox",)  # variable length; every other feature holds one value
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM", b"RIFF")


def check_example(data: bytes, layout: str, classes: set[int] | None = None,
                  tally: dict[int, int] | None = None, decode: bool = False) -> str | None:
    """What is wrong with one serialized Example of ``layout`` ("images" or
    "by_class"), in words, or None: unparsable, a feature missing or mistyped, a label
    out of range or outside ``classes``, an empty or non-image ``image/encoded``, a
    by-class record without one ``image/id`` per image. ``tally``: for a sound by-class
    record, ``tally[label]`` becomes the most images one record of that class holds.
    ``decode``: also decode each image as the readers do (a decode per image)."""
    from tensorflow.core.example import example_pb2

    try:
        features = example_pb2.Example.FromString(bytes(data)).features.feature
    except Exception:  # noqa: BLE001 - any protobuf decode error means the same here
        return "not a tf.train.Example"
    kinds = _IMAGE_KINDS if layout == "images" else _CLASS_KINDS
    for key in _REQUIRED[layout]:
        if key not in features:
            return f"feature {key} is missing"
    for key, kind in kinds.items():
        if key not in features:
            continue
        found = features[key].WhichOneof("kind")
        if found != kind:
            return f"feature {key} holds {found or 'nothing'}, not {kind}"
        values = getattr(features[key], kind).value
        single = key not in _LISTS if layout == "images" else key.startswith("class/")
        if single and len(values) != 1:
            return f"feature {key} holds {len(values)} values, not 1"
    label_key = "image/class/label" if layout == "images" else "class/label"
    if label_key in features:
        label = features[label_key].int64_list.value[0]
        lowest = -1 if layout == "images" else 0  # -1: an image without a class
        if label < lowest:
            return f"{label_key} is {label}, below {lowest}"
        if label >= 0 and classes is not None and label not in classes:
            return f"{label_key} {label} is not among the manifest's {len(classes)} classes"
    encoded = list(features["image/encoded"].bytes_list.value) if "image/encoded" in \
        features else []
    if layout == "by_class":
        n = features["class/num_images"].int64_list.value[0]
        # num_images counts the whole class; a record holds one chunk of it
        if not encoded or n < len(encoded):
            return f"class/num_images is {n} but the record holds {len(encoded)} images"
    for jpeg in encoded:
        if not jpeg:
            return "image/encoded is empty"
        if not jpeg.startswith(_IMAGE_MAGIC):
            return "image/encoded is not a JPEG, PNG, GIF, BMP or WebP image"
    if layout == "by_class":
        # The samplers draw an image and its id with one index.
        ids = len(features["image/id"].bytes_list.value) if "image/id" in features else 0
        if ids != len(encoded):
            return f"image/id holds {ids} ids for {len(encoded)} images"
    if decode:
        for k, image in enumerate(encoded):
            problem = _undecodable(image)
            if problem:
                which = f" (image {k + 1} of {len(encoded)})" if len(encoded) > 1 else ""
                return f"image/encoded{which} does not decode: {problem}"
    if tally is not None and layout == "by_class":
        label = features["class/label"].int64_list.value[0]
        tally[label] = max(tally.get(label, 0), len(encoded))
    return None


def _undecodable(image: bytes) -> str | None:
    """Why TensorFlow's decoder (the readers': ``decode_image``, and libjpeg's own header
    read that the training crops start with) refuses ``image``, or None."""
    import tensorflow as tf

    try:
        data = tf.constant(image)
        if tf.io.is_jpeg(data):
            tf.io.extract_jpeg_shape(data)
        tf.io.decode_image(data, channels=3, expand_animations=False)
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as err:
        return first_line(err)
    return None


def error_text(err: BaseException) -> str:
    """The text of ``err``. TensorFlow quotes the record in some of its errors ("Could
    not parse example input, value: '...'"), and a record that is not UTF-8 then makes
    its error a ``UnicodeDecodeError`` over that message, which it carries as bytes."""
    if isinstance(err, UnicodeDecodeError) and isinstance(err.object, (bytes, bytearray)):
        return bytes(err.object).decode("utf-8", "replace")
    return getattr(err, "message", None) or str(err)


def first_line(err: BaseException) -> str:
    """The first line of a TensorFlow error, without its function and op names."""
    text = error_text(err)
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text)
    text = re.sub(r"\s*\[Op:[^\]]*\].*", "", text)  # the eager op's name, not the cause
    return text.strip().splitlines()[0][:300] if text.strip() else type(err).__name__
