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

from tfaploss.data.augment import decode_rgb
from tfaploss.data.integrity import skipped_files
from tfaploss.data.split_manifest import MANIFEST, label_table

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
    skipped = skipped_files()
    if skipped and files:
        # damaged shards a run was told to skip (tfaploss.data.integrity.skipping)
        files = [f for f in files if os.path.normpath(f) not in skipped]
    if not files:
        hint = (" (write it with the pipelines job's --by_class train|all)"
                if layout == "by_class" else "")
        raise FileNotFoundError(f"no {layout} TFRecords match {pattern!r}{hint}")
    return files


def read_manifest(path_or_glob: str) -> dict | None:
    """The split's ``manifest.json`` (next to the files of a glob), or None."""
    base = path_or_glob if tf.io.gfile.isdir(path_or_glob) else os.path.dirname(path_or_glob)
    for candidate in (os.path.join(base, MANIFEST),
                      os.path.join(os.path.dirname(base), MANIFEST)):
        if tf.io.gfile.exists(candidate):
            with tf.io.gfile.GFile(candidate) as f:
                return json.load(f)
    return None


def _label_ok(label: tf.Tensor, table, lowest: int) -> tf.Tensor:
    """``label >= lowest``, and a label >= 0 is one of ``table``'s (the manifest's
    classes) when there is one."""
    ok = label >= lowest
    if table is not None:
        member = tf.gather(tf.constant(table), tf.clip_by_value(label, 0, len(table) - 1))
        ok = tf.logical_and(ok, tf.logical_or(label < 0, tf.logical_and(
            label < len(table), member)))
    return ok


def _checked(out: dict, conditions: list, message: str) -> dict:
    # One Assert per record: a few scalar ops, nothing next to the JPEG decode. The
    # message starts with "damaged record" so that integrity.reading knows it.
    check = tf.debugging.Assert(tf.reduce_all(tf.stack(conditions)),
                                [f"damaged record: {message}"])
    with tf.control_dependencies([check]):
        return {k: tf.identity(v) for k, v in out.items()}


def parse_image_example(serialized: tf.Tensor, labels: list[bool] | None = None) -> dict:
    """Parse one per-image Example into a dict of tensors (``encoded`` stays JPEG).

    A record whose ``image/encoded`` is empty, or whose label is below -1 (no class) or
    outside ``labels`` (``labels[c]`` True for the manifest's classes,
    :func:`~tfaploss.data.split_manifest.label_table`), fails with an
    ``InvalidArgumentError`` starting "damaged record", as do a missing feature and one
    of another type (``tf.io.parse_single_example``'s own).
    """
    f = tf.io.parse_single_example(serialized, IMAGE_SPEC)
    out = {
        "encoded": f["image/encoded"],
        "id": f["image/id"],
        "index": f["image/index"],
        "height": f["image/height"],
        "width": f["image/width"],
        "label": tf.cast(f["image/class/label"], tf.int32),
        "super_label": tf.cast(f["image/class/super_label"], tf.int32),
        "bbox": tf.sparse.to_dense(f["image/bbox"]),
    }
    return _checked(out, [tf.strings.length(out["encoded"]) > 0,
                          _label_ok(f["image/class/label"], labels, -1)],
                    "empty image/encoded, or image/class/label below -1 or not among the "
                    "manifest's classes")


def parse_class_example(serialized: tf.Tensor, labels: list[bool] | None = None) -> dict:
    """Parse one by-class record: ``encoded``/``id`` are vectors of the chunk's images.

    Checked as :func:`parse_image_example` does, with labels >= 0 and
    at least one image, no more than ``class/num_images`` (the class's, of which a
    record holds a chunk) and one ``image/id`` per image (the samplers draw both with
    one index).
    """
    f = tf.io.parse_single_example(serialized, CLASS_SPEC)
    out = {
        "label": tf.cast(f["class/label"], tf.int32),
        "super_label": tf.cast(f["class/super_label"], tf.int32),
        "num_images": f["class/num_images"],
        "encoded": tf.sparse.to_dense(f["image/encoded"]),
        "id": tf.sparse.to_dense(f["image/id"]),
    }
    return _checked(out, [
        tf.reduce_all(tf.strings.length(out["encoded"]) > 0),
        tf.size(out["encoded"]) > 0,
        tf.size(out["encoded"], out_type=tf.int64) <= out["num_images"],
        tf.equal(tf.size(out["id"]), tf.size(out["encoded"])),
        _label_ok(f["class/label"], labels, 0)],
        "empty image/encoded, more images than class/num_images, image/id not one id "
        "per image, or class/label negative or not among the manifest's classes")


def load_split(path_or_glob: str, *, decode: bool = True, shuffle_files: bool = False,
               seed: int | None = None) -> tf.data.Dataset:
    """All images of a split as a dataset of dicts, in file order unless shuffled.

    Each element: ``encoded`` (JPEG bytes), ``id``, ``index``, ``height``, ``width``,
    ``label`` (int32), ``super_label`` (int32), ``bbox`` (float32 [0 or 4]) and, with
    ``decode=True``, ``image`` (uint8 [H, W, 3], raw pixels).
    """
    files = split_files(path_or_glob, "images")
    labels = label_table(read_manifest(path_or_glob))
    ds = tf.data.Dataset.from_tensor_slices(files)
    if shuffle_files:
        ds = ds.shuffle(len(files), seed=seed)
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=1 if not shuffle_files else 4,
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.map(lambda r: parse_image_example(r, labels), num_parallel_calls=tf.data.AUTOTUNE)
    if decode:
        ds = ds.map(lambda e: {**e, "image": decode_rgb(e["encoded"])},
                    num_parallel_calls=tf.data.AUTOTUNE)
    return ds


def shuffled_records(files: list[str], parse, *, seed: int, shuffle_buffer: int
                     ) -> tf.data.Dataset:
    """Endless stream of the records of ``files``, each through ``parse``: the files in a
    reshuffled order, 8 read at once, then a ``shuffle_buffer`` of records."""
    ds = tf.data.Dataset.from_tensor_slices(files)
    ds = ds.shuffle(len(files), seed=seed, reshuffle_each_iteration=True).repeat()
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=max(1, min(8, len(files))),
                       block_length=1, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.shuffle(shuffle_buffer, seed=seed + 1, reshuffle_each_iteration=True)
    return ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
