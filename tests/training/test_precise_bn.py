"""BatchNorm for networks trained from scratch: automatic freeze_bn and precise BN."""

import keras
import numpy as np
import pytest

from tfaploss.config import ConfigError, config_from_dict
from tfaploss.models.batch_norm import freeze_batch_norm
from tfaploss.run.build import estimate_batch_norm_statistics

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(4, name="dense")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    y = keras.layers.Dense(3, name="dense2")(x)
    y = keras.layers.BatchNormalization(name="bn2")(y)
    return keras.Model(inputs, y)


def test_precise_bn_sets_the_mean_of_the_batch_statistics():
    model = _model()
    rng = np.random.default_rng(0)
    batches = [rng.normal(loc=k, size=(8, 6)).astype("float32") for k in range(3)]
    model.get_layer("bn").moving_mean.assign(np.full(4, 100.0, "float32"))
    assert estimate_batch_norm_statistics(model, iter(batches)) == 2

    dense = keras.Model(model.input, model.get_layer("dense").output)
    pre = [np.asarray(dense(b)) for b in batches]
    bn = model.get_layer("bn")
    np.testing.assert_allclose(bn.moving_mean, np.mean([p.mean(0) for p in pre], 0),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bn.moving_variance, np.mean([p.var(0) for p in pre], 0),
                               rtol=1e-4, atol=1e-5)
    assert bn.momentum == pytest.approx(0.99)  # restored


def test_precise_bn_leaves_frozen_layers_alone():
    model = freeze_batch_norm(_model())
    before = keras.ops.convert_to_numpy(model.get_layer("bn").moving_mean)
    assert estimate_batch_norm_statistics(model, iter([np.ones((4, 6), "float32")])) == 0
    np.testing.assert_array_equal(model.get_layer("bn").moving_mean, before)


def _cfg(**model):
    return config_from_dict({"model": {"backbone": "small_cnn", **model}}, warn=False)


@pytest.mark.parametrize("model, frozen", [
    ({"weights": None}, False),                       # from scratch: batch statistics
    ({"weights": "backbone.weights.h5"}, True),       # pretrained: the papers' frozen BN
    ({"weights": None, "bn_calibration_images": 64}, True),
    ({"weights": None, "freeze_bn": True}, True),
    ({"weights": "backbone.weights.h5", "freeze_bn": False}, False),
])
def test_freeze_bn_default_depends_on_the_weights(model, frozen):
    assert _cfg(**model).model.frozen_bn is frozen


def test_bad_precise_bn_images_is_refused():
    with pytest.raises(ConfigError, match="precise_bn_images.*-1"):
        _cfg(precise_bn_images=-1)
    with pytest.raises(ConfigError, match="bn_calibration_images"):
        _cfg(freeze_bn=False, bn_calibration_images=8)


@pytest.mark.parametrize("split_images, asked, expected", [
    (10, 4096, 12),   # one pass over a small split, rounded up to whole groups of 4
    (10, 8, 8),       # fewer asked than the split holds: what was asked
    (400, 4096, 400),
])
def test_precise_bn_reads_at_most_one_pass_over_the_split(tmp_path, monkeypatch,
                                                          split_images, asked, expected):
    from tests.support import miniature as mini
    from tfaploss.run import build

    mini.write_split_records(str(tmp_path / "train"), {0: split_images // 2,
                                                       1: split_images - split_images // 2},
                             size=(8, 8))
    cfg = config_from_dict({
        "data": {"train": str(tmp_path / "train"), "batch_size": 4, "m": 2,
                 "image_size": 8, "augmentation": {"crop": "center_crop"}},
        "model": {"backbone": "small_cnn", "weights": None, "precise_bn_images": asked}},
        warn=False)
    seen = []
    monkeypatch.setattr(build, "estimate_batch_norm_statistics",
                        lambda model, groups: seen.extend(int(g.shape[0]) for g in groups))
    build.precise_batch_norm(None, cfg)
    assert sum(seen) == expected and set(seen) <= {4}
