"""Run configs: every recipe in configs/ loads, validates and builds; bad keys are named."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import yaml

import tfaploss.losses
from tfaploss.config import (
    ConfigError,
    ConfigWarning,
    config_from_dict,
    load_config,
    parse_override,
)
from tfaploss.run import build as B
from tfaploss.run.schedule import RecipeSchedule

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted(CONFIG_DIR.glob("*.yaml"))

MINIMAL = {"loss": {"name": "APLoss"}}
_MODELS = {}


def _error(raw, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, overrides)
    return str(info.value)


def test_the_seven_recipes_are_there():
    names = {p.name for p in RECIPES}
    assert {"revaud_gldv2_resnet101_ap.yaml", "fastap_sop_resnet50.yaml",
            "smoothap_sop_resnet50.yaml", "roadmap_sop_resnet50.yaml",
            "roadmap_inat_resnet50.yaml", "pnp_sop_resnet50_dq.yaml",
            "demo_digits.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_loads_validates_and_builds(path, monkeypatch, tmp_path):
    # A proxy loss takes its class count from the training manifest (none here).
    monkeypatch.setattr(B, "_manifest", lambda path: {"num_classes": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # a shipped recipe has no oddities
        cfg = load_config(path)
    # The round trip through a plain dict is lossless.
    assert config_from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    if cfg.model.backbone.startswith("keras_hub:"):
        # Tests never download: the preset's architecture (its keras-hub class, which
        # also proves the preset name exists), tiny and random, from a local folder.
        from tests.support.hub import preset_class, tiny_preset

        folder = tiny_preset(tmp_path / "preset", preset_class(cfg.model.backbone.split(":", 1)[1]))
        cfg = config_from_dict(cfg.to_dict(), [f"model.backbone=keras_hub:{folder}"])

    loss = B.build_loss(cfg)
    assert type(loss).__name__ == cfg.loss.name
    loss_config = loss.get_config()
    for key, value in cfg.loss.kwargs.items():
        got = loss_config[key]
        assert (list(got) if isinstance(got, tuple) else got) == \
            (list(value) if isinstance(value, tuple) else value), key

    # The architecture of the recipe at a small input size (it is fully convolutional);
    # recipes sharing an architecture share one build, to keep the test fast.
    key = (cfg.model.backbone, cfg.model.pooling, cfg.model.embedding_dim, cfg.model.freeze_bn)
    if key not in _MODELS:
        _MODELS[key] = B.build_model(cfg, input_shape=(32, 32, 3), weights=None,
                                     calibrate=False)
    model = B.attach_proxies(loss, _MODELS[key])  # a proxy loss's layer, last
    images = np.random.default_rng(0).uniform(0, 255, (4, 32, 32, 3)).astype("float32")
    embeddings = np.asarray(model(images, training=False))
    assert embeddings.shape == (4, cfg.model.embedding_dim)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)
    value = float(loss(np.array([0, 0, 1, 1]), embeddings))
    assert math.isfinite(value) and value >= -1e-6
    assert B.build_optimizer(cfg, steps_per_epoch=10).learning_rate is not None


def test_revaud_recipe_values():
    cfg = load_config(CONFIG_DIR / "revaud_gldv2_resnet101_ap.yaml")
    assert (cfg.data.batch_size, cfg.data.image_size) == (4096, 800)
    assert cfg.uses_multistage and cfg.training.chunk_size < 4096
    assert (cfg.model.backbone, cfg.model.pooling) == ("resnet101", "gem")
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.weight_decay) == \
        ("adam", 1e-4, 1e-6)
    assert (cfg.optimizer.schedule.name, cfg.optimizer.schedule.end_lr) == ("linear", 0.0)
    assert cfg.loss.kwargs["num_bins"] == 20


def test_demo_config_file_matches_the_demo():
    from tfaploss.demo import DEMO_CONFIG

    assert load_config(CONFIG_DIR / "demo_digits.yaml").to_dict() == \
        config_from_dict(DEMO_CONFIG).to_dict()


# -- unknown keys, wrong types, wrong values --------------------------------------------


def test_unknown_top_level_key_is_named_with_the_allowed_keys():
    message = _error({**MINIMAL, "optimiser": {"lr": 0.1}})
    assert "'optimiser'" in message and "Did you mean 'optimizer'" in message
    assert "data, model, loss, optimizer, training, evaluation" in message


def test_unknown_nested_key_is_named_by_its_dotted_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "training": {"epocs": 3}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "'training.epocs'" in message and "Did you mean 'epochs'" in message
    assert str(path) in message


def test_unknown_loss_argument_lists_the_constructor_arguments():
    message = _error({"loss": {"name": "APLoss", "bins": 25}})
    assert "'loss.bins'" in message and "num_bins" in message and "score_range" in message


def test_unknown_loss_name_lists_the_losses():
    message = _error({"loss": {"name": "APLos"}})
    assert "'loss.name'" in message and "APLoss" in message and "SmoothAPLoss" in message


@pytest.mark.parametrize("raw, key, expected", [
    ({"training": {"epochs": "ten"}}, "training.epochs", "an integer"),
    ({"training": {"epochs": True}}, "training.epochs", "an integer"),
    ({"model": {"freeze_bn": 1}}, "model.freeze_bn", "true/false"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr", "a number"),
    ({"data": {"augmentation": {"scale": [0.2]}}}, "data.augmentation.scale",
     "a list of 2 values"),
    ({"evaluation": {"ks": [1, "ten"]}}, "evaluation.ks[1]", "an integer"),
    ({"loss": {"name": "APLoss", "num_bins": "many"}}, "loss.num_bins", "an integer"),
    ({"loss": {"name": "SmoothAPLoss", "temperature": [0.1]}}, "loss.temperature",
     "a number"),
])
def test_wrong_type_names_key_and_expected_type(raw, key, expected):
    message = _error({**MINIMAL, **raw})
    assert f"'{key}'" in message and expected in message


@pytest.mark.parametrize("raw, key, allowed", [
    ({"model": {"pooling": "mean"}}, "model.pooling", "'gem', 'avg', 'max_ln'"),
    ({"data": {"sampler": "random"}}, "data.sampler",
     "'m_per_class', 'hierarchical', 'all_classes'"),
    ({"optimizer": {"schedule": "cosin"}}, "optimizer.schedule.name",
     "'constant', 'linear', 'cosine', 'step'"),
    ({"evaluation": {"backend": "annoy"}}, "evaluation.backend", "'exact', 'scann'"),
])
def test_wrong_enum_value_lists_allowed_values(raw, key, allowed):
    message = _error({**MINIMAL, **raw})
    assert f"'{key}'" in message and allowed in message


def test_yaml_numbers_without_a_dot_are_numbers():
    # PyYAML reads `1e-4` as a string; the schema accepts that spelling of a number.
    cfg = config_from_dict(yaml.safe_load("loss: {name: APLoss}\noptimizer: {lr: 1e-4}"))
    assert cfg.optimizer.lr == pytest.approx(1e-4)


def test_unsafe_yaml_is_refused(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("run_dir: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


# -- settings that would be ignored --------------------------------------------------------


def test_schedule_parameter_the_schedule_does_not_use_is_an_error():
    message = _error({**MINIMAL, "optimizer": {"schedule": {"name": "linear", "gamma": 0.1}}})
    assert "'optimizer.schedule.gamma'" in message and "end_lr" in message


def test_step_schedule_needs_its_parameters():
    assert "step_epochs" in _error(
        {**MINIMAL, "optimizer": {"schedule": {"name": "step", "gamma": 0.1}}})


def test_optimizer_setting_of_another_optimizer_is_an_error():
    message = _error({**MINIMAL, "optimizer": {"name": "adam", "momentum": 0.9}})
    assert "'optimizer.momentum'" in message and "sgd" in message
    cfg = config_from_dict({**MINIMAL, "optimizer": {"name": "sgd", "momentum": 0.9}})
    assert B.build_optimizer(cfg, 10).momentum == 0.9


def test_chunk_size_not_below_batch_size_warns_that_multistage_is_off():
    with pytest.warns(ConfigWarning, match="multi-stage backpropagation is off"):
        cfg = config_from_dict({**MINIMAL, "data": {"batch_size": 64},
                                "training": {"chunk_size": 64}})
    assert not cfg.uses_multistage and cfg.multistage_chunk is None
    cfg = config_from_dict({**MINIMAL, "data": {"batch_size": 64},
                            "training": {"chunk_size": 16}})
    assert cfg.uses_multistage and cfg.multistage_chunk == 16
    assert config_from_dict({**MINIMAL, "data": {"batch_size": 64}}).multistage_chunk is None


def test_a_build_reads_the_training_manifest_once(tmp_path, monkeypatch):
    """check_data reads the manifest afresh; steps per epoch and the proxies' classes of
    the same build reuse it; a config naming another split reads that one."""
    import json

    import tfaploss.data

    for name, classes in (("a", 7), ("b", 9)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps(
            {"num_images": 640, "num_classes": classes, "class_counts": {}}))
    reads = []
    real = tfaploss.data.read_manifest
    monkeypatch.setattr(tfaploss.data, "read_manifest", lambda p: reads.append(p) or real(p))
    cfg = config_from_dict({**MINIMAL, "data": {"train": str(tmp_path / "a"), "batch_size": 64},
                            "loss": {"name": "ProxyAnchorLoss"}})
    B.check_data(cfg)
    assert B.steps_per_epoch(cfg) == 10 and B.build_loss(cfg).num_classes == 7
    assert len(reads) == 1
    B.check_data(cfg)  # a new build: read again (the file may have changed)
    cfg.data.train = str(tmp_path / "b")
    assert B.build_loss(cfg).num_classes == 9 and len(reads) == 3


def test_batch_not_multiple_of_m_and_unused_xbm_weight_are_errors():
    assert "'data.batch_size'" in _error({**MINIMAL, "data": {"batch_size": 30, "m": 4}})
    assert "'training.xbm.weight'" in _error({**MINIMAL, "training": {"xbm": {"weight": 0.5}}})
    assert "'data.augmentation.scale'" in _error(
        {**MINIMAL, "data": {"augmentation": {"crop": "center_crop", "scale": [0.5, 1.0]}}})


def test_training_health_section_defaults_overrides_and_bad_values():
    cfg = config_from_dict(MINIMAL)
    health = cfg.to_dict()["training"]["health"]
    assert health == {"enabled": True, "collapse_cosine": 0.99, "collapse_fraction": 0.8,
                      "window_share": 0.1, "min_window_images": 8192, "stop_share": 0.25,
                      "stop_chance_ap": 0.5, "cone_cosine": 0.95, "cone_chance_ap": 0.25,
                      "stall_chance_ap": 0.3, "stall_after": 0.5}
    cfg = config_from_dict(MINIMAL, ["training.health.stop_share=null",
                                     "training.health.min_window_images=4096"])
    assert cfg.training.health.stop_share is None
    assert cfg.training.health.min_window_images == 4096
    message = _error({**MINIMAL, "training": {"health": {"stop_share": 0.05}}})
    assert message == (
        "config key 'training.health.stop_share': must be between "
        "training.health.window_share=0.1 (stop at the first warning) and 1, or null "
        "(never stop, only warn); received 0.05.")
    assert "'training.health.collapse_fraction': must be in (0, 1]" in _error(
        MINIMAL, ["training.health.collapse_fraction=1.5"])
    assert "'training.health.collapse_cosine': must be in (-1, 1]" in _error(
        MINIMAL, ["training.health.collapse_cosine=-1"])
    assert "'training.health.stop_chance_ap': must be in [0, 1]" in _error(
        MINIMAL, ["training.health.stop_chance_ap=2"])
    assert "'training.health.cone_cosine': must be in (-1, 1]" in _error(
        MINIMAL, ["training.health.cone_cosine=1.5"])
    assert "'training.health.cone_chance_ap': must be in [0, 1]" in _error(
        MINIMAL, ["training.health.cone_chance_ap=-0.1"])
    assert config_from_dict(MINIMAL, ["training.health.cone_cosine=null"]
                            ).training.health.cone_cosine is None
    for bad in ("0", "-0.1", "1.5"):
        assert "'training.health.stall_chance_ap': must be in (0, 1]" in _error(
            MINIMAL, [f"training.health.stall_chance_ap={bad}"]), bad
    for bad in ("-0.5", "2"):
        assert "'training.health.stall_after': must be in [0, 1]" in _error(
            MINIMAL, [f"training.health.stall_after={bad}"]), bad
    assert config_from_dict(MINIMAL, ["training.health.stall_chance_ap=null"]
                            ).training.health.stall_chance_ap is None
    assert "'training.health.min_window_images': expected an integer" in _error(
        MINIMAL, ["training.health.min_window_images=many"])
    assert "Did you mean 'stop_share'" in _error(MINIMAL, ["training.health.stop_shar=0.3"])
    assert "'training.health.stop_share' is set but training.health.enabled is false" in \
        _error({**MINIMAL, "training": {"health": {"enabled": False, "stop_share": 0.5}}})
    assert not config_from_dict(MINIMAL, ["training.health.enabled=false"]
                                ).training.health.enabled


# -- overrides --------------------------------------------------------------------------


def test_set_overrides_are_yaml_typed_and_dotted():
    cfg = config_from_dict(MINIMAL, [
        "training.epochs=3", "optimizer.lr=2e-5", "evaluation.ks=[1, 4]",
        "model.weights=null", "loss.num_bins=25", "optimizer.schedule=linear",
        "optimizer.schedule.end_lr=0", "data.augmentation.scale=[0.5,1.0]",
    ])
    assert cfg.training.epochs == 3 and cfg.optimizer.lr == pytest.approx(2e-5)
    assert cfg.evaluation.ks == [1, 4] and cfg.model.weights is None
    assert cfg.loss.kwargs == {"num_bins": 25}
    assert (cfg.optimizer.schedule.name, cfg.optimizer.schedule.end_lr) == ("linear", 0.0)
    assert cfg.data.augmentation.scale == (0.5, 1.0)


def test_bad_overrides_name_the_key():
    assert "'training.epocs'" in _error(MINIMAL, ["training.epocs=3"])
    assert "'training.epochs'" in _error(MINIMAL, ["training.epochs=abc"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("training.epochs")
    assert "'run_dir'" in _error(MINIMAL, ["run_dir.x=1"])


# -- builders -----------------------------------------------------------------------------


def test_recipe_schedule_values_by_hand():
    linear = RecipeSchedule("linear", 1e-4, total_steps=100, end_lr=0.0)
    assert [float(linear(s)) for s in (0, 50, 100)] == pytest.approx([1e-4, 5e-5, 0.0])
    warm = RecipeSchedule("constant", 1.0, total_steps=100, warmup_steps=4)
    assert [float(warm(s)) for s in (0, 3, 4, 99)] == pytest.approx([0.25, 1.0, 1.0, 1.0])
    cosine = RecipeSchedule("cosine", 1.0, total_steps=10, end_lr=0.1)
    assert float(cosine(5)) == pytest.approx(0.55)
    step = RecipeSchedule("step", 1.0, total_steps=100, boundaries=(30, 70), gamma=0.3)
    assert [float(step(s)) for s in (29, 30, 70)] == pytest.approx([1.0, 0.3, 0.09])
    again = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(step))
    assert float(again(70)) == pytest.approx(0.09)


def test_build_optimizer_schedule_counts_updates_and_head_multiplier():
    cfg = config_from_dict(MINIMAL, ["training.epochs=4", "optimizer.lr=1e-3",
                                     "optimizer.schedule.name=step",
                                     "optimizer.schedule.step_epochs=[2]",
                                     "optimizer.schedule.gamma=0.1",
                                     "model.head_lr_multiplier=10"])
    optimizer = B.build_optimizer(cfg, steps_per_epoch=5)
    from tfaploss.models import LRMultiplierOptimizer

    assert isinstance(optimizer, LRMultiplierOptimizer)
    schedule = optimizer.inner_optimizer._learning_rate
    assert float(schedule(9)) == pytest.approx(1e-3) and float(schedule(10)) == \
        pytest.approx(1e-4)


def test_calibrate_batch_norm_sets_frozen_statistics_from_images():
    from tfaploss.training import FrozenBatchNormalization, freeze_batch_norm

    inputs = keras.Input((6, 6, 3))
    conv = keras.layers.Conv2D(4, 3, use_bias=False)
    outputs = keras.layers.BatchNormalization()(conv(inputs))
    model = freeze_batch_norm(keras.Model(inputs, outputs))
    images = np.random.default_rng(1).normal(2.0, 3.0, (16, 6, 6, 3)).astype("float32")
    assert B.calibrate_batch_norm(model, images) == 1
    bn = model.layers[-1]
    assert isinstance(bn, FrozenBatchNormalization) and bn.momentum == pytest.approx(0.99)
    features = np.asarray(conv(images)).reshape(-1, 4)
    np.testing.assert_allclose(np.asarray(bn.moving_mean), features.mean(0), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(bn.moving_variance), features.var(0), rtol=1e-3)
    # Frozen again: a training-mode call no longer moves the statistics.
    model(images * 5.0, training=True)
    np.testing.assert_allclose(np.asarray(bn.moving_mean), features.mean(0), rtol=1e-4,
                               atol=1e-5)


def test_every_loss_class_is_reachable_from_a_config():
    from tfaploss.config import loss_classes

    names = set(loss_classes())
    assert {"APLoss", "FastAPLoss", "SmoothAPLoss", "ROADMAPLoss", "PNPLoss"} <= names
    for name in names:
        assert getattr(tfaploss.losses, name) is loss_classes()[name]


# -- backbones: built-in, keras-hub presets, a model file ----------------------------------


def test_keras_hub_backbone_and_its_weights():
    cfg = config_from_dict({**MINIMAL, "model": {"backbone": "keras_hub:dinov2_small",
                                                 "weights": "preset", "pooling": "cls"}})
    assert cfg.model.backbone == "keras_hub:dinov2_small" and cfg.model.frozen_bn
    with pytest.warns(ConfigWarning, match="weights: preset"):
        config_from_dict({**MINIMAL, "model": {"backbone": "keras_hub:dinov2_small"}})
    message = _error({**MINIMAL, "model": {"backbone": "keras_hub:resnet_50_imagenet",
                                           "weights": "imagenet"}})
    assert "'model.weights'" in message and "'preset'" in message
    assert "names no preset" in _error({**MINIMAL, "model": {"backbone": "keras_hub:"}})


def test_unknown_backbone_names_the_choices():
    message = _error({**MINIMAL, "model": {"backbone": "resnet5"}})
    assert "'model.backbone'" in message and "'resnet50'" in message
    assert "keras_hub:<preset>" in message and "Did you mean 'resnet50'" in message


def test_settings_that_do_not_fit_the_backbone_are_refused():
    for model, key in [({"weights": "preset"}, "'model.weights'"),
                       ({"pooling": "cls"}, "'model.pooling'"),
                       ({"backbone_file": "mine.keras", "weights": "imagenet"},
                        "'model.weights'")]:
        assert key in _error({**MINIMAL, "model": model}), model


def test_backbone_file_by_override_freezes_batch_norm_by_default():
    cfg = config_from_dict(MINIMAL, ["model.backbone_file=mine.keras"])
    assert cfg.model.backbone_file == "mine.keras" and cfg.model.frozen_bn
    assert not config_from_dict(MINIMAL, ["model.backbone_file=mine.keras",
                                          "model.freeze_bn=false"]).model.frozen_bn
