"""Checks across fields: a setting that would be ignored (``momentum`` for Adam) or that
contradicts another (a batch the sampler cannot split) is refused; one that is valid but
probably not meant (a ``chunk_size`` that does not split the batch) is a
:class:`ConfigWarning` note.
"""

from __future__ import annotations

import dataclasses
import typing

from tfaploss.config.convert import close_match
from tfaploss.config.fields import ConfigError
from tfaploss.config.health import HealthConfig
from tfaploss.config.loss_section import MULTI_LEVEL_LOSSES
from tfaploss.config.schema import (
    KERAS_HUB_PREFIX,
    OPTIMIZER_PARAMS,
    SCHEDULE_PARAMS,
    Backbone,
    Config,
)

__all__ = ["ConfigWarning", "check_consistency"]


class ConfigWarning(UserWarning):
    """A configuration that is valid but probably not what was meant."""


def check_consistency(cfg: Config) -> list[str]:
    """Raise on settings that would be ignored; return notes worth telling the user."""
    notes = []
    data, opt, train = cfg.data, cfg.optimizer, cfg.training

    if data.m < 2:
        raise ConfigError(
            f"config key 'data.m': {data.m} image per class gives no positive pairs; an "
            "AP loss needs m >= 2 images of each class in a batch.")
    if data.sampler in ("m_per_class", "hierarchical") and data.batch_size % data.m:
        raise ConfigError(
            f"config key 'data.batch_size': {data.batch_size} is not a multiple of "
            f"data.m={data.m}; the {data.sampler} sampler draws batch_size/m classes of "
            f"m images. Use e.g. {data.batch_size - data.batch_size % data.m or data.m}.")
    if data.sampler == "hierarchical" and data.batch_size % (2 * data.m):
        raise ConfigError(
            f"config key 'data.batch_size': the hierarchical sampler splits a batch "
            f"between two super-classes of whole classes, so batch_size must be a "
            f"multiple of 2*m={2 * data.m}; received {data.batch_size}.")

    if data.label_levels > 1 and cfg.loss.name not in MULTI_LEVEL_LOSSES:
        raise ConfigError(
            f"config key 'data.label_levels': {cfg.loss.name} takes one label per image; "
            f"labels with {data.label_levels} levels are for "
            f"{', '.join(MULTI_LEVEL_LOSSES)}. Use label_levels: 1.")
    if data.label_levels > 1 and cfg.training.xbm.size:
        raise ConfigError(
            "config key 'training.xbm.size': the cross-batch memory keeps one label per "
            f"image; data.label_levels={data.label_levels} needs xbm.size: 0; received "
            f"{cfg.training.xbm.size}.")
    if cfg.training.xbm.size and cfg.loss.name == "ProxyAnchorLoss":
        raise ConfigError(
            "config key 'training.xbm.size': ProxyAnchorLoss scores the batch against its "
            "proxies and has no query-vs-memory form; use xbm.size: 0; received "
            f"{cfg.training.xbm.size}.")

    aug = data.augmentation
    if aug.scale is not None:
        if aug.crop != "random_resized_crop":
            raise ConfigError(
                "config key 'data.augmentation.scale' is only used by crop "
                f"'random_resized_crop', but crop is {aug.crop!r}; remove it.")
        if not 0 < aug.scale[0] <= aug.scale[1] <= 1:
            raise ConfigError("config key 'data.augmentation.scale': needs 0 < low <= high "
                              f"<= 1, received {list(aug.scale)}.")

    if cfg.model.bn_calibration_images and cfg.model.freeze_bn is False:
        raise ConfigError(
            "config key 'model.bn_calibration_images' only sets the statistics of frozen "
            "BatchNorm layers, but model.freeze_bn is false (the statistics then follow "
            "each batch); remove it or set model.freeze_bn: true.")
    notes.extend(_check_backbone(cfg.model))

    for key in dict.fromkeys(k for keys in OPTIMIZER_PARAMS.values() for k in keys):
        if key not in OPTIMIZER_PARAMS[opt.name] and getattr(opt, key) is not None:
            users = [n for n, k in OPTIMIZER_PARAMS.items() if key in k]
            raise ConfigError(
                f"config key 'optimizer.{key}' is only used by optimizer "
                f"{' / '.join(users)}, but optimizer.name is {opt.name!r}; remove it "
                f"or change the optimizer.")

    sched = opt.schedule
    used = SCHEDULE_PARAMS[sched.name]
    for key in ("end_lr", "step_epochs", "gamma"):
        if getattr(sched, key) is not None and key not in used:
            raise ConfigError(
                f"config key 'optimizer.schedule.{key}' is not used by the "
                f"{sched.name!r} schedule (it takes: {', '.join(used) or 'no parameters'}); "
                "remove it or change optimizer.schedule.name.")
    if sched.name == "step":
        if not sched.step_epochs:
            raise ConfigError("config key 'optimizer.schedule.step_epochs' is required by "
                              "the 'step' schedule (e.g. [30, 70]).")
        if sorted(sched.step_epochs) != list(sched.step_epochs):
            raise ConfigError("config key 'optimizer.schedule.step_epochs': needs increasing "
                              f"epochs, received {sched.step_epochs}.")
        if max(sched.step_epochs) >= train.epochs:
            notes.append(
                f"optimizer.schedule.step_epochs={sched.step_epochs} reaches past "
                f"training.epochs={train.epochs}: those steps never happen.")
        if sched.gamma is None:
            raise ConfigError("config key 'optimizer.schedule.gamma' is required by the "
                              "'step' schedule (the factor applied at each step, e.g. 0.1).")
    if opt.warmup_epochs < 0 or (opt.warmup_epochs and opt.warmup_epochs >= train.epochs):
        raise ConfigError(
            f"config key 'optimizer.warmup_epochs': {opt.warmup_epochs} must be >= 0 "
            f"and shorter than training.epochs={train.epochs}.")

    if train.chunk_size is not None and not cfg.uses_multistage:
        notes.append(
            f"training.chunk_size={train.chunk_size} >= data.batch_size={data.batch_size}: "
            "multi-stage backpropagation is off, each batch is one ordinary "
            "forward/backward pass.")
    xbm = train.xbm
    if xbm.size == 0 and xbm.weight != 1.0:
        raise ConfigError(
            "config key 'training.xbm.weight' is set but training.xbm.size is 0 (no "
            "memory), so it would be ignored; set a size or remove it.")
    _check_health(train.health)

    ev = cfg.evaluation
    if not ev.ks:
        raise ConfigError("config key 'evaluation.ks': needs at least one rank, received [].")
    if data.test is None and (ev.every_n_epochs > 0):
        notes.append("evaluation.every_n_epochs is set but data.test is null: no "
                     "evaluation will run during training.")
    return notes


