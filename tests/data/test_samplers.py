"""Class-balanced samplers: exact batch composition, eligibility, determinism."""

import numpy as np
import pytest
import tensorflow as tf

import tfaploss.data as D
from tests.support import miniature as mini
from tfaploss.data import datasets
from tfaploss.data.samplers import shard_batches


def batches(ds, n):
    out = []
    for images, labels, ids in ds.take(n):
        out.append((images.numpy(), labels.numpy(), [i.decode() for i in ids.numpy()]))
    return out


def check_groups(labels, ids, m):
    """Class-major groups of m: one class per group, m distinct images of that class."""
    groups = labels.reshape(-1, m)
    assert (groups == groups[:, :1]).all()
    for g, row in enumerate(np.asarray(ids).reshape(-1, m)):
        assert len(set(row)) == m
        assert all(i.split("/")[0] == str(groups[g, 0]) for i in row)
    return groups[:, 0]


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("sampler_split"))
    sizes = {0: 6, 1: 5, 2: 3, 3: 12, 4: 4, 5: 9, 6: 4}
    mini.write_split_records(d, sizes, chunk_size=8, size=(12, 10))
    return d


def test_m_per_class_composition(split):
    ds = D.make_train_dataset(split, sampler="m_per_class", batch_size=12, m=4, image_size=8,
                              augment=False, seed=3, with_ids=True, shuffle_buffer=8)
    seen = set()
    for images, labels, ids in batches(ds, 12):
        assert images.shape == (12, 8, 8, 3) and labels.dtype == np.int32
        classes = check_groups(labels, ids, 4)
        assert len(set(classes)) == 3  # P distinct classes
        assert 2 not in classes        # 3 images < m: never drawn
        seen.update(classes.tolist())
        for image, label in zip(images, labels):  # pixels travel with their label
            np.testing.assert_allclose(image[4, 4], mini.class_colour(label), atol=6)
    assert seen == {0, 1, 3, 4, 5, 6}


def test_deterministic_with_a_seed(split):
    def run(ds):
        return [(b[2], float(b[0].sum())) for b in batches(ds, 3)]

    kw = {"batch_size": 8, "m": 2, "image_size": 8, "with_ids": True}
    a = run(D.make_train_dataset(split, seed=5, **kw))
    b = run(D.make_train_dataset(split, seed=5, **kw))
    c = run(D.make_train_dataset(split, seed=6, **kw))
    assert [x[0] for x in a] == [x[0] for x in b]
    assert [x[1] for x in a] == [x[1] for x in b]  # same crops and flips too
    assert [x[0] for x in a] != [x[0] for x in c]


def test_m_per_class_rows_over_labels_in_memory():
    """The same sampler over rows in memory (the compare command's features): P distinct
    classes of m distinct rows, classes with fewer than m rows never drawn, every
    eligible class drawn equally often (one chunk each, reshuffled), seeded."""
    from tfaploss.data.samplers import m_per_class_rows

    rng = np.random.default_rng(0)
    labels = rng.permutation(np.concatenate([np.repeat(np.arange(8), 6), [8, 8, 8]]))
    got = list(m_per_class_rows(labels, 8, 4, seed=1).take(60).as_numpy_iterator())
    for rows in got:
        assert rows.shape == (8,) and len(set(rows.tolist())) == 8
        classes = labels[rows].reshape(2, 4)
        assert (classes == classes[:, :1]).all() and classes[0, 0] != classes[1, 0]
    drawn = np.bincount(labels[np.concatenate(got)], minlength=9)
    assert drawn[8] == 0 and drawn[:8].min() >= 40 and drawn.sum() == 480
    again = list(m_per_class_rows(labels, 8, 4, seed=1).take(60).as_numpy_iterator())
    other = list(m_per_class_rows(labels, 8, 4, seed=2).take(60).as_numpy_iterator())
    assert np.array_equal(got, again) and not np.array_equal(got, other)
    with pytest.raises(ValueError, match="needs 3 classes of >= 4 images; the labels have 2"):
        m_per_class_rows(labels[labels < 2], 12, 4)


def test_hierarchical_two_super_classes_half_each(tmp_path):
    sizes = {k: 5 for k in range(12)}
    supers = {k: k % 3 for k in range(12)}
    mini.write_split_records(str(tmp_path), sizes, supers, chunk_size=8, size=(12, 10))
    ds = D.make_train_dataset(str(tmp_path), sampler="hierarchical", batch_size=8, m=2,
                              image_size=8, augment=False, with_ids=True, seed=1)
    pairs = set()
    for _, labels, ids in batches(ds, 8):
        classes = check_groups(labels, ids, 2)  # 4 classes x 2 images
        first, second = classes[:2], classes[2:]
        s1, s2 = {supers[c] for c in first}, {supers[c] for c in second}
        assert len(s1) == 1 and len(s2) == 1 and s1 != s2  # half from each super-class
        assert len(set(first)) == 2 and len(set(second)) == 2
        pairs.add(frozenset(s1 | s2))
    assert len(pairs) >= 2


def test_all_classes_every_eligible_class_in_every_batch(tmp_path):
    mini.write_split_records(str(tmp_path), {0: 5, 1: 2, 2: 3, 3: 7}, chunk_size=8,
                             size=(12, 10))
    ds = D.make_train_dataset(str(tmp_path), sampler="all_classes", m=3, image_size=8,
                              with_ids=True)
    for _, labels, ids in batches(ds, 4):
        assert labels.tolist() == [0, 0, 0, 2, 2, 2, 3, 3, 3]  # class 1 has 2 < m images
        check_groups(labels, ids, 3)


