"""Streaming class-balanced batch samplers over the by-class TFRecord layout.

In ``by_class/`` one record holds up to ``class_chunk_size`` images of ONE class; a
sampler takes the records streamed through a bounded shuffle buffer
(:func:`~tfaploss.data.records.shuffled_records`) and draws m distinct images from
each, so memory is ``shuffle_buffer x chunk bytes`` whatever the dataset size (no
index in memory, no reader per class) and only the chosen images are decoded. Batches
are class-major (image ``i`` in group ``i // m``): :func:`m_per_class` (B / m classes),
:func:`hierarchical` (two super-classes, B / 2 images each), :func:`all_classes` (every
eligible class, m each). Everything is deterministic given ``seed``.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

SAMPLERS = ("m_per_class", "hierarchical", "all_classes")


def draw_groups(chunks: tf.data.Dataset, m: int, seed: int = 0) -> tf.data.Dataset:
    """Keep records with >= m images and draw m distinct images from each."""
    chunks = chunks.filter(lambda c: tf.shape(c["encoded"])[0] >= m)

    def take(i, c):
        n = tf.shape(c["encoded"])[0]
        keys = tf.random.stateless_uniform([n], seed=tf.stack([tf.cast(seed, tf.int64), i]))
        pick = tf.argsort(keys)[:m]
        return {"encoded": tf.ensure_shape(tf.gather(c["encoded"], pick), [m]),
                "id": tf.ensure_shape(tf.gather(c["id"], pick), [m]),
                "label": c["label"], "super_label": c["super_label"]}

    return chunks.enumerate().map(take, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def distinct_runs(ds: tf.data.Dataset, group_size: int, key) -> tf.data.Dataset:
    """Drop elements so that each consecutive run of ``group_size`` has distinct keys.

    A ``scan`` keeps the keys of the run being filled; an element whose key is already
    in it is dropped. Then ``batch(group_size)`` yields groups of distinct keys.
    """
    init = (tf.fill([group_size], tf.constant(-1, tf.int32)), tf.constant(0, tf.int32))

    def step(state, elem):
        keys, count = state
        k = tf.cast(key(elem), tf.int32)
        dup = tf.reduce_any(tf.equal(keys, k))
        added = tf.tensor_scatter_nd_update(keys, [[count]], [k])
        keys = tf.where(dup, keys, added)
        count = tf.where(dup, count, count + 1)
        full = tf.equal(count, group_size)
        keys = tf.where(full, tf.fill([group_size], tf.constant(-1, tf.int32)), keys)
        count = tf.where(full, 0, count)
        return (keys, count), (elem, tf.logical_not(dup))

    return (ds.scan(init, step)
            .filter(lambda elem, keep: keep)
            .map(lambda elem, keep: elem))


def _flatten(groups: dict) -> tuple:
    """Batched groups [P, m] -> class-major (encoded [P*m], ids [P*m], labels [P*m])."""
    m = tf.shape(groups["encoded"])[1]
    labels = tf.repeat(groups["label"], m)
    return (tf.reshape(groups["encoded"], [-1]), tf.reshape(groups["id"], [-1]), labels)


def classes_per_batch(sampler: str, batch_size: int, m: int) -> int:
    """Classes of >= m images ``sampler`` needs to fill one batch: B / m for
    :func:`m_per_class` and :func:`hierarchical` (two super-classes of B / 2m classes
    each), 1 for :func:`all_classes`."""
    return batch_size // m if sampler in ("m_per_class", "hierarchical") else 1


def _check(batch_size: int, m: int) -> int:
    if m < 1:
        raise ValueError(f"m (images per class) must be >= 1, got {m}")
    if batch_size % m:
        raise ValueError(f"batch_size must be a multiple of m={m}, got {batch_size}")
    return batch_size // m


def m_per_class(chunks: tf.data.Dataset, batch_size: int, m: int, seed: int = 0):
    """P = batch_size / m distinct classes x m distinct images per batch."""
    p = _check(batch_size, m)
    groups = distinct_runs(draw_groups(chunks, m, seed), p, lambda g: g["label"])
    return groups.batch(p, drop_remainder=True).map(_flatten)


def m_per_class_rows(labels, batch_size: int, m: int, seed: int = 0) -> tf.data.Dataset:
    """:func:`m_per_class` over rows held in memory: endless batches of row indices into
    ``labels``, each class one chunk of its rows, streamed in a reshuffled order. Costs
    one sort of ``labels``; a ValueError names the classes short when fewer than
    ``batch_size / m`` have ``m`` rows (the stream would never fill a batch)."""
    p = _check(batch_size, m)
    labels = np.asarray(labels).reshape(-1)
    order = np.argsort(labels, kind="stable")
    classes, starts, counts = np.unique(labels[order], return_index=True, return_counts=True)
    if np.sum(counts >= m) < p:
        raise ValueError(f"batch {batch_size} needs {p} classes of >= {m} images; the "
                         f"labels have {int(np.sum(counts >= m))}.")
    rows = tf.RaggedTensor.from_row_starts(order.astype(np.int64), starts)
    chunks = tf.data.Dataset.from_tensor_slices(
        {"encoded": rows, "id": rows, "label": classes.astype(np.int32),
         "super_label": np.full(len(classes), -1, np.int32)})
    chunks = chunks.shuffle(len(classes), seed=seed, reshuffle_each_iteration=True).repeat()
    return m_per_class(chunks, batch_size, m, seed).map(lambda rows, _ids, _labels: rows)


def hierarchical(chunks: tf.data.Dataset, batch_size: int, m: int, seed: int = 0):
    """Two distinct super-classes per batch, each giving (batch_size / 2) / m classes."""
    p = _check(batch_size, m)
    if p % 2:
        raise ValueError(f"hierarchical needs an even number of classes per batch "
                         f"(batch_size / m), got batch_size={batch_size}, m={m}")
    half = p // 2
    window = 2 * half  # oversample so that a window usually holds `half` distinct classes
    groups = draw_groups(chunks.filter(lambda c: c["super_label"] >= 0), m, seed)

    def first_distinct(g):
        uniq, idx = tf.unique(g["label"])
        first = tf.math.unsorted_segment_min(tf.range(tf.size(idx)), idx, tf.size(uniq))
        pick = first[:half]
        out = {k: tf.gather(v, pick) for k, v in g.items()}
        return out, tf.size(uniq) >= half

    halves = (groups
              .group_by_window(key_func=lambda g: tf.cast(g["super_label"], tf.int64),
                               reduce_func=lambda _, w: w.batch(window), window_size=window)
              .map(first_distinct)
              .filter(lambda g, ok: ok)
              .map(lambda g, ok: g))
    pairs = distinct_runs(halves, 2, lambda g: g["super_label"][0]).batch(2, drop_remainder=True)

    def merge(g):  # [2, half, ...] -> [p, ...]
        flat = {k: tf.reshape(v, tf.concat([[p], tf.shape(v)[2:]], 0)) for k, v in g.items()}
        return _flatten(flat)

    return pairs.map(merge)


def all_classes(chunks: tf.data.Dataset, num_classes: int, m: int, seed: int = 0):
    """All ``num_classes`` eligible classes x m images per batch, sorted by label."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    groups = distinct_runs(draw_groups(chunks, m, seed), num_classes, lambda g: g["label"])

    def by_label(g):
        order = tf.argsort(g["label"])
        return _flatten({k: tf.gather(v, order) for k, v in g.items()})

    return groups.batch(num_classes, drop_remainder=True).map(by_label)