def _check_health(health: HealthConfig) -> None:
    """What the fields' own ranges cannot say (:mod:`tfaploss.config.health`)."""
    where = "config key 'training.health."
    if not health.enabled:
        changed = [f.name for f in dataclasses.fields(HealthConfig)
                   if f.name != "enabled" and getattr(health, f.name) != f.default]
        if changed:
            raise ConfigError(
                f"{where}{changed[0]}' is set but training.health.enabled is false (no "
                "check), so it would be ignored; remove it or enable the check.")
        return
    if health.stop_share is not None and health.stop_share < health.window_share:
        raise ConfigError(
            f"{where}stop_share': must be between training.health.window_share="
            f"{health.window_share:g} (stop at the first warning) and 1, or null (never "
            f"stop, only warn); received {health.stop_share}.")


def _check_backbone(model) -> list[str]:
    """The backbone named, and the weights that go with it."""
    notes = []
    if model.backbone_file is not None:
        if model.weights in ("imagenet", "preset"):
            raise ConfigError(
                f"config key 'model.weights': {model.weights!r} does not apply to "
                "model.backbone_file, which brings its own weights; use null (the file's "
                "weights) or the path of a .weights.h5 file to load over them.")
        return notes
    builtin = typing.get_args(Backbone)
    if model.backbone.startswith(KERAS_HUB_PREFIX):
        if not model.backbone[len(KERAS_HUB_PREFIX):].strip():
            raise ConfigError("config key 'model.backbone': 'keras_hub:' names no preset; "
                              "write e.g. keras_hub:resnet_50_imagenet or "
                              "keras_hub:path/to/preset_dir.")
        if model.weights == "imagenet":
            raise ConfigError(
                "config key 'model.weights': 'imagenet' is for the built-in ResNets; a "
                "keras_hub backbone takes 'preset' (the preset's own weights), null or a "
                ".weights.h5 path.")
        if model.weights is None:
            notes.append(
                f"model.backbone {model.backbone} with model.weights null trains the "
                "preset's architecture from random weights; set model.weights: preset to "
                "start from its pretrained weights.")
        return notes
    if model.backbone not in builtin:
        raise ConfigError(
            f"config key 'model.backbone': {model.backbone!r} is not allowed; choose one of "
            f"{', '.join(repr(b) for b in builtin)} or keras_hub:<preset> (e.g. "
            "keras_hub:resnet_50_imagenet), or set model.backbone_file."
            f"{close_match(model.backbone, builtin)}")
    if model.weights == "preset":
        raise ConfigError(
            f"config key 'model.weights': 'preset' is for keras_hub backbones; "
            f"{model.backbone} takes null, imagenet or a file path.")
    if model.backbone == "small_cnn" and model.weights == "imagenet":
        raise ConfigError("config key 'model.weights': the small_cnn backbone has no "
                          "ImageNet weights; use null or a file path.")
    if model.pooling == "cls":
        raise ConfigError(
            f"config key 'model.pooling': 'cls' takes the class token of a ViT-like "
            f"backbone; {model.backbone} gives a feature map: use gem, avg or max_ln.")
    return notes
