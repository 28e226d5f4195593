"""Backbones from keras-hub presets and from a user's Keras model file, with no download:
tiny keras-hub architectures saved as local presets (``tests/support/hub.py``).

Keras only (no TensorFlow API), so these run on every backend.
"""

from __future__ import annotations

import math
import sys

import keras
import numpy as np
import pytest

from tests.support.backend import to_numpy
from tests.support.hub import keras_hub, tiny_preset
from tfaploss import models
from tfaploss.models.batch_norm import FrozenBatchNormalization

# The architectures train one step on every backend (above); what does not depend on the
# backend (multi-stage, saving, model files, config) runs once, in the TensorFlow run.
once = pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                          reason="backend-independent: checked in the TensorFlow run")

# ImageNet mean/std as a converter's per-channel scale and offset (the ResNet presets').
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TORCH_SCALE = [1 / (255 * s) for s in STD]
TORCH_OFFSET = [-m / s for m, s in zip(MEAN, STD)]


def _images(n, size, seed=0):
    return np.random.default_rng(seed).uniform(0, 255, (n, size, size, 3)).astype("float32")


def _labels(n):
    return np.repeat(np.arange(n // 2), 2).astype("int32")


def _frozen(model):
    return [layer for layer in model._flatten_layers(include_self=True, recursive=True)
            if isinstance(layer, FrozenBatchNormalization)]


def _fit_one_batch(model, images, labels, chunk_size=None):
    """One optimizer step on one batch; returns (loss, largest weight change)."""
    import tfaploss.losses
    from tfaploss.training import MultiStageModel

    before = [to_numpy(w).copy() for w in model.trainable_weights]
    trainer = model if chunk_size is None else MultiStageModel(model, chunk_size=chunk_size)
    trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss=tfaploss.losses.SmoothAPLoss())
    logs = trainer.fit(images, labels, batch_size=len(images), epochs=1, shuffle=False,
                       verbose=0).history
    change = max(float(np.abs(to_numpy(w) - b).max())
                 for w, b in zip(model.trainable_weights, before))
    return logs["loss"][0], change


def test_missing_keras_hub_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # import keras_hub -> ImportError
    with pytest.raises(ImportError) as info:
        models.build_embedding_model("keras_hub:resnet_50_imagenet")
    message = str(info.value)
    assert 'pip install "tfaploss[hub]"' in message and "\n" not in message

    # From a config: a config error (the CLI's one line, exit 2) before any training.
    from tfaploss.config import ConfigError, config_from_dict
    from tfaploss.run import build as B

    cfg = config_from_dict({"model": {"backbone": "keras_hub:resnet_50_imagenet",
                                      "weights": "preset"}})
    with pytest.raises(ConfigError, match=r"'model.backbone'.*tfaploss\[hub\]"):
        B.build_model(cfg)


def test_resnet_preset_trains_one_step_with_gem_and_frozen_batch_norm(tmp_path):
    preset = tiny_preset(tmp_path / "resnet", "ResNetBackbone",
                         converter=(TORCH_SCALE, TORCH_OFFSET))
    saved = keras_hub().models.Backbone.from_preset(str(preset))
    model = models.build_embedding_model(f"keras_hub:{preset}", pooling="gem",
                                         embedding_dim=8, weights="preset",
                                         input_shape=(32, 32, 3), freeze_bn=True)
    # The preset's weights, its converter's normalisation, BatchNorm frozen.
    backbone = model.get_layer("resnet")
    np.testing.assert_array_equal(to_numpy(backbone.weights[0]), to_numpy(saved.weights[0]))
    normalization = model.get_layer("normalization")
    assert isinstance(normalization, models.ImageRescaling)
    np.testing.assert_allclose(normalization.scale, TORCH_SCALE, rtol=1e-6)
    np.testing.assert_allclose(
        to_numpy(normalization(_images(2, 4))),
        to_numpy(models.ImageNetNormalization("torch")(_images(2, 4))), rtol=1e-5, atol=1e-5)
    assert _frozen(model) and not models.has_training_batch_norm(model)
    assert isinstance(model.get_layer("gem"), models.GeM)

    loss, change = _fit_one_batch(model, _images(8, 32), _labels(8))
    assert math.isfinite(loss) and change > 0


@once
def test_resnet_preset_multistage_step(tmp_path):
    preset = tiny_preset(tmp_path / "resnet", "ResNetBackbone")
    model = models.build_embedding_model(f"keras_hub:{preset}", pooling="avg",
                                         embedding_dim=8, weights="preset",
                                         input_shape=(32, 32, 3), freeze_bn=True)
    # No converter in the folder: ImageNet mean/std, the ResNet presets' own.
    assert model.get_layer("normalization").mode == "torch"
    loss, change = _fit_one_batch(model, _images(8, 32), _labels(8), chunk_size=4)
    assert math.isfinite(loss) and change > 0


@once
def test_random_weights_differ_from_the_preset(tmp_path):
    preset = tiny_preset(tmp_path / "resnet", "ResNetBackbone")
    kwargs = {"embedding_dim": 8, "input_shape": (32, 32, 3)}
    loaded = models.build_embedding_model(f"keras_hub:{preset}", weights="preset", **kwargs)
    random = models.build_embedding_model(f"keras_hub:{preset}", weights=None, **kwargs)
    first = [to_numpy(w) for w in loaded.get_layer("resnet").weights[:1]]
    assert not np.array_equal(first[0], to_numpy(random.get_layer("resnet").weights[0]))


@pytest.mark.parametrize("pooling", ["cls", "avg"])
def test_dinov2_preset_pools_tokens_and_trains_one_step(tmp_path, pooling):
    preset = tiny_preset(tmp_path / "dinov2", "DINOV2Backbone")
    model = models.build_embedding_model(f"keras_hub:{preset}", pooling=pooling,
                                         embedding_dim=8, weights="preset",
                                         input_shape=(28, 28, 3))
    pool = model.get_layer("cls_token" if pooling == "cls" else "avg_pool")
    assert isinstance(pool, models.TokenPooling)
    # [CLS, 2 registers, 2 x 2 patches]: the mean leaves the class and register tokens out.
    assert pool.prefix_tokens == (3 if pooling == "avg" else 1)
    embeddings = to_numpy(model(_images(4, 28)))
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)
    loss, change = _fit_one_batch(model, _images(8, 28), _labels(8))
    assert math.isfinite(loss) and change > 0


