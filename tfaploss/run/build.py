"""Turn a validated :class:`~tfaploss.config.Config` into Keras objects: what
``tfaploss train`` calls, importable so a notebook can start from a recipe."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from tfaploss.config.fields import ConfigError
from tfaploss.config.loss_section import loss_class
from tfaploss.config.schema import KERAS_HUB_PREFIX, Config
from tfaploss.run.schedule import RecipeSchedule

LOG = logging.getLogger(__name__)


def build_model(cfg: Config, input_shape=None, weights="config", calibrate=True):
    """The embedding model of ``cfg.model`` (``tfaploss.models.build_embedding_model``).

    ``input_shape`` defaults to the training crops; ``weights="config"`` uses
    ``model.weights`` (``None``: random; a ``model.backbone_file`` keeps its own). With
    ``calibrate`` and ``model.bn_calibration_images``, the frozen BatchNorm statistics
    are then set from that many training images (:func:`calibrate_batch_norm`).
    """
    from tfaploss.models import PoolingError, build_embedding_model

    m = cfg.model
    if input_shape is None:
        input_shape = (*cfg.image_shape, 3)
    weights = m.weights if weights == "config" else weights
    try:
        backbone = config_backbone(m, weights)
        model = build_embedding_model(
            backbone=backbone, pooling=m.pooling, embedding_dim=m.embedding_dim,
            weights=None if m.backbone_file else weights, input_shape=tuple(input_shape),
            freeze_bn=m.frozen_bn,
            preprocessing=None if m.preprocessing == "none" else m.preprocessing)
    except PoolingError as err:
        raise ConfigError(f"config key 'model.pooling': {err}") from None
    except (OSError, ValueError, KeyError) as err:
        if weights in (None, "imagenet", "preset") or isinstance(err, FileNotFoundError):
            raise
        # a file that is there but does not load: a clear error, not h5py's traceback
        raise ConfigError(
            f"config key 'model.weights': {weights!r} does not load into a "
            f"{m.backbone_file or m.backbone} backbone ({type(err).__name__}: "
            f"{str(err)[:300]}): a truncated or damaged file, or the weights of another "
            "backbone.") from None
    if calibrate and m.bn_calibration_images:
        calibrate_batch_norm(model, calibration_images(cfg, m.bn_calibration_images))
    return model


def config_backbone(m, weights="config"):
    """``build_embedding_model``'s ``backbone`` for ``cfg.model`` (``m``): its name, or
    the model of ``model.backbone_file`` (``weights`` loaded over it when a path)."""
    if m.backbone_file is None:
        if m.backbone.startswith(KERAS_HUB_PREFIX):
            from tfaploss.models import require_keras_hub

            try:
                require_keras_hub(m.backbone)
            except ImportError as err:  # one line from the CLI, before any training
                raise ConfigError(f"config key 'model.backbone': {err}") from None
        return m.backbone
    from tfaploss.models import load_backbone_file

    weights = m.weights if weights == "config" else weights
    return load_backbone_file(m.backbone_file, weights=weights)


def calibration_images(cfg: Config, count: int):
    """``count`` augmented training images (a fixed draw for a given ``data.seed``)."""
    import tensorflow as tf

    batches = build_train_dataset(cfg, seed_offset=_CALIBRATION_SEED_OFFSET)
    needed = -(-count // cfg.data.batch_size)
    images = tf.concat([x for x, _ in batches.take(needed)], axis=0)
    return images[:count]


_CALIBRATION_SEED_OFFSET = 7919
_PRECISE_BN_SEED_OFFSET = 7927


def estimate_batch_norm_statistics(model, batches) -> int:
    """Set the moving statistics of every non-frozen BatchNorm to the mean over
    ``batches`` of their batch statistics ("precise BN", Wu & Johnson 2021), in place;
    returns the number of layers. Running averages trail the weights by a few hundred
    steps. Each batch should hold as many images as training normalised together.
    Cost: one forward pass per batch.
    """
    from tfaploss.training.checks import batch_statistics_layers

    layers = batch_statistics_layers(model)  # the layers themselves: names may repeat
    if not layers:
        return 0
    saved = [layer.momentum for layer in layers]
    try:
        for k, images in enumerate(batches):
            for layer in layers:  # the k-th batch gets weight 1/(k+1): a plain mean
                layer.momentum = k / (k + 1)
            model(images, training=True)
    finally:
        for layer, momentum in zip(layers, saved):
            layer.momentum = momentum
    return len(layers)


def precise_batch_norm(model, cfg: Config) -> int:
    """:func:`estimate_batch_norm_statistics` on ``model.precise_bn_images`` training
    images (at most one pass over the split), in groups of the chunk size (or batch
    size) that training normalised over."""
    count = cfg.model.precise_bn_images
    if not count or cfg.model.frozen_bn:
        return 0
    group = cfg.multistage_chunk or cfg.data.batch_size
    split_size = (_manifest(cfg) or {}).get("num_images")
    if isinstance(split_size, int) and split_size > 0:
        count = min(count, -(-split_size // group) * group)
    batches = build_train_dataset(cfg, seed_offset=_PRECISE_BN_SEED_OFFSET)

    def groups():
        left = count
        for images, _ in batches:
            for i in range(0, images.shape[0], group):
                if left <= 0:
                    return
                yield images[i:i + min(group, left)]
                left -= group

    return estimate_batch_norm_statistics(model, groups())


def calibrate_batch_norm(model, images) -> int:
    """Set every BatchNorm's moving statistics to those of ``images``, in place (one
    training-mode pass with momentum 0; frozen layers stay frozen), as a pretrained
    network would bring them; returns the number of layers set."""
    import keras

    from tfaploss.training import FrozenBatchNormalization

    layers = [layer for layer in model._flatten_layers(include_self=True, recursive=True)
              if isinstance(layer, keras.layers.BatchNormalization)]
    saved = [(layer.__class__, layer.momentum) for layer in layers]
    try:
        for layer in layers:
            if isinstance(layer, FrozenBatchNormalization):
                layer.__class__ = keras.layers.BatchNormalization
            layer.momentum = 0.0
        model(images, training=True)
    finally:
        for layer, (cls, momentum) in zip(layers, saved):
            layer.__class__ = cls
            layer.momentum = momentum
    return len(layers)


def build_loss(cfg: Config):
    """``tfaploss.losses.<loss.name>(**kwargs)``; a bad value is reported with its key.
    A proxy loss gets ``num_classes`` from the training manifest (a config value that
    disagrees is refused)."""
    cls = loss_class(cfg.loss.name)
    kwargs = dict(cfg.loss.kwargs)
    if _uses_proxies(cls, kwargs):
        kwargs["num_classes"] = _proxy_classes(cfg, kwargs.get("num_classes"))
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"config section 'loss' ({cfg.loss.name}): {err}") from None


def _uses_proxies(cls, kwargs) -> bool:
    from tfaploss.losses.proxies import ProxiesOwner

    return issubclass(cls, ProxiesOwner) and cls.uses_proxies(kwargs)


def _proxy_classes(cfg: Config, configured) -> int:
    found = (_manifest(cfg) or {}).get("num_classes")
    if found is None:
        if configured is None:
            raise ConfigError(
                f"config key 'loss.num_classes': {cfg.loss.name} learns one proxy per "
                f"training class, and the training split {cfg.data.train!r} has no "
                "manifest.json giving their number; set loss.num_classes.")
        return int(configured)
    if configured is not None and int(configured) != int(found):
        raise ConfigError(
            f"config key 'loss.num_classes': {configured} proxies, but the training split "
            f"{cfg.data.train!r} has {found} classes (manifest.json); leave it out to use "
            "the manifest's.")
    return int(found)


def attach_proxies(loss, embedding_model):
    """``embedding_model`` followed by ``loss``'s proxies layer when it has one (so that
    the optimizer trains them and checkpoints keep them)."""
    if not _uses_proxies(type(loss), loss.get_config()):
        return embedding_model
    return loss.with_proxies(embedding_model)


def build_schedule(cfg: Config, steps_per_epoch: int):
    """The learning rate as a :class:`RecipeSchedule` over the run's updates."""
    opt, sched = cfg.optimizer, cfg.optimizer.schedule
    return RecipeSchedule(
        kind=sched.name, lr=opt.lr, total_steps=cfg.training.epochs * steps_per_epoch,
        end_lr=sched.end_lr if sched.end_lr is not None else 0.0,
        warmup_steps=int(math.ceil(opt.warmup_epochs * steps_per_epoch)),
        boundaries=[e * steps_per_epoch for e in (sched.step_epochs or ())],
        gamma=sched.gamma if sched.gamma is not None else 0.1)


