"""tfaploss/models/ layers on every Keras backend (no TensorFlow import): values against numpy
references, gradients through a fit step, frozen BatchNorm, saving.

Runs under the process's KERAS_BACKEND (see tests/support/backend.py).

The tests marked ``tensorflow`` use TensorFlow APIs and run in the TensorFlow run only:
Tests of models/: architectures, GeM, preprocessing, whitening, saving, weights.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support.backend import float64_policy, to_numpy
from tfaploss import models
from tfaploss.models.backbones import IMAGENET_NOTOP_FILES, KERAS_WEIGHTS_BASE_URL
from tfaploss.training import FrozenBatchNormalization, has_training_batch_norm


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


# --------------------------------------------------------------------------------------
# TensorFlow only
# --------------------------------------------------------------------------------------

def _images_tf(n, size, seed=0):
    return np.random.default_rng(seed).uniform(0, 255, (n, size, size, 3)).astype("float32")


def _assert_unit_norm(y):
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), 1.0, atol=1e-5)


@pytest.mark.tensorflow
@pytest.mark.parametrize("pooling", ["gem", "avg", "max_ln"])
def test_small_cnn_each_pooling_gives_unit_norm_embeddings(pooling):
    model = models.build_embedding_model("small_cnn", pooling=pooling, embedding_dim=16,
                                         input_shape=(32, 32, 3))
    y = model(_images_tf(3, 32), training=False)
    assert tuple(y.shape) == (3, 16)
    assert y.dtype == "float32"
    _assert_unit_norm(y.numpy())
    # Different images give different embeddings (the model is not degenerate).
    assert np.abs(y.numpy()[0] - y.numpy()[1]).max() > 1e-4


@pytest.mark.tensorflow
def test_identity_head_keeps_backbone_channels_and_any_input_size():
    model = models.build_embedding_model("small_cnn", pooling="avg", head="identity",
                                         embedding_dim=None, input_shape=(None, None, 3))
    assert not any(layer.name == "head" for layer in model.layers)
    for size in (8, 20):
        y = model(_images_tf(2, size), training=False).numpy()
        assert y.shape == (2, 128)
        _assert_unit_norm(y)
    with pytest.raises(ValueError, match="embedding_dim=64"):
        models.build_embedding_model("small_cnn", head="identity", embedding_dim=64,
                                     input_shape=(32, 32, 3))


@pytest.mark.tensorflow
@pytest.mark.parametrize(
    "paper, backbone, pooling, dim",
    [("revaud", "resnet101", "gem", 2048), ("roadmap_cub", "resnet50", "max_ln", 512)],
)
def test_paper_resnet_architectures(paper, backbone, pooling, dim):
    model = models.build_paper_model(paper, input_shape=(64, 64, 3))
    assert model.get_layer(backbone).output_shape[-1] == 2048
    head = model.get_layer("head")
    assert head.units == dim and head.use_bias
    names = [layer.name for layer in model.layers]
    assert {"gem": "gem", "max_ln": "max_ln"}[pooling] in names
    # Keras's ResNet ImageNet weights expect caffe-style inputs.
    assert model.get_layer("normalization").mode == "caffe"
    y = model(_images_tf(1, 64), training=False).numpy()
    assert y.shape == (1, dim)
    _assert_unit_norm(y)


@pytest.mark.tensorflow
def test_head_without_bias():
    model = models.build_embedding_model("small_cnn", pooling="avg", embedding_dim=32,
                                         head_bias=False, input_shape=(16, 16, 3))
    assert model.get_layer("head").bias is None
    assert len(model.get_layer("head").weights) == 1
    _assert_unit_norm(model(_images_tf(2, 16), training=False).numpy())


@pytest.mark.tensorflow
def test_invalid_arguments_are_named():
    with pytest.raises(ValueError, match="backbone='vgg16'"):
        models.build_embedding_model("vgg16")
    with pytest.raises(ValueError, match="pooling='sum'"):
        models.build_embedding_model("small_cnn", pooling="sum", input_shape=(32, 32, 3))
    with pytest.raises(ValueError, match="preprocessing='inception'"):
        models.build_embedding_model("small_cnn", preprocessing="inception",
                                     input_shape=(32, 32, 3))
    with pytest.raises(ValueError, match="input_shape"):
        models.build_embedding_model("small_cnn", input_shape=(32, 32, 1))


# --- GeM ---------------------------------------------------------------------------

@pytest.mark.tensorflow
def test_gem_p1_equals_average_pooling():
    x = np.random.default_rng(1).uniform(0.01, 2.0, (3, 5, 7, 4)).astype("float32")
    gem = models.GeM(p=1.0)(x).numpy()
    avg = keras.layers.GlobalAveragePooling2D()(x).numpy()
    np.testing.assert_allclose(gem, avg, rtol=1e-5)


@pytest.mark.tensorflow
def test_gem_tends_to_max_pooling_for_large_p():
    x = np.random.default_rng(2).uniform(0.1, 1.0, (2, 4, 4, 3)).astype("float32")
    mx = x.max(axis=(1, 2))
    errors = []
    for p in (3.0, 10.0, 30.0, 100.0):
        gem = models.GeM(p=p)(x).numpy()
        # (mean x^p)^(1/p) lies between max * n^(-1/p) and max (n = 16 positions).
        assert np.all(gem <= mx * (1 + 1e-5))
        assert np.all(gem >= mx * 16 ** (-1 / p) * (1 - 1e-5))
        errors.append(np.abs(gem - mx).max())
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.03 * mx.max()


@pytest.mark.tensorflow
def test_gem_p_is_learned_and_gets_a_gradient():
    layer = models.GeM(p=3.0)
    x = tf.constant(np.random.default_rng(3).uniform(0.1, 1.0, (2, 3, 3, 2)), tf.float32)
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(layer(x))
    (grad,) = tape.gradient(y, [layer.p])
    # d/dp (mean x^p)^(1/p) by central finite differences, in float64.
    xs = x.numpy().astype(np.float64)

    def f(p):
        return np.sum(np.mean(xs ** p, axis=(1, 2)) ** (1 / p))

    numeric = (f(3.0 + 1e-4) - f(3.0 - 1e-4)) / 2e-4
    np.testing.assert_allclose(grad.numpy(), numeric, rtol=1e-3)
    assert layer.p.trainable and not models.GeM(p=3.0, trainable_p=False).trainable_p
    with pytest.raises(ValueError, match="p=0"):
        models.GeM(p=0)


# --- preprocessing -------------------------------------------------------------------

@pytest.mark.tensorflow
def test_preprocessing_modes_match_references():
    x = _images_tf(2, 4, seed=4)
    caffe = models.ImageNetNormalization("caffe")(x).numpy()
    ref = keras.applications.resnet.preprocess_input(x.copy())
    np.testing.assert_allclose(caffe, ref, atol=1e-4)
    torch = models.ImageNetNormalization("torch")(x).numpy()
    mean = np.array([0.485, 0.456, 0.406])
    std = np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(torch, (x / 255.0 - mean) / std, atol=1e-5)


@pytest.mark.tensorflow
def test_preprocessing_default_and_off():
    small = models.build_embedding_model("small_cnn", input_shape=(32, 32, 3))
    assert small.get_layer("normalization").mode == "torch"
    plain = models.build_embedding_model("small_cnn", preprocessing=None,
                                         input_shape=(32, 32, 3))
    assert "normalization" not in [layer.name for layer in plain.layers]


# --- frozen BatchNorm --------------------------------------------------------------

@pytest.mark.tensorflow
def test_freeze_bn_makes_training_mode_deterministic():
    x = _images_tf(4, 16, seed=5)
    frozen = models.build_embedding_model("small_cnn", embedding_dim=8, freeze_bn=True,
                                          input_shape=(16, 16, 3))
    assert not has_training_batch_norm(frozen)
    assert any(isinstance(layer, FrozenBatchNormalization)
               for layer in frozen._flatten_layers(recursive=True))
    np.testing.assert_allclose(frozen(x, training=True), frozen(x, training=False), atol=1e-6)
    # gamma/beta stay trainable.
    assert any("bn/gamma" in v.path for v in frozen.trainable_variables)

    plain = models.build_embedding_model("small_cnn", embedding_dim=8, input_shape=(16, 16, 3))
    assert has_training_batch_norm(plain)
    diff = np.abs(plain(x, training=True) - plain(x, training=False)).max()
    assert diff > 1e-3


# --- saving ----------------------------------------------------------------------------

@pytest.mark.tensorflow
def test_keras_round_trip_gives_identical_outputs(tmp_path):
    model = models.build_embedding_model("small_cnn", pooling="gem", embedding_dim=16,
                                         freeze_bn=True, input_shape=(32, 32, 3))
    # Move the weights away from their initial values so the check can fail.
    model.get_layer("gem").p.assign(4.5)
    model.get_layer("head").bias.assign(np.linspace(-1, 1, 16).astype("float32"))
    whitening = models.fit_pca_whitening(model.predict(_images_tf(40, 32, seed=6), verbose=0),
                                         dim=12)
    whitened = models.with_whitening(model, whitening)
    x = _images_tf(3, 32, seed=7)
    before = whitened.predict(x, verbose=0)
    path = tmp_path / "model.keras"
    whitened.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), before)
    assert before.shape == (3, 12)
    inner = loaded.layers[1]
    assert float(inner.get_layer("gem").p.numpy()) == 4.5
    assert not has_training_batch_norm(loaded)


# --- weights -----------------------------------------------------------------------------

@pytest.mark.tensorflow
def test_imagenet_weights_missing_from_cache_says_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        models.build_embedding_model("resnet50", weights="imagenet")
    message = str(info.value)
    file_name = IMAGENET_NOTOP_FILES["resnet50"]
    assert file_name in message
    assert KERAS_WEIGHTS_BASE_URL + file_name in message
    assert "weights=" in message and str(tmp_path) in message


@pytest.mark.tensorflow
def test_weights_from_a_local_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        models.build_embedding_model("small_cnn", weights=str(tmp_path / "missing.h5"))
    source = models.build_backbone("small_cnn", input_shape=(16, 16, 3))
    for v in source.trainable_variables:
        v.assign(v + 0.5)
    path = str(tmp_path / "backbone.weights.h5")
    source.save_weights(path)
    model = models.build_embedding_model("small_cnn", weights=path, input_shape=(16, 16, 3))
    for a, b in zip(model.get_layer("small_cnn").weights, source.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# --- whitening -------------------------------------------------------------------------

def _l2(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.tensorflow
def test_whitening_matches_numpy_reference_on_tensorflow():
    rng = np.random.default_rng(8)
    train = _l2(rng.normal(size=(200, 16)) @ rng.normal(size=(16, 16)))
    test = _l2(rng.normal(size=(10, 16)))
    layer = models.fit_pca_whitening(train, power=0.25, dim=10)
    got = layer(test.astype("float32")).numpy()

    # Reference by SVD of the centred data: eigenvalues = s^2 / (N - 1).
    mean = train.mean(axis=0)
    _, s, vt = np.linalg.svd(train - mean, full_matrices=False)
    lam = s[:10] ** 2 / (len(train) - 1)
    ref = _l2((test - mean) @ vt[:10].T / lam ** 0.25)
    # Eigenvectors are defined up to sign: compare sign-invariant quantities.
    np.testing.assert_allclose(np.abs(got), np.abs(ref), atol=1e-5)
    np.testing.assert_allclose(got @ got.T, ref @ ref.T, atol=1e-5)
    np.testing.assert_allclose(np.abs(layer.projection.numpy()),
                               np.abs(vt[:10].T / lam ** 0.25), rtol=1e-4)
    np.testing.assert_allclose(layer.mean.numpy(), mean, atol=1e-6)


@pytest.mark.tensorflow
def test_full_whitening_gives_identity_covariance():
    rng = np.random.default_rng(9)
    train = rng.normal(size=(500, 6)) @ rng.normal(size=(6, 6)) + 3.0
    layer = models.fit_pca_whitening(train, power=0.5, l2_normalize=False)
    y = layer(train.astype("float32")).numpy().astype(np.float64)
    np.testing.assert_allclose(np.cov(y, rowvar=False), np.eye(6), atol=1e-4)
    with pytest.raises(ValueError, match="dim=7"):
        models.fit_pca_whitening(train, dim=7)


@pytest.mark.tensorflow
def test_mixed_precision_model_outputs_float32_unit_norm():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = models.build_embedding_model("small_cnn", pooling="gem", embedding_dim=8,
                                             input_shape=(16, 16, 3))
        assert model.get_layer("head").compute_dtype == "float16"
        # Large activations: x^3 would overflow float16 inside GeM.
        feats = np.full((1, 2, 2, 4), 60.0, "float16")
        assert np.isfinite(models.GeM(p=3.0, dtype="mixed_float16")(feats).numpy()).all()
        y = model(_images_tf(2, 16), training=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert y.dtype == "float32"
    _assert_unit_norm(y.numpy())