def check_shard_args(num_shards, index, index_name: str = "index") -> None:
    """ValueError unless ``num_shards`` is an int >= 1 and ``index`` one in
    [0, num_shards)."""
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got num_shards={num_shards!r}")
    if not isinstance(index, int) or not 0 <= index < num_shards:
        raise ValueError(f"{index_name} must be an int in [0, {num_shards}), got "
                         f"{index_name}={index!r}")


def shard_rows(batch: tuple, labels: tf.Tensor | None, num_shards: int, index: int,
               caller: str = "shard_batches") -> tuple:
    """Rows ``index * B / num_shards`` up to the next shard's start of every tensor in
    ``batch`` (rows first), after checking, at run time, that B is a multiple of
    ``num_shards`` and, when ``labels`` (class-major (B,) or (B, levels)) is given, that
    no class straddles two shards."""
    rows = tf.shape(batch[0])[0]
    size = rows // num_shards
    checks = [tf.debugging.assert_equal(rows % num_shards, 0, message=(
        f"{caller}: batch size not a multiple of num_shards={num_shards}"))]
    if labels is not None:
        classes = tf.reshape(labels, [rows, -1])[:, 0]
        # A class-major batch of distinct classes splits a class exactly where two
        # neighbouring rows across a shard boundary share a label.
        starts = tf.range(1, num_shards) * size
        checks.append(tf.debugging.assert_none_equal(
            tf.gather(classes, starts - 1), tf.gather(classes, starts), message=(
                f"{caller}: a class straddles two of the {num_shards} shards; "
                "B / num_shards must be a multiple of m")))
    with tf.control_dependencies(checks):
        start = index * size
    return tuple(t[start:start + size] for t in batch)


def shard_batches(dataset: tf.data.Dataset, num_shards: int, index: int,
                  label_index: int = 1) -> tf.data.Dataset:
    """Shard ``index`` of every class-major batch of ``dataset`` (rows first): every rank
    builds the same global batches and keeps its rows (:func:`shard_rows`).
    ``label_index``: where the labels are in each element. Cost: every rank decodes the
    whole batch; ``make_train_dataset(..., num_shards=W, shard_index=rank)`` gives the
    same shards and decodes only the rank's rows.
    """
    check_shard_args(num_shards, index)
    return dataset.map(lambda *batch: shard_rows(batch, batch[label_index], num_shards, index))