def build_optimizer(cfg: Config, steps_per_epoch: int):
    """The optimizer of ``cfg.optimizer`` with its schedule and head multiplier."""
    import keras

    opt = cfg.optimizer
    lr = build_schedule(cfg, steps_per_epoch)
    common = dict(learning_rate=lr, clipnorm=opt.clipnorm)
    if opt.weight_decay or opt.name == "adamw":
        # AdamW's own default (0.004) would be a hidden setting
        common["weight_decay"] = opt.weight_decay or 0.0
    extra = {k: getattr(opt, k) for k in ("beta_1", "beta_2", "epsilon", "momentum",
                                          "nesterov") if getattr(opt, k) is not None}
    cls = {"adam": keras.optimizers.Adam, "adamw": keras.optimizers.AdamW,
           "sgd": keras.optimizers.SGD}[opt.name]
    optimizer = cls(**common, **extra)
    multipliers = {}
    if cfg.model.head_lr_multiplier != 1.0:
        from tfaploss.models.lr_multipliers import head_multipliers

        multipliers.update(head_multipliers(cfg.model.head_lr_multiplier, include_gem=False))
    if cfg.model.proxy_lr_multiplier != 1.0:
        from tfaploss.losses.proxies import proxies_multipliers

        multipliers.update(proxies_multipliers(cfg.model.proxy_lr_multiplier))
    if multipliers:
        from tfaploss.models.lr_multipliers import LRMultiplierOptimizer

        optimizer = LRMultiplierOptimizer(optimizer, multipliers)
    return optimizer


