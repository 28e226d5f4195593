"""The horizontal flip is its own option (issue 14, item 5): off when asked, on by
default after random_resized_crop (the papers' recipes), never silently."""

import numpy as np
import pytest
from PIL import Image

import tfaploss.data as D
from tests import miniature as mini
from tfaploss.config import build as B
from tfaploss.config.schema import ConfigError, config_from_dict


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