def test_sampler_arguments_are_checked(split, tmp_path):
    with pytest.raises(ValueError, match="needs 8 classes with >= 4 images, the split has 6"):
        D.make_train_dataset(split, batch_size=32, m=4)
    with pytest.raises(ValueError, match="batch_size must be a multiple of m=4, got 10"):
        D.make_train_dataset(split, batch_size=10, m=4)
    with pytest.raises(ValueError, match="needs super-class labels"):
        D.make_train_dataset(split, sampler="hierarchical", batch_size=8, m=2)
    with pytest.raises(ValueError, match="sampler must be one of"):
        D.make_train_dataset(split, sampler="balanced")
    with pytest.raises(FileNotFoundError, match="no by_class TFRecords"):
        D.make_train_dataset(str(tmp_path), batch_size=8, m=2)


def test_shard_batches_split_every_global_batch_into_whole_classes(split):
    """Ranks drawing with one seed keep their shards: m per class, and the shards in
    rank order are the one-device batch (pixels, augmentation and ids included)."""
    kw = {"batch_size": 12, "m": 2, "image_size": 8, "seed": 3, "with_ids": True,
          "shuffle_buffer": 8}
    whole = batches(D.make_train_dataset(split, **kw), 2)
    shards = [batches(shard_batches(D.make_train_dataset(split, **kw), 2, index), 2)
              for index in range(2)]
    for step, (images, labels, ids) in enumerate(whole):
        parts = [shard[step] for shard in shards]
        for _, part_labels, part_ids in parts:
            assert len(set(check_groups(part_labels, part_ids, 2))) == 3  # 3 classes x m
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), labels)
        assert [i for p in parts for i in p[2]] == ids
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), images)
    # Classes 0, 1, 2 with m = 2: halves of 3 rows would split class 1.
    batch = tf.data.Dataset.from_tensors((tf.zeros([6, 2]), tf.constant([0, 0, 1, 1, 2, 2])))
    np.testing.assert_array_equal(next(iter(shard_batches(batch, 3, 1)))[1], [1, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="a class straddles two"):
        next(iter(shard_batches(batch, 2, 0)))
    with pytest.raises(ValueError, match="index must be an int in \\[0, 3\\), got index=3"):
        shard_batches(batch, 3, 3)


DECODE_AND_AUGMENT = datasets._augment_fn


def counting_augment(monkeypatch, decoded: list):
    """Makes every dataset built next record, in ``decoded``, the global stream position
    of each image it decodes (the decode-and-augment function receives it in its seed)."""
    real = DECODE_AND_AUGMENT

    def make(*args, **kwargs):
        inner = real(*args, **kwargs)

        def fn(encoded, seed):
            seen = tf.py_function(lambda i: decoded.append(int(i)) or 0, [seed[1]], tf.int64)
            with tf.control_dependencies([seen]):
                return inner(encoded, seed)
        return fn

    monkeypatch.setattr(datasets, "_augment_fn", make)


def per_batch(positions, batch, steps):
    return [sum(1 for p in positions if p // batch == k) for k in range(steps)]


def test_each_rank_decodes_only_its_own_shard(split, monkeypatch):
    """4 ranks of a global batch of 8 (4 classes x 2) each decode 2 images per batch,
    the old decode-all route 8; the ranks' shards in order are the one-rank batch,
    pixels, crops and flips included."""
    kw = {"batch_size": 8, "m": 2, "image_size": 8, "seed": 3, "with_ids": True,
          "shuffle_buffer": 8}
    steps, ranks = 2, 4
    whole = batches(D.make_train_dataset(split, **kw), steps)
    decoded = {r: [] for r in range(ranks)}
    shards = []
    for r in range(ranks):
        counting_augment(monkeypatch, decoded[r])
        shards.append(batches(D.make_train_dataset(split, num_shards=ranks, shard_index=r,
                                                   **kw), steps))
    old = []
    counting_augment(monkeypatch, old)
    old_shard = batches(shard_batches(D.make_train_dataset(split, **kw), ranks, 1), steps)
    for r in range(ranks):
        positions = list(decoded[r])  # prefetching may still add later batches' rows
        assert per_batch(positions, 8, steps) == [2] * steps
        assert len(set(positions)) == len(positions)
        assert {p % 8 // 2 for p in positions} == {r}  # its own rows, of any batch
    assert per_batch(list(old), 8, steps) == [8] * steps  # decode all, keep a quarter
    for step, (images, labels, ids) in enumerate(whole):
        parts = [shard[step] for shard in shards]
        for _, part_labels, part_ids in parts:
            assert len(set(check_groups(part_labels, part_ids, 2))) == 1
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), labels)
        assert [i for p in parts for i in p[2]] == ids
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), images)
        np.testing.assert_array_equal(old_shard[step][0], parts[1][0])


def test_shard_arguments_are_checked(split):
    kw = {"batch_size": 8, "m": 2, "image_size": 8}
    with pytest.raises(ValueError, match="num_shards=3 must divide the batch of 8 images"):
        D.make_train_dataset(split, num_shards=3, **kw)
    with pytest.raises(ValueError, match="num_shards=8 would split a class between two"):
        D.make_train_dataset(split, num_shards=8, **kw)
    with pytest.raises(ValueError, match="shard_index must be an int in \\[0, 2\\), got "
                                         "shard_index=2"):
        D.make_train_dataset(split, num_shards=2, shard_index=2, **kw)
    with pytest.raises(ValueError, match="num_shards must be an int >= 1, got num_shards=0"):
        D.make_train_dataset(split, num_shards=0, **kw)
    # Plain shuffling is not class-major: shards of any m, no class check.
    ds = D.make_train_dataset(split, sampler=None, num_shards=8, shard_index=7, **kw)
    images, labels = next(iter(ds))
    assert images.shape == (1, 8, 8, 3) and labels.shape == (1,)
