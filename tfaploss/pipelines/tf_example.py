"""The ``tf.train.Example`` wire format, written by hand so that workers never import
TensorFlow (seconds per process); deterministic (sorted keys), so the same features give
the same bytes. Also the record schemas and the balanced split of a class into chunks.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from typing import Any, BinaryIO

from tfaploss.data.framing import frame_record

IMAGE_FEATURES = {
    "image/encoded": ("bytes", "JPEG, RGB, EXIF orientation applied, resized to --max_side"),
    "image/format": ("bytes", "b'jpeg'"),
    "image/id": ("bytes", "dataset image id, unique within the split"),
    "image/path": ("bytes", "source path relative to --input_dir"),
    "image/index": ("int64", "position in the sorted listing (revisited: imlist index)"),
    "image/height": ("int64", "height of the encoded image"),
    "image/width": ("int64", "width of the encoded image"),
    "image/class/label": ("int64", "class label, contiguous 0..C-1 per split; -1 none"),
    "image/class/super_label": ("int64", "super-class label 0..S-1; -1 none"),
    "image/class/text": ("bytes", "class as the dataset names it"),
    "image/bbox": ("float[4]", "x0, y0, x1, y1 in source pixels (cropped queries only)"),
}

# One by-class record per chunk of a class: the class as the per-image records label it,
# the chunk's place in the class, and its N (<= --class_chunk_size) images' JPEGs and ids.
CLASS_FEATURES = {
    "class/label": IMAGE_FEATURES["image/class/label"],
    "class/super_label": IMAGE_FEATURES["image/class/super_label"],
    "class/num_images": ("int64", "images in the whole class"),
    "class/chunk": ("int64", "chunk index within the class"),
    "class/num_chunks": ("int64", "chunks of this class"),
    **{k: (f"{IMAGE_FEATURES[k][0]}[N]", IMAGE_FEATURES[k][1])
       for k in ("image/encoded", "image/id")},
}


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 -> two's complement, as protobuf does
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint((number << 3) | 2) + _varint(len(payload)) + payload


def _feature(values) -> bytes:
    """Serialise one ``tf.train.Feature`` from a list of bytes, ints or floats."""
    if not isinstance(values, (list, tuple)):
        values = [values]
    if values and isinstance(values[0], (bytes, str)):
        items = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
        return _field(1, b"".join(_field(1, v) for v in items))
    if values and isinstance(values[0], float):
        packed = struct.pack(f"<{len(values)}f", *values)
        return _field(2, _field(1, packed))
    packed = b"".join(_varint(int(v)) for v in values)
    return _field(3, _field(1, packed) if values else b"")


def serialize_example(features: dict[str, Any]) -> bytes:
    """Serialise ``{key: value or list}`` as a ``tf.train.Example``: bytes/str values
    become a BytesList, floats a FloatList, ints an Int64List."""
    entries = b"".join(
        _field(1, _field(1, key.encode("utf-8")) + _field(2, _feature(features[key])))
        for key in sorted(features)
    )
    return _field(1, entries)


def image_example(record: dict, jpeg: bytes, height: int, width: int) -> bytes:
    """The per-image Example for a work-list ``record`` (see :mod:`pipelines`)."""
    features = {
        "image/encoded": jpeg,
        "image/format": b"jpeg",
        "image/id": record["id"],
        "image/path": record.get("relpath", record["path"]),
        "image/index": int(record.get("index", -1)),
        "image/height": int(height),
        "image/width": int(width),
        "image/class/label": int(record.get("label", -1)),
        "image/class/super_label": int(record.get("super_label", -1)),
        "image/class/text": str(record.get("class_text", "")),
    }
    if record.get("bbox") is not None:
        features["image/bbox"] = [float(v) for v in record["bbox"]]
    return serialize_example(features)


def class_chunks(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """Split ``n`` items into ``ceil(n / chunk_size)`` balanced ``(start, stop)`` chunks.

    Balanced chunks all hold at least ``floor(chunk_size / 2)`` items when ``n`` exceeds
    ``chunk_size``, so a sampler drawing m <= chunk_size / 2 images from one chunk can use
    every chunk of every class that has at least m images.
    """
    num = max(1, math.ceil(n / chunk_size))
    bounds = [round(i * n / num) for i in range(num + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(num)]


def class_chunk_examples(label: int, items: Iterable[tuple], chunk_size: int) -> list[bytes]:
    """By-class records for one class; ``items`` are ``(id, super_label, jpeg)``."""
    items = sorted(items, key=lambda t: t[0])
    super_label = items[0][1] if items else -1
    chunks = class_chunks(len(items), chunk_size)
    out = []
    for i, (start, stop) in enumerate(chunks):
        part = items[start:stop]
        out.append(serialize_example({
            "class/label": int(label),
            "class/super_label": int(super_label),
            "class/num_images": len(items),
            "class/chunk": i,
            "class/num_chunks": len(chunks),
            "image/encoded": [t[2] for t in part],
            "image/id": [t[0] for t in part],
        }))
    return out


def write_tfrecords(f: BinaryIO, records: Iterable[bytes]) -> int:
    """Write ``records`` to the open binary file ``f`` in TFRecord framing; returns how
    many were written."""
    n = 0
    for data in records:
        f.write(frame_record(data))
        n += 1
    return n
