"""The horizontal flip is its own option: off when asked, on by
default after random_resized_crop (the papers' recipes), never silently."""

import numpy as np
import pytest
from PIL import Image

import tfaploss.data as D
from tests.support import miniature as mini
from tfaploss.config import ConfigError, config_from_dict
from tfaploss.run import build as B


def _ramp(label, size):
    """Dark on the left, bright on the right: any crop keeps that order, a flip swaps it."""
    w, h = size
    row = np.linspace(0, 255, w).astype(np.uint8)
    return Image.fromarray(np.repeat(np.repeat(row[None, :, None], h, 0), 3, 2))


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ramp_split"))
    mini.write_split_records(d, {0: 4, 1: 4}, size=(48, 36), image_fn=_ramp)
    return d


def _mirrored(images):
    """Per image: True when its left edge is brighter than its right edge (a flip)."""
    left = images[:, :, :4].mean(axis=(1, 2, 3))
    right = images[:, :, -4:].mean(axis=(1, 2, 3))
    assert np.all(np.abs(left - right) > 50), "every crop of the ramp has a clear side"
    return left > right


def _batch(split, **kw):
    kw = {"sampler": "m_per_class", "batch_size": 8, "m": 4, "image_size": 16, "seed": 3,
          "crop_scale": (0.5, 1.0), **kw}
    ds = D.make_train_dataset(split, **kw)
    return np.concatenate([x.numpy() for x, _ in ds.take(4)])


def test_flip_false_gives_the_unflipped_crops(split):
    default = _batch(split)
    unflipped = _batch(split, flip=False)
    flipped = _mirrored(default)
    # The default recipe flips about half the crops; flip=False none of them.
    assert 0 < flipped.sum() < len(flipped)
    assert not _mirrored(unflipped).any()
    # Same seed, same crops: flip=False equals the default's unflipped images pixel for
    # pixel, and the mirror of the ones the default flipped.
    np.testing.assert_array_equal(unflipped[~flipped], default[~flipped])
    np.testing.assert_array_equal(unflipped[flipped], default[flipped][:, :, ::-1])


def test_flip_after_center_crop_only_when_asked(split):
    plain = _batch(split, augment=False)
    assert not _mirrored(plain).any()
    flipped = _mirrored(_batch(split, augment=False, flip=True))
    assert 0 < flipped.sum() < len(flipped)


def test_config_key_reaches_the_dataset(split):
    def images(flip):
        aug = {"crop": "random_resized_crop", "scale": [0.5, 1.0]}
        if flip is not None:
            aug["flip"] = flip
        cfg = config_from_dict({"data": {"train": split, "batch_size": 8, "m": 4,
                                         "image_size": 16, "seed": 3, "augmentation": aug}})
        ds = B.build_train_dataset(cfg)
        return np.concatenate([x.numpy() for x, _ in ds.take(4)])

    assert _mirrored(images(None)).any()      # the papers' default: flip
    assert not _mirrored(images(False)).any()
    with pytest.raises(ConfigError, match="data.augmentation.flip"):
        config_from_dict({"data": {"augmentation": {"flip": "sometimes"}}})


def test_a_shrinking_crop_is_antialiased_and_an_enlarging_one_bilinear():
    import tensorflow as tf

    from tfaploss.data import augment as A

    # 1-pixel black/white columns shrunk 64 -> 15: an antialiased resize gives near-flat
    # grey (as TF's antialiased bilinear filter does); point sampling (bilinear without
    # antialiasing) gives stripes from 8 to 246.
    stripes = np.zeros((64, 64, 3), np.uint8)
    stripes[:, 1::2] = 255
    small = A._resize(tf.constant(stripes), 15, shrinks=tf.constant(True)).numpy()
    np.testing.assert_allclose(small, 127.5, atol=10)
    aliased = tf.image.resize(stripes, [15, 15], method="bilinear").numpy()
    assert aliased.min() < 20 and aliased.max() > 235
    # smooth content: within a grey level or two of TF's antialiased bilinear filter
    ramp = np.asarray(_ramp(0, (96, 96)))
    ours = A._resize(tf.constant(ramp), 24, shrinks=tf.constant(True)).numpy()
    theirs = tf.image.resize(ramp, [24, 24], antialias=True).numpy()
    assert np.abs(ours - theirs).mean() < 2.0
    # enlarging: plain bilinear, exactly
    tiny = ramp[::8, ::8]
    np.testing.assert_array_equal(
        A._resize(tf.constant(tiny), 24, shrinks=tf.constant(False)).numpy(),
        tf.image.resize(tiny, [24, 24], method="bilinear").numpy())
