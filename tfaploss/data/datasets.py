"""Training and evaluation datasets: ``(images, labels)`` batches ready for a model."""

from __future__ import annotations

import logging
from collections import Counter

import tensorflow as tf

from tfaploss.data import augment as A
from tfaploss.data import integrity as I
from tfaploss.data import records as R
from tfaploss.data import samplers as S
from tfaploss.data.split_manifest import label_table

LOG = logging.getLogger("tfaploss.data")


def _eligible(manifest: dict, m: int) -> dict[int, int]:
    """``{label: count}`` of the classes with at least m images; while damaged by-class
    files are skipped (:func:`tfaploss.data.integrity.skipping`), only the classes a
    kept file holds in a record of m images (a sampler draws m from one record): a
    sampler counting the lost ones would wait forever for a batch."""
    kept = I.kept_class_records()
    return {int(k): v for k, v in manifest.get("class_counts", {}).items()
            if v >= m and int(k) >= 0 and (kept is None or kept.get(int(k), 0) >= m)}


def _validate_sampler(manifest, sampler: str, batch_size: int, m: int) -> None:
    if manifest is None:
        LOG.warning("no manifest.json beside the data: cannot check that the %s sampler "
                    "can fill a batch; it blocks forever if it cannot", sampler)
        return
    chunk = (manifest.get("by_class") or {}).get("chunk_size")
    if chunk and chunk < 2 * m:
        LOG.warning("class_chunk_size=%d < 2 m=%d: chunks of large classes may hold fewer "
                    "than m images and are then skipped", chunk, 2 * m)
    eligible = _eligible(manifest, m)
    if sampler == "m_per_class" and len(eligible) < batch_size // m:
        left = (" once its damaged by-class files are skipped"
                if I.kept_class_records() is not None else "")
        raise ValueError(
            f"batch_size={batch_size} with m={m} needs {batch_size // m} classes with >= {m} "
            f"images, the split has {len(eligible)}{left}; lower batch_size or m")
    if sampler == "hierarchical":
        supers = manifest.get("class_super_labels") or {}
        if not supers:
            raise ValueError("sampler='hierarchical' needs super-class labels; this split has "
                             "none (image/class/super_label is -1)")
        per_super = Counter(supers.get(str(label), -1) for label in eligible)
        half = batch_size // m // 2
        usable = [s for s, n in per_super.items() if s >= 0 and n >= half]
        if len(usable) < 2:
            raise ValueError(
                f"sampler='hierarchical' with batch_size={batch_size}, m={m} needs two "
                f"super-classes with >= {half} classes of >= {m} images; found {len(usable)}")
    if sampler == "all_classes" and not eligible:
        raise ValueError(f"sampler='all_classes': no class has >= m={m} images")


def _super_label_table(manifest) -> tf.Tensor:
    """Super-class of every class id (``manifest.json``'s ``class_super_labels``)."""
    supers = {int(k): int(v) for k, v in ((manifest or {}).get("class_super_labels")
                                          or {}).items()}
    if not supers:
        raise ValueError("label_levels=2 needs super-class labels; this split's manifest.json "
                         "has none (class_super_labels), or there is no manifest")
    table = [-1] * (max(supers) + 1)
    for label, sup in supers.items():
        table[label] = sup
    return tf.constant(table, tf.int32)


def _lookup(table: tf.Tensor, label: tf.Tensor) -> tf.Tensor:
    inside = tf.logical_and(label >= 0, label < tf.shape(table)[0])
    return tf.where(inside, tf.gather(table, tf.clip_by_value(label, 0, tf.shape(table)[0] - 1)),
                    -1)


def _levels(label: tf.Tensor, super_label: tf.Tensor, label_levels: int) -> tf.Tensor:
    """``label`` or ``[label, super_label]``; a missing super-class (-1) becomes
    ``-2 - label``, one of the class's own, so that HAP never sees two unrelated classes
    as sharing a super-class."""
    if label_levels == 1:
        return label
    super_label = tf.cast(super_label, label.dtype)
    return tf.stack([label, tf.where(super_label >= 0, super_label, -2 - label)])


def _augment_fn(image_size: int, augment: bool, crop_scale, normalize, flip=None):
    flip = augment if flip is None else bool(flip)

    def fn(encoded, seed):
        if augment:
            image = A.random_resized_crop(encoded, image_size, seed, scale=crop_scale)
        else:
            image = A.center_crop(encoded, image_size)
        if flip:
            image = A.random_flip(image, seed + 1)
        image = tf.ensure_shape(image, [image_size, image_size, 3])
        return A.normalize(image, normalize)
    return fn


