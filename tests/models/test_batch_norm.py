"""freeze_batch_norm: moving statistics always, gamma/beta still trained."""

import keras
import numpy as np
import pytest

from tests.support.exactness import build_exactness_model, make_batch
from tfaploss.training import (
    FrozenBatchNormalization,
    freeze_batch_norm,
    has_training_batch_norm,
)

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only


def test_frozen_output_is_the_same_in_training_and_inference_mode():
    images, _ = make_batch(12)
    unfrozen = build_exactness_model(freeze=False)
    # Sanity: with batch statistics the two modes differ, so the check below can fail.
    gap = unfrozen(images, training=True).numpy() - unfrozen(images, training=False).numpy()
    assert np.max(np.abs(gap)) > 1e-3
    frozen = freeze_batch_norm(build_exactness_model(freeze=False))
    np.testing.assert_array_equal(frozen(images, training=True).numpy(),
                                  frozen(images, training=False).numpy())
    # And a row's embedding does not depend on the rest of the batch.
    np.testing.assert_allclose(frozen(images[:3], training=True).numpy(),
                               frozen(images, training=True).numpy()[:3], rtol=1e-6, atol=1e-7)


def test_gamma_beta_train_and_moving_statistics_stay():
    images, _ = make_batch(12)
    model = build_exactness_model()
    bn = model.get_layer("bn")
    assert isinstance(bn, FrozenBatchNormalization)
    assert [w.path.split("/")[-1] for w in bn.trainable_weights] == ["gamma", "beta"]
    before = {w.path: w.numpy().copy() for w in bn.weights}
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse", run_eagerly=True)
    targets = np.random.default_rng(0).normal(size=(12, 5)).astype("float32")
    model.fit(images, targets, batch_size=6, epochs=2, verbose=0)
    for w in bn.weights:
        changed = np.max(np.abs(w.numpy() - before[w.path])) > 1e-5
        assert changed == w.trainable, w.path


def test_has_training_batch_norm():
    assert has_training_batch_norm(build_exactness_model(freeze=False))
    assert not has_training_batch_norm(build_exactness_model(freeze=True))
    model = build_exactness_model(freeze=False)
    model.get_layer("bn").trainable = False  # Keras 3: inference mode, gamma/beta frozen
    assert not has_training_batch_norm(model)


def test_freeze_reaches_nested_models():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.BatchNormalization()], name="inner")
    inputs = keras.Input((4,))
    outer = keras.Model(inputs, keras.layers.BatchNormalization()(inner(inputs)))
    freeze_batch_norm(outer)
    assert outer._tfaploss_frozen_bn_count == 2
    assert not has_training_batch_norm(outer)


def test_frozen_batch_norm_survives_save_and_load(tmp_path):
    images, _ = make_batch(12)
    model = build_exactness_model()
    path = tmp_path / "frozen.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.get_layer("bn"), FrozenBatchNormalization)
    np.testing.assert_array_equal(loaded(images, training=True).numpy(),
                                  model(images, training=True).numpy())
    np.testing.assert_array_equal(loaded(images, training=True).numpy(),
                                  loaded(images, training=False).numpy())
