"""The output files of a split, assembled from the part files the image workers wrote
(where the image work ran, so that a split's files are written side by side)."""

from __future__ import annotations

import collections
import os

from tfaploss.data.framing import frame_record
from tfaploss.pipelines import image_workers as W
from tfaploss.pipelines import storage
from tfaploss.pipelines import tf_example as X


def write_image_shard(path: str, items: list[tuple]) -> int:
    """Write the per-image TFRecord file ``path`` from ``items`` = ``(index, id, part,
    offset, length)``, in (index, id) order; returns how many records it holds."""
    items = sorted(items, key=lambda t: (t[0], t[1]))
    _write(path, b"".join(W.read_slices((t[2], t[3], t[4]) for t in items)))
    return len(items)


def write_class_shard(path: str, items: list[tuple], chunk_size: int) -> int:
    """Write the by-class TFRecord file ``path`` from ``items`` = ``(label, id, super,
    part, jpeg_offset, jpeg_length)``: each class in chunks of at most ``chunk_size``
    images, in (label, chunk) order; returns how many records it holds."""
    jpegs = W.read_slices((t[3], t[4], t[5]) for t in items)
    per_class: dict[int, list] = collections.defaultdict(list)
    for (label, image_id, sup, *_), jpeg in zip(items, jpegs):
        per_class[label].append((image_id, sup, bytes(jpeg)))
    records = [r for label in sorted(per_class)
               for r in X.class_chunk_examples(label, per_class[label], chunk_size)]
    _write(path, b"".join(frame_record(r) for r in records))
    return len(records)


def _write(path: str, data: bytes) -> None:
    storage.makedirs(os.path.dirname(path))  # nothing to make on object stores
    storage.write_atomic(path, data, fault="shard")