def make_train_dataset(path: str, *, sampler: str | None = "m_per_class", batch_size: int = 32,
                       m: int = 4, image_size: int = 224, augment: bool = True,
                       crop_scale: tuple[float, float] = (0.16, 1.0), normalize: str | None = None,
                       seed: int = 0, shuffle_buffer: int = 256, num_classes: int | None = None,
                       with_ids: bool = False, flip: bool | None = None,
                       label_levels: int = 1, num_shards: int = 1,
                       shard_index: int = 0) -> tf.data.Dataset:
    """Endless training batches ``(images float32 [B, S, S, 3], labels int32 [B])``.

    Args:
        path: a split folder written by a ``pipelines`` job (``OUT/train``) or a glob of
            TFRecords (by-class files for a sampler, per-image files for ``sampler=None``).
        sampler: ``"m_per_class"``, ``"hierarchical"`` or ``"all_classes"`` (B = C x m,
            ``batch_size`` ignored), reading the by-class layout
            (:mod:`tfaploss.data.samplers`; batches class-major), or ``None``: shuffled
            per-image records.
        batch_size: images per batch B (a multiple of m for the samplers).
        m: images per class in a batch.
        image_size: side S of the square output images.
        augment: RandomResizedCrop(``crop_scale``, ratio 3/4..4/3), then ``flip``;
            False: resize the shorter side to S / 0.875 and centre-crop S.
        crop_scale: area range of the crop, (0.16, 1) (ROADMAP) or (0.08, 1) (torchvision).
        normalize: ``None`` (raw pixels in [0, 255]) or ``"imagenet"``.
        seed: makes the stream, and each new iterator's reshuffle, reproducible.
        shuffle_buffer: records in the shuffle buffer (memory: this times a record).
        num_classes: for ``all_classes`` without a manifest.
        with_ids: also return the image ids: ``(images, labels, ids)``.
        flip: random horizontal flip after the crop; ``None`` flips when ``augment``;
            ``False`` for classes that are mirror images of each other.
        label_levels: 1: labels [B]; 2: labels [B, 2] = (class, super-class).
        num_shards, shard_index: this rank's share of each global batch (whole classes;
            ``B / num_shards`` a multiple of m); every rank draws the same global batches
            and decodes only its own rows.

    Returns:
        An infinite ``tf.data.Dataset`` of ``B / num_shards`` rows per batch.
    """
    if sampler not in (None, *S.SAMPLERS):
        raise ValueError(f"sampler must be one of {S.SAMPLERS} or None, got {sampler!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if label_levels not in (1, 2):
        raise ValueError(f"label_levels must be 1 (class) or 2 (class, super-class), got "
                         f"{label_levels!r}")
    S.check_shard_args(num_shards, shard_index, "shard_index")
    A.normalize(tf.zeros([1, 1, 3]), normalize)  # validates `normalize` up front
    manifest = R.read_manifest(path)
    labels = label_table(manifest)
    batch = batch_size
    if sampler is None:
        ds = R.shuffled_records(R.split_files(path, "images"),
                                lambda r: R.parse_image_example(r, labels),
                                seed=seed, shuffle_buffer=shuffle_buffer)
        images = ds.map(lambda e: (e["encoded"], e["id"], _levels(e["label"], e["super_label"],
                                                                  label_levels)))
    else:
        _validate_sampler(manifest, sampler, batch_size, m)
        chunks = R.shuffled_records(R.split_files(path, "by_class"),
                                    lambda r: R.parse_class_example(r, labels),
                                    seed=seed, shuffle_buffer=shuffle_buffer)
        if sampler == "m_per_class":
            batches = S.m_per_class(chunks, batch_size, m, seed)
        elif sampler == "hierarchical":
            batches = S.hierarchical(chunks, batch_size, m, seed)
        else:
            if num_classes is None:
                if manifest is None:
                    raise ValueError("sampler='all_classes' needs num_classes when the split "
                                     "has no manifest.json")
                num_classes = len(_eligible(manifest, m))
            batches = S.all_classes(chunks, num_classes, m, seed)
            batch = num_classes * m
        images = batches.unbatch()
        if label_levels == 2:
            supers = _super_label_table(manifest)
            images = images.map(lambda e, i, y: (e, i, _levels(y, _lookup(supers, y), 2)))
    if batch % num_shards:
        raise ValueError(f"num_shards={num_shards} must divide the batch of {batch} images "
                         "(batch_size, or the number of classes x m for all_classes)")
    if sampler is not None and (batch // num_shards) % m:
        raise ValueError(f"num_shards={num_shards} would split a class between two ranks: "
                         f"the {batch // num_shards} images of a shard must be a multiple "
                         f"of m={m}")
    fn = _augment_fn(image_size, augment, crop_scale, normalize, flip)

    def load(i, elem):
        encoded, ids, label = elem
        image_seed = tf.stack([tf.cast(seed, tf.int64) + 7919, i])
        return fn(encoded, image_seed), tf.cast(label, tf.int32), ids

    indexed = images.enumerate()  # the position i seeds each image's crop and flip
    if num_shards > 1:
        # Every rank chooses the same global batch (records, ids, labels), which costs a
        # fraction of decoding it; each then cuts its rows out before the decode and keeps
        # their global positions, so its images are those of the one-rank batch.
        def own_rows(i, elem):
            labels = elem[2] if sampler is not None else None
            rows = S.shard_rows((i, *elem), labels, num_shards, shard_index,
                                caller="make_train_dataset")
            return rows[0], rows[1:]

        indexed = indexed.batch(batch, drop_remainder=True).map(own_rows).unbatch()
    ds = indexed.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.batch(batch // num_shards, drop_remainder=True)
    if not with_ids:
        ds = ds.map(lambda x, y, i: (x, y))
    return ds.prefetch(tf.data.AUTOTUNE)


def make_eval_dataset(path: str, *, image_size: int | None = 224, resize_size: int | None = None,
                      batch_size: int = 64, normalize: str | None = None) -> tf.data.Dataset:
    """Every image of a split once, in file order: ``(images, labels int32, ids string)``.

    ``image_size``: centre-crop side S after resizing the shorter side to
    ``resize_size`` (default S / 0.875); ``None`` keeps each image's own size
    (landmarks; ``batch_size=1``). ``normalize``: ``None`` (raw [0, 255] pixels) or
    ``"imagenet"``.
    """
    if image_size is None and batch_size != 1:
        raise ValueError(f"image_size=None keeps every image's size, so batch_size must be 1, "
                         f"got {batch_size}")
    A.normalize(tf.zeros([1, 1, 3]), normalize)
    ds = R.load_split(path, decode=False)

    def load(e):
        image = A.normalize(A.center_crop(e["encoded"], image_size, resize_size), normalize)
        return image, e["label"], e["id"]

    ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)
