"""load_split, make_train_dataset (augmentation, normalisation) and make_eval_dataset."""

import numpy as np
import pytest

import tfaploss.data as D
from tests.support import miniature as mini


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("data_split"))
    mini.write_split_records(d, {0: 3, 1: 4, 2: 2}, chunk_size=8, size=(40, 30))
    return d


def test_load_split_decodes_raw_pixels(split):
    rows = list(D.load_split(split).as_numpy_iterator())
    assert [r["id"].decode() for r in rows] == ["0/0", "0/1", "0/2", "1/0", "1/1", "1/2",
                                                "1/3", "2/0", "2/1"]
    assert [r["index"] for r in rows] == list(range(9))
    for r in rows:
        assert r["image"].shape == (30, 40, 3) and r["image"].dtype == np.uint8
        assert (r["height"], r["width"]) == (30, 40)
        np.testing.assert_allclose(r["image"][15, 20], mini.class_colour(r["label"]), atol=6)


def test_eval_dataset_order_ids_and_centre_crop(split):
    batches = list(D.make_eval_dataset(split, image_size=16, batch_size=4))
    assert [b[0].shape[0] for b in batches] == [4, 4, 1]
    labels = np.concatenate([b[1].numpy() for b in batches])
    ids = [i.decode() for b in batches for i in b[2].numpy()]
    assert labels.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert ids[3] == "1/0"
    images = batches[0][0].numpy()
    assert images.shape == (4, 16, 16, 3) and images.dtype == np.float32
    assert 0.0 <= images.min() and images.max() <= 255.0
    np.testing.assert_allclose(images[0, 8, 8], mini.class_colour(0), atol=6)
    full = next(iter(D.make_eval_dataset(split, image_size=None, batch_size=1)))
    assert full[0].shape == (1, 30, 40, 3)
    with pytest.raises(ValueError, match="batch_size must be 1, got 4"):
        D.make_eval_dataset(split, image_size=None, batch_size=4)


def test_imagenet_normalisation_is_opt_in(split):
    kw = {"sampler": "m_per_class", "batch_size": 4, "m": 2, "image_size": 16, "seed": 2}
    raw = next(iter(D.make_train_dataset(split, **kw)))[0].numpy()
    norm = next(iter(D.make_train_dataset(split, normalize="imagenet", **kw)))[0].numpy()
    assert raw.min() >= 0.0 and raw.max() <= 255.0 and raw.max() > 30.0
    want = (raw / 255.0 - np.array(D.IMAGENET_MEAN)) / np.array(D.IMAGENET_STD)
    np.testing.assert_allclose(norm, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="normalize must be None or 'imagenet', got 'torch'"):
        D.make_train_dataset(split, normalize="torch")


def test_random_resized_crop_covers_scale_and_flips(split):
    import tensorflow as tf

    # a left-dark/right-bright JPEG: crops differ, flips swap the sides
    img = np.zeros((60, 80, 3), np.uint8)
    img[:, 40:] = 250
    encoded = tf.io.encode_jpeg(img, quality=95)
    outs = [D.random_resized_crop(encoded, 16, tf.constant([s, 1], tf.int64), scale=(0.5, 1.0))
            for s in range(12)]
    assert all(o.shape == (16, 16, 3) and o.dtype == tf.float32 for o in outs)
    assert len({float(o.numpy().mean()) for o in outs}) > 3
    flipped = tf.image.stateless_random_flip_left_right(outs[0], tf.constant([0, 0], tf.int64))
    assert flipped.shape == (16, 16, 3)


def test_plain_shuffled_batches_without_sampler(split):
    ds = D.make_train_dataset(split, sampler=None, batch_size=5, image_size=8, seed=0,
                              with_ids=True)
    seen = []
    for images, labels, ids in ds.take(9):  # 45 images = 5 epochs of 9
        assert images.shape == (5, 8, 8, 3)
        seen.extend(i.decode() for i in ids.numpy())
        assert all(int(i.decode().split("/")[0]) == label
                   for i, label in zip(ids.numpy(), labels.numpy()))
    assert sorted(set(seen)) == sorted(f"{k}/{n}" for k, c in ((0, 3), (1, 4), (2, 2))
                                       for n in range(c))


def test_the_lazily_loaded_names_are_the_public_ones():
    """tfaploss.data loads each public name from its module on first use: the table of
    homes and the literal __all__ (for static tools) name the same set, and each home
    defines its name."""
    import importlib

    from tfaploss import data

    assert set(data._HOME) == set(data.__all__)
    for name, home in data._HOME.items():
        assert hasattr(importlib.import_module(f"tfaploss.data.{home}"), name), name
