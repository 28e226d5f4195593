"""models/ layers on every Keras backend (no TensorFlow import): values against numpy
references, gradients through a fit step, frozen BatchNorm, saving.

Runs under the process's KERAS_BACKEND (see tests/backend_support.py).
"""

import keras
import numpy as np

import models
from tests.backend_support import float64_policy, to_numpy


def _images(n, size, seed=0):
    return np.random.default_rng(seed).uniform(0, 255, (n, size, size, 3)).astype("float32")


def test_gem_matches_numpy_and_is_float64_exact_per_row():
    x = np.random.default_rng(1).uniform(0.01, 2.0, (6, 5, 7, 4))
    with float64_policy():
        layer = models.GeM(p=3.0)
        full = to_numpy(layer(x))
        part = to_numpy(layer(x[:2]))
    reference = np.mean(x ** 3.0, axis=(1, 2)) ** (1 / 3.0)
    np.testing.assert_allclose(full, reference, rtol=1e-13)
    # A row's value does not depend on the rest of the batch (multi-stage needs it).
    np.testing.assert_array_equal(part, full[:2])
    np.testing.assert_allclose(to_numpy(models.GeM(p=1.0)(x.astype("float32"))),
                               x.mean(axis=(1, 2)), rtol=1e-5)


def test_gem_p_gradient_through_a_training_step_matches_finite_differences():
    x = np.random.default_rng(3).uniform(0.1, 1.0, (2, 3, 3, 2))
    with float64_policy():
        inputs = keras.Input((3, 3, 2))
        model = keras.Model(inputs, models.GeM(p=3.0, name="gem")(inputs))
        # loss = mean over the batch of sum over channels; SGD(lr=1): p1 = p0 - dL/dp.
        model.compile(optimizer=keras.optimizers.SGD(1.0),
                      loss=lambda y_true, y_pred: keras.ops.sum(y_pred, axis=-1))
        model.fit(x, np.zeros(2), batch_size=2, epochs=1, verbose=0)
        p = float(to_numpy(model.get_layer("gem").p))

    def f(q):
        return np.mean(np.sum(np.mean(x ** q, axis=(1, 2)) ** (1 / q), axis=-1))

    numeric = (f(3.0 + 1e-5) - f(3.0 - 1e-5)) / 2e-5
    assert abs(numeric) > 1e-3
    np.testing.assert_allclose(3.0 - p, numeric, rtol=1e-6)


def test_l2_normalize_and_preprocessing_references():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], "float32")
    np.testing.assert_allclose(to_numpy(models.L2Normalize()(x)), [[0.6, 0.8], [0, 0]],
                               atol=1e-7)
    images = _images(2, 4, seed=4)
    caffe = to_numpy(models.ImageNetNormalization("caffe")(images))
    np.testing.assert_allclose(caffe, images[..., ::-1] - [103.939, 116.779, 123.68],
                               atol=1e-4)
    torch_mode = to_numpy(models.ImageNetNormalization("torch")(images))
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(torch_mode, (images / 255.0 - mean) / std, atol=1e-5)


def test_whitening_matches_numpy_reference():
    rng = np.random.default_rng(8)
    train = rng.normal(size=(200, 6)) @ rng.normal(size=(6, 6)) + 1.0
    layer = models.fit_pca_whitening(train, power=0.5, l2_normalize=False)
    y = to_numpy(layer(train.astype("float32"))).astype(np.float64)
    np.testing.assert_allclose(np.cov(y, rowvar=False), np.eye(6), atol=1e-4)


def test_frozen_batch_norm_is_deterministic_and_trains_only_gamma_beta():
    images = _images(4, 8, seed=5)
    model = models.build_embedding_model("small_cnn", embedding_dim=8, freeze_bn=True,
                                         input_shape=(8, 8, 3),
                                         backbone_kwargs={"widths": (4, 8)})
    assert not models.has_training_batch_norm(model)
    np.testing.assert_allclose(to_numpy(model(images, training=True)),
                               to_numpy(model(images, training=False)), atol=1e-6)
    bns = [layer for layer in model._flatten_layers(recursive=True)
           if isinstance(layer, models.FrozenBatchNormalization)]
    assert len(bns) == 4
    before = {v.path: to_numpy(v).copy() for bn in bns for v in bn.weights}
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    targets = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    model.fit(images, targets, batch_size=4, epochs=1, verbose=0)
    for bn in bns:
        for v in bn.weights:
            changed = np.abs(to_numpy(v) - before[v.path]).max() > 0
            assert changed == v.trainable, v.path

    unfrozen = models.build_embedding_model("small_cnn", embedding_dim=8,
                                            input_shape=(8, 8, 3))
    assert models.has_training_batch_norm(unfrozen)


def test_embedding_model_round_trip(tmp_path):
    model = models.build_embedding_model("small_cnn", pooling="gem", embedding_dim=16,
                                         freeze_bn=True, input_shape=(16, 16, 3))
    model.get_layer("gem").p.assign(4.5)
    images = _images(3, 16, seed=7)
    before = to_numpy(model.predict(images, verbose=0))
    np.testing.assert_allclose(np.linalg.norm(before, axis=-1), 1.0, atol=1e-5)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(to_numpy(loaded.predict(images, verbose=0)), before)
    assert not models.has_training_batch_norm(loaded)


def test_mixed_bfloat16_model_outputs_float32_unit_norm():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = models.build_embedding_model("small_cnn", pooling="gem", embedding_dim=8,
                                             input_shape=(16, 16, 3))
        assert model.get_layer("head").compute_dtype == "bfloat16"
        y = model(_images(2, 16), training=False)
    finally:
        keras.config.set_dtype_policy("float32")
    assert keras.backend.standardize_dtype(y.dtype) == "float32"
    np.testing.assert_allclose(np.linalg.norm(to_numpy(y), axis=-1), 1.0, atol=1e-5)


def test_lr_multiplier_head_moves_k_times_with_sgd():
    def deltas(optimizer):
        keras.utils.set_random_seed(0)
        model = models.build_embedding_model("small_cnn", pooling="gem", embedding_dim=8,
                                             freeze_bn=True, input_shape=(8, 8, 3),
                                             backbone_kwargs={"widths": (4, 8)})
        before = {v.path: to_numpy(v).copy() for v in model.trainable_variables}
        model.compile(optimizer=optimizer,
                      loss=lambda y_true, y_pred: keras.ops.sum(y_pred[:, :3], axis=-1))
        model.fit(_images(4, 8), np.zeros(4, "float32"), batch_size=4, verbose=0)
        return {v.path: to_numpy(v) - before[v.path] for v in model.trainable_variables}

    plain = deltas(keras.optimizers.SGD(0.05))
    scaled = deltas(models.LRMultiplierOptimizer(keras.optimizers.SGD(0.05),
                                                 models.head_multipliers(4.0)))
    assert any(p.startswith("head/") for p in plain)
    for path, delta in plain.items():
        factor = 4.0 if path.startswith("head/") else 1.0
        assert np.abs(delta).max() > 0
        np.testing.assert_allclose(scaled[path], factor * delta, rtol=1e-4, atol=1e-7)
