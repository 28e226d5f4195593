"""Reading the TFRecords written by :mod:`pipelines` into ``tf.data``.

A *split* is a folder ``<output_dir>/<split>/`` holding ``images-*.tfrecord`` (one
``tf.train.Example`` per image), optionally ``by_class/classes-*.tfrecord`` (one record
per chunk of one class) and ``manifest.json``. Functions here accept that folder or a
glob of TFRecord files.
"""

from __future__ import annotations

import json
import os

import tensorflow as tf

IMAGE_SPEC = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/id": tf.io.FixedLenFeature([], tf.string),
    "image/index": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
    "image/height": tf.io.FixedLenFeature([], tf.int64, default_value=0),
    "image/width": tf.io.FixedLenFeature([], tf.int64, default_value=0),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
    "image/class/super_label": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
    "image/bbox": tf.io.VarLenFeature(tf.float32),
}

CLASS_SPEC = {
    "class/label": tf.io.FixedLenFeature([], tf.int64),
    "class/super_label": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
    "class/num_images": tf.io.FixedLenFeature([], tf.int64),
    "image/encoded": tf.io.VarLenFeature(tf.string),
    "image/id": tf.io.VarLenFeature(tf.string),
}


def split_files(path_or_glob: str, layout: str = "images") -> list[str]:
    """Sorted TFRecord files of a split folder (``layout`` "images" or "by_class") or glob."""
    if layout not in ("images", "by_class"):
        raise ValueError(f"layout must be 'images' or 'by_class', got {layout!r}")
    if tf.io.gfile.isdir(path_or_glob):
        pattern = (os.path.join(path_or_glob, "images-*.tfrecord") if layout == "images"
                   else os.path.join(path_or_glob, "by_class", "classes-*.tfrecord"))
    else:
        pattern = path_or_glob
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        hint = (" (write it with the pipelines job's --by_class train|all)"
                if layout == "by_class" else "")
        raise FileNotFoundError(f"no {layout} TFRecords match {pattern!r}{hint}")
    return files


def read_manifest(path_or_glob: str) -> dict | None:
    """The split's ``manifest.json`` (next to the files of a glob), or None."""
    base = path_or_glob if tf.io.gfile.isdir(path_or_glob) else os.path.dirname(path_or_glob)
    for candidate in (os.path.join(base, "manifest.json"),
                      os.path.join(os.path.dirname(base), "manifest.json")):
        if tf.io.gfile.exists(candidate):
            with tf.io.gfile.GFile(candidate) as f:
                return json.load(f)
    return None


def parse_image_example(serialized: tf.Tensor) -> dict:
    """Parse one per-image Example into a dict of tensors (``encoded`` stays JPEG)."""
    f = tf.io.parse_single_example(serialized, IMAGE_SPEC)
    return {
        "encoded": f["image/encoded"],
        "id": f["image/id"],
        "index": f["image/index"],
        "height": f["image/height"],
        "width": f["image/width"],
        "label": tf.cast(f["image/class/label"], tf.int32),
        "super_label": tf.cast(f["image/class/super_label"], tf.int32),
        "bbox": tf.sparse.to_dense(f["image/bbox"]),
    }


def parse_class_example(serialized: tf.Tensor) -> dict:
    """Parse one by-class record: ``encoded``/``id`` are vectors of the chunk's images."""
    f = tf.io.parse_single_example(serialized, CLASS_SPEC)
    return {
        "label": tf.cast(f["class/label"], tf.int32),
        "super_label": tf.cast(f["class/super_label"], tf.int32),
        "num_images": f["class/num_images"],
        "encoded": tf.sparse.to_dense(f["image/encoded"]),
        "id": tf.sparse.to_dense(f["image/id"]),
    }


def decode_rgb(encoded: tf.Tensor) -> tf.Tensor:
    """Decode JPEG/PNG bytes to ``uint8 [H, W, 3]``."""
    image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
    image.set_shape([None, None, 3])
    return image


def load_split(path_or_glob: str, *, decode: bool = True, shuffle_files: bool = False,
               seed: int | None = None) -> tf.data.Dataset:
    """All images of a split as a dataset of dicts, in file order unless shuffled.

    Each element: ``encoded`` (JPEG bytes), ``id``, ``index``, ``height``, ``width``,
    ``label`` (int32), ``super_label`` (int32), ``bbox`` (float32 [0 or 4]) and, with
    ``decode=True``, ``image`` (uint8 [H, W, 3], raw pixels).
    """
    files = split_files(path_or_glob, "images")
    ds = tf.data.Dataset.from_tensor_slices(files)
    if shuffle_files:
        ds = ds.shuffle(len(files), seed=seed)
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=1 if not shuffle_files else 4,
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.map(parse_image_example, num_parallel_calls=tf.data.AUTOTUNE)
    if decode:
        ds = ds.map(lambda e: {**e, "image": decode_rgb(e["encoded"])},
                    num_parallel_calls=tf.data.AUTOTUNE)
    return ds