def _manifest(cfg: Config, fresh: bool = False) -> dict | None:
    """The training split's manifest.json, read once per build (afresh by
    :func:`check_data`, which a run calls first), kept on ``cfg`` outside its fields."""
    path = cfg.data.train
    held = cfg.__dict__.get("_train_manifest")
    if fresh or held is None or held[0] != path:
        from tfaploss.data import read_manifest

        held = cfg.__dict__["_train_manifest"] = (path, read_manifest(path) if path else None)
    return held[1]


def steps_per_epoch(cfg: Config) -> int:
    """``training.steps_per_epoch``, or the training split's images / batch size."""
    if cfg.training.steps_per_epoch is not None:
        return cfg.training.steps_per_epoch
    manifest = _manifest(cfg)
    if not manifest or "num_images" not in manifest:
        raise ConfigError(
            "config key 'training.steps_per_epoch' is null, which means one pass over "
            f"the training split, but {cfg.data.train!r} has no manifest.json giving its "
            "size; set training.steps_per_epoch.")
    return max(1, int(manifest["num_images"]) // cfg.data.batch_size)


def check_data(cfg: Config) -> None:
    """Check the config against the training split's manifest before any training."""
    if cfg.data.train is None:
        raise ConfigError("config key 'data.train' is null: set it to a training split "
                          "folder written by a pipelines job (e.g. --set data.train=out/train).")
    if "://" not in cfg.data.train and not Path(cfg.data.train).exists():
        raise ConfigError(f"config key 'data.train': {cfg.data.train!r} does not exist. "
                          "Write it with a pipelines job first (see README: Preparing data).")
    manifest = _manifest(cfg, fresh=True) or {}
    _check_class_chunks(cfg, manifest)
    if cfg.data.sampler == "all_classes":
        counts = manifest.get("class_counts", {})
        eligible = sum(1 for k, v in counts.items() if int(k) >= 0 and v >= cfg.data.m)
        if eligible and eligible * cfg.data.m != cfg.data.batch_size:
            raise ConfigError(
                f"config key 'data.batch_size': the all_classes sampler puts all {eligible} "
                f"classes with >= m={cfg.data.m} images in every batch, i.e. "
                f"{eligible * cfg.data.m} images, not {cfg.data.batch_size}; set "
                f"data.batch_size={eligible * cfg.data.m} or change data.m.")


def _largest_chunk(n: int, chunk_size: int) -> int:
    """Images in the largest by-class record of a class of ``n`` images (cut into
    ceil(n / chunk_size) balanced chunks: tfaploss.pipelines.tf_example.class_chunks)."""
    return -(-n // max(1, -(-n // chunk_size)))


def _check_class_chunks(cfg: Config, manifest: dict) -> None:
    """Refuse a sampler that could never fill a batch: it draws a class's m images from
    one by-class record (at most ``class_chunk_size``)."""
    from tfaploss.data.samplers import classes_per_batch

    chunk = (manifest.get("by_class") or {}).get("chunk_size")
    counts = manifest.get("class_counts") or {}
    if not chunk:
        return
    m, train = cfg.data.m, cfg.data.train
    fix = (f"Rewrite the split with a larger --class_chunk_size (at least 2*m={2 * m}, e.g. "
           f"python -m tfaploss.pipelines.folder ... --class_chunk_size {max(32, 2 * m)}) or lower "
           f"data.m.")
    if chunk < m:
        raise ConfigError(
            f"config key 'data.m': the {cfg.data.sampler} sampler draws m={m} images of a "
            f"class from one by-class record, but {train!r} was written with "
            f"class_chunk_size={chunk} (manifest.json), so no record holds {m} images and "
            f"training would wait forever for its first batch. {fix}")
    usable = sum(1 for k, n in counts.items()
                 if int(k) >= 0 and int(n) >= m and _largest_chunk(int(n), chunk) >= m)
    needed = classes_per_batch(cfg.data.sampler, cfg.data.batch_size, m)
    if counts and usable < needed:
        raise ConfigError(
            f"config key 'data.m': with class_chunk_size={chunk} ({train!r}, "
            f"manifest.json) only {usable} classes have a by-class record of m={m} "
            f"images; the {cfg.data.sampler} sampler needs {needed}, so training would "
            f"wait forever for its first batch. {fix}")


def check_classes_left(cfg: Config, kept: dict[int, int], skipped: dict) -> None:
    """Refuse (:class:`~tfaploss.data.integrity.DamagedDataError`) a sampler that the
    classes left after skipping damaged files, ``kept`` (``{label: images of its
    largest record}``), cannot fill."""
    from tfaploss.data import integrity
    from tfaploss.data.samplers import classes_per_batch
    from tfaploss.data.split_manifest import describe_source

    m, batch = cfg.data.m, cfg.data.batch_size
    usable = sum(1 for n in kept.values() if n >= m)
    needed = classes_per_batch(cfg.data.sampler, batch, m)
    lost = skipped.get("classes_lost") or []
    if usable >= needed:
        if lost:
            LOG.warning("warning: the skipped files held every image of %d class(es) "
                        "(%s); training goes on with the %d classes left", len(lost),
                        ", ".join(map(str, lost[:10])) + (", ..." if len(lost) > 10 else ""),
                        usable)
        return
    split = integrity.split_dir_of(cfg.data.train)
    manifest = _manifest(cfg)
    raise integrity.DamagedDataError(
        f"after skipping {len(skipped['shards'])} damaged file(s) of {split} "
        f"({', '.join(s['file'] for s in skipped['shards'])}), {usable} classes have a "
        f"by-class record of m={m} images; the {cfg.data.sampler} sampler needs {needed} "
        f"(data.batch_size={batch} / data.m={m}), so training would wait forever for "
        f"its first batch. They were {describe_source(manifest, split)} "
        "(or lower data.batch_size)", path=split, problem="too few classes left")


def build_train_dataset(cfg: Config, seed_offset: int = 0, num_shards: int = 1,
                        shard_index: int = 0):
    """Endless ``(images, labels)`` batches of ``cfg.data``; ``seed_offset`` shifts
    ``data.seed`` (an epoch's index), ``num_shards``/``shard_index`` a rank's share."""
    from tfaploss.data import make_train_dataset

    d = cfg.data
    aug = d.augmentation
    kwargs = dict(sampler=d.sampler, batch_size=d.batch_size, m=d.m,
                  image_size=d.image_size, augment=aug.crop == "random_resized_crop",
                  seed=d.seed + 1009 * seed_offset, flip=aug.flip,
                  label_levels=d.label_levels, num_shards=num_shards,
                  shard_index=shard_index)
    if aug.scale is not None:
        kwargs["crop_scale"] = tuple(aug.scale)
    return make_train_dataset(d.train, **kwargs)


def build_eval_dataset(cfg: Config, path: str, batch_size: int = 64):
    """Every image of a split once: ``(images, labels, ids)`` batches."""
    from tfaploss.data import make_eval_dataset

    size = cfg.test_image_size
    return make_eval_dataset(path, image_size=size, batch_size=batch_size if size else 1)