def test_token_pooling_values():
    tokens = np.random.default_rng(0).normal(size=(2, 6, 4)).astype("float32")
    np.testing.assert_allclose(to_numpy(models.TokenPooling("cls")(tokens)), tokens[:, 0])
    np.testing.assert_allclose(to_numpy(models.TokenPooling("avg", prefix_tokens=2)(tokens)),
                               tokens[:, 2:].mean(axis=1), rtol=1e-6)
    np.testing.assert_allclose(to_numpy(models.TokenPooling("max", prefix_tokens=1)(tokens)),
                               tokens[:, 1:].max(axis=1))


def test_gem_on_tokens_and_cls_on_a_feature_map_are_refused(tmp_path):
    dinov2 = tiny_preset(tmp_path / "dinov2", "DINOV2Backbone")
    with pytest.raises(models.PoolingError, match="signed tokens"):
        models.build_embedding_model(f"keras_hub:{dinov2}", pooling="gem",
                                     input_shape=(28, 28, 3))
    resnet = tiny_preset(tmp_path / "resnet", "ResNetBackbone")
    with pytest.raises(models.PoolingError, match="feature map"):
        models.build_embedding_model(f"keras_hub:{resnet}", pooling="cls",
                                     input_shape=(32, 32, 3))


@once
def test_saved_model_reloads_with_frozen_batch_norm(tmp_path):
    preset = tiny_preset(tmp_path / "resnet", "ResNetBackbone")
    model = models.build_embedding_model(f"keras_hub:{preset}", pooling="gem",
                                         embedding_dim=8, weights="preset",
                                         input_shape=(32, 32, 3), freeze_bn=True)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, compile=False)
    images = _images(3, 32)
    np.testing.assert_allclose(to_numpy(loaded(images)), to_numpy(model(images)),
                               rtol=1e-5, atol=1e-6)
    assert len(_frozen(loaded)) == len(_frozen(model)) > 0


@once
def test_backbone_file_feature_map_tokens_and_pooled(tmp_path):
    inputs = keras.Input((16, 16, 3))
    conv = keras.layers.Conv2D(6, 3, strides=2, activation="relu")(inputs)
    variants = {
        "map": conv,
        "tokens": keras.layers.Reshape((-1, 6))(conv),
        "pooled": keras.layers.GlobalAveragePooling2D()(conv),
    }
    for kind, outputs in variants.items():
        path = tmp_path / f"{kind}.keras"
        keras.Model(inputs, outputs, name=f"mine_{kind}").save(path)
        backbone = models.load_backbone_file(path)
        model = models.build_embedding_model(backbone, pooling="avg", embedding_dim=4,
                                             input_shape=(16, 16, 3), preprocessing=None)
        embeddings = to_numpy(model(_images(2, 16)))
        assert embeddings.shape == (2, 4), kind
        np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)
    with pytest.raises(FileNotFoundError, match="no such file"):
        models.load_backbone_file(tmp_path / "missing.keras")


@once
def test_config_keras_hub_backbone_and_backbone_file(tmp_path):
    from tfaploss.config import config_from_dict
    from tfaploss.run import build as B

    preset = tiny_preset(tmp_path / "dinov2", "DINOV2Backbone")
    raw = {"data": {"image_size": 28}, "loss": {"name": "SmoothAPLoss"},
           "model": {"backbone": f"keras_hub:{preset}", "weights": "preset",
                     "pooling": "cls", "embedding_dim": 8}}
    cfg = config_from_dict(raw)
    assert cfg.model.frozen_bn  # weights loaded: the existing rule
    model = B.build_model(cfg)
    assert model.output_shape == (None, 8)

    # A user's own backbone through --set, replacing the recipe's backbone.
    path = tmp_path / "mine.keras"
    inputs = keras.Input((28, 28, 3))
    keras.Model(inputs, keras.layers.Conv2D(4, 3, activation="relu")(inputs)).save(path)
    cfg = config_from_dict({**raw, "model": {**raw["model"], "weights": None}},
                           [f"model.backbone_file={path}", "model.pooling=gem"], warn=False)
    assert cfg.model.backbone_file == str(path) and cfg.model.frozen_bn
    model = B.build_model(cfg)
    assert model.output_shape == (None, 8) and isinstance(model.get_layer("gem"), models.GeM)
