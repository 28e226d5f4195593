"""Run configurations: the typed schema of the YAML recipes in ``configs/``.

A run is one YAML file with the sections ``data``, ``model``, ``loss``, ``optimizer``,
``training`` and ``evaluation`` plus ``run_dir``; each section is a dataclass below,
whose docstring says what its keys mean. Validation is strict so that a typo never
silently trains something else: an unknown key, a value of the wrong type or outside
its range raises :class:`ConfigError` with the dotted key (``optimizer.schedule.end_lr``)
and what is allowed there. Where each check lives: :mod:`tfaploss.config.convert` (types
and ranges), :mod:`tfaploss.config.loss_section` (the loss arguments),
:mod:`tfaploss.config.consistency` (settings that contradict each other or would be
ignored), :mod:`tfaploss.config.load` (files and ``--set`` overrides).

Why dataclasses and not pydantic: pydantic would replace only the generic converter;
the cross-field checks, the ``loss`` section and the error messages would stay, at the
cost of a compiled runtime dependency for every user.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from tfaploss.config.callbacks import check_callbacks
from tfaploss.config.fields import MAX_BATCH, MAX_EPOCHS, MAX_SEED, ConfigError, ranged
from tfaploss.config.health import HealthConfig
from tfaploss.config.loss_section import LossConfig, loss_defaults
from tfaploss.evaluation.search_plan import CHOICES, SearchPlan

Backbone = Literal["resnet50", "resnet101", "small_cnn"]
# A keras-hub preset is any "keras_hub:<preset>" string; check_consistency refuses others.
KERAS_HUB_PREFIX = "keras_hub:"
Pooling = Literal["gem", "avg", "max_ln", "cls"]
Preprocessing = Literal["auto", "torch", "caffe", "none"]
Sampler = Literal["m_per_class", "hierarchical", "all_classes"]
Crop = Literal["random_resized_crop", "center_crop"]
OptimizerName = Literal["adam", "adamw", "sgd"]
ScheduleName = Literal["constant", "linear", "cosine", "step"]
# auto: exact, or the best installed tuned searcher (tfaploss.evaluation.search_plan)
Backend = Literal[CHOICES]
Strategy = Literal["auto", "none", "data_parallel"]

# Which schedule takes which parameter; any other parameter set on a schedule is an error.
SCHEDULE_PARAMS = {
    "constant": (),
    "linear": ("end_lr",),
    "cosine": ("end_lr",),
    "step": ("step_epochs", "gamma"),
}
# Optimizer settings that only some optimizers use.
OPTIMIZER_PARAMS = {
    "adam": ("beta_1", "beta_2", "epsilon"),
    "adamw": ("beta_1", "beta_2", "epsilon"),
    "sgd": ("momentum", "nesterov"),
}


@dataclass
class AugmentationConfig:
    """Training-time augmentation, done in the input pipeline (never inside the model,
    so multi-stage backpropagation sees the same pixels twice).

    ``crop``: ``random_resized_crop`` (a window covering ``scale`` of the area, aspect
    3/4..4/3, resized to ``image_size``: the papers' recipes) or ``center_crop`` (shorter
    side to ``image_size / 0.875``, centre crop; ``scale`` is refused with it).
    ``flip``: random horizontal flip after the crop; ``null`` follows the crop (after
    ``random_resized_crop`` only); ``false`` for classes that are mirror images of each
    other (arrows, glyphs), which a flip would mislabel.
    """

    crop: Crop = "random_resized_crop"
    scale: tuple[float, float] | None = None
    flip: bool | None = None


@dataclass
class DataConfig:
    """Where the TFRecords are and how batches are drawn.

    ``train`` / ``test``: a split folder written by a ``pipelines`` job (the folder that
    holds ``manifest.json``). ``m``: images per class in a batch; the batch holds
    ``batch_size / m`` classes (``m_per_class``), two super-classes of
    ``batch_size / 2`` images each (``hierarchical``), or every class with at least m
    images (``all_classes``, where ``batch_size`` must then equal classes x m).
    ``image_size``: side of the square training crops. ``test_image_size``: side of the
    square test crops (default ``image_size``), or ``original`` to embed test images at
    their own size (landmarks). ``label_levels``: 1, the class label; 2, labels
    (class, super-class) for hierarchical losses (``HAPLoss``).
    """

    train: str | None = None
    test: str | None = None
    sampler: Sampler = "m_per_class"
    batch_size: int = ranged(128, low=1, high=MAX_BATCH)
    m: int = ranged(4, low=1, high=MAX_BATCH)
    image_size: int = ranged(224, low=8, high=8192)
    test_image_size: int | Literal["original"] | None = ranged(None, low=8, high=8192)
    augmentation: AugmentationConfig = field(default_factory=AugmentationConfig)
    seed: int = ranged(0, low=0, high=MAX_SEED)
    label_levels: int = ranged(1, low=1, high=2)


@dataclass
class ModelConfig:
    """The embedding network: backbone → pooling → Dense head → L2 normalisation.

    ``backbone``: ``resnet50``, ``resnet101``, ``small_cnn``, or ``keras_hub:<preset>``
    (a keras-hub preset name, a Kaggle/Hugging Face handle or a local preset folder;
    ``pip install "tfaploss[hub]"``). ``backbone_file``: a ``.keras`` model of your own
    mapping images to a feature map, tokens or pooled features; it replaces
    ``backbone`` and brings its own weights. ``pooling``: ``gem``, ``avg``, ``max_ln``
    for feature maps, ``cls`` or ``avg`` for a ViT's tokens
    (:func:`tfaploss.models.build_pooling`).

    ``weights``: ``null`` (random init), ``imagenet`` (the built-in ResNets),
    ``preset`` (a keras-hub preset's own) or a weights file. ``preprocessing``: how raw
    pixels are normalised inside the model: ``auto`` (the ResNets' caffe mode, a
    preset's own converter, ImageNet mean/std otherwise), ``torch``, ``caffe`` or
    ``none``.

    ``freeze_bn``: ``true`` keeps BatchNorm statistics fixed (the papers' fine-tuning
    setting), ``false`` normalises with batch statistics (each chunk with its own under
    multi-stage backpropagation: ghost batch norm, still exact); ``null`` freezes them
    when weights are loaded (``weights``, ``backbone_file``) or calibrated
    (``bn_calibration_images``), because frozen statistics of a random initialisation
    stop normalising as soon as the weights move (8 points of MAP@R on the glyph set,
    ``docs/batch_sweep/first_sweep.md``). ``head_lr_multiplier`` /
    ``proxy_lr_multiplier``: the head / a proxy loss's class proxies learn this many
    times faster than the backbone (Proxy-Anchor's paper: 100).
    ``bn_calibration_images``: with frozen BatchNorm and a random init, first estimate
    the statistics from this many training images (0: keep them).
    ``precise_bn_images``: after training, re-estimate the moving statistics of the
    BatchNorm layers that use batch statistics on this many training images ("precise
    BN", Wu & Johnson 2021; the running averages lag far behind a short run: MAP@R 49
    with them, 72 after, on the glyph set); at most one pass over the split, 0: keep.
    """

    backbone: Backbone | str = "resnet50"
    backbone_file: str | None = None
    pooling: Pooling = "avg"
    embedding_dim: int = ranged(512, low=1, high=65536)
    weights: str | None = None
    preprocessing: Preprocessing = "auto"
    freeze_bn: bool | None = None
    head_lr_multiplier: float = ranged(1.0, low=0, low_open=True, high=1e4)
    proxy_lr_multiplier: float = ranged(1.0, low=0, low_open=True, high=1e6)
    bn_calibration_images: int = ranged(0, low=0, high=2 ** 24)
    precise_bn_images: int = ranged(4096, low=0, high=2 ** 24)

    @property
    def frozen_bn(self) -> bool:
        """Whether BatchNorm statistics are frozen (``freeze_bn``, or its automatic value)."""
        if self.freeze_bn is not None:
            return self.freeze_bn
        return (self.weights is not None or self.backbone_file is not None
                or self.bn_calibration_images > 0)


@dataclass
class ScheduleConfig:
    """Learning-rate schedule over the run's updates (batches, not chunks):
    ``constant``; ``linear`` or ``cosine`` from ``optimizer.lr`` to ``end_lr``; ``step``
    multiplies by ``gamma`` at each of ``step_epochs``. After ``optimizer.warmup_epochs``
    of linear warm-up, if any."""

    name: ScheduleName = "constant"
    end_lr: float | None = ranged(None, low=0, high=100)
    step_epochs: list[int] | None = ranged(None, low=1, high=MAX_EPOCHS)
    gamma: float | None = ranged(None, low=0, low_open=True, high=1e3)


@dataclass
class OptimizerConfig:
    """Optimizer and learning rate. ``weight_decay`` is Keras's decoupled decay."""

    name: OptimizerName = "adam"
    lr: float = ranged(1e-4, low=0, low_open=True, high=100)
    weight_decay: float = ranged(0.0, low=0, high=10)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    warmup_epochs: float = 0.0
    beta_1: float | None = ranged(None, low=0, high=1)
    beta_2: float | None = ranged(None, low=0, high=1)
    epsilon: float | None = ranged(None, low=0, low_open=True, high=1)
    momentum: float | None = ranged(None, low=0, high=1)
    nesterov: bool | None = None
    clipnorm: float | None = ranged(None, low=0, low_open=True, high=1e6)


@dataclass
class XBMConfig:
    """Cross-batch memory (Wang et al. CVPR'20): each batch's queries are also ranked
    against the last ``size`` embeddings of earlier batches; that loss is added with
    ``weight``. ``size: 0`` turns it off."""

    size: int = ranged(0, low=0, high=2 ** 24)
    weight: float = ranged(1.0, low=0, high=1e6)


@dataclass
class DistributeConfig:
    """Data-parallel training on the devices of this machine
    (:func:`tfaploss.run.devices.plan_devices`).

    ``strategy``: ``"none"``: one device; ``"data_parallel"``: every batch split over
    ``devices`` devices (``null``: all GPUs, else all CPU devices) with
    ``MirroredStrategy`` (TensorFlow) or ``keras.distribution.DataParallel`` (JAX), the
    losses ranking the global batch; ``"auto"``: ``data_parallel`` with 2 GPUs or more.
    ``data.batch_size`` is the global batch; ``training.chunk_size`` counts images per
    device; BatchNorm statistics are per device. Several processes or machines:
    ``torchrun`` or ``tfaploss train --coordinator`` (docs/scale_out.md).

    ``timeout_s``: under several processes, how long a rank waits in a collective for
    the others before it fails: longer than the longest thing one rank does while the
    others wait (rank 0 writing a checkpoint), far shorter than the 30 minutes a hung
    rank otherwise holds the group. A resumed run may change it.
    """

    strategy: Strategy = "auto"
    devices: int | None = ranged(None, low=1, high=4096)
    timeout_s: int = ranged(600, low=10, high=7 * 24 * 3600)


@dataclass
class TrainingConfig:
    """How long and how to train.

    ``steps_per_epoch``: updates per epoch (``null``: the training split's image count
    divided by the batch size). ``chunk_size``: images embedded at once; a larger batch
    is trained with :class:`tfaploss.training.MultiStageModel` (same gradient).
    ``health``: when to warn about, and stop, a collapsed or stalled run.
    ``callbacks``: the user's Keras callbacks, each ``module.Class`` or ``{class:
    module.Class, kwargs: {...}}``, checked when the config is loaded.
    """

    epochs: int = ranged(1, low=1, high=MAX_EPOCHS)
    steps_per_epoch: int | None = ranged(None, low=1, high=10 ** 9)
    chunk_size: int | None = ranged(None, low=1, high=MAX_BATCH)
    mixed_precision: bool = False
    jit_compile: bool = False
    xbm: XBMConfig = field(default_factory=XBMConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    distribute: DistributeConfig = field(default_factory=DistributeConfig)
    seed: int = ranged(0, low=0, high=MAX_SEED)
    callbacks: list[str | dict] = field(default_factory=list)

    def __post_init__(self):
        check_callbacks(self.callbacks)


@dataclass
class EvaluationConfig:
    """Retrieval evaluation on ``data.test`` (each image queries all the others).

    ``every_n_epochs``: evaluate during training every N epochs (0: only at the end,
    if ``at_end``). ``max_images``: evaluate on at most this many test images during
    training (the final evaluation uses all of them). ``backend``: ``auto`` (default)
    searches exactly without a target recall, and with one picks the best installed
    searcher that can be tuned to it (ScaNN, else faiss, else exact search), logging
    the choice; ``exact``, ``scann``, ``scann_ah`` or ``faiss`` name one (ScaNN and faiss:
    their extras, checked before training starts). ``target_recall``: ``null`` (default)
    searches with ``backend`` as is; a value in (0, 1] tunes the search to reach that
    recall@k against exact search on a sample of the queries (faiss when ``backend`` is
    ``faiss``, else ScaNN), or falls back to exact search when no setting beats it (the
    report says which, with the recall measured). The two make :attr:`search_plan`,
    which checks them once, here, and is what the trainer and ``tfaploss evaluate``
    search with.
    """

    every_n_epochs: int = ranged(0, low=0, high=MAX_EPOCHS)
    at_end: bool = True
    ks: list[int] = ranged(default_factory=lambda: [1, 10, 100], low=1, high=MAX_BATCH)
    backend: Backend = "auto"
    target_recall: float | None = None
    max_images: int | None = ranged(None, low=2, high=2 ** 31 - 1)

    def __post_init__(self):
        try:
            self._search_plan = SearchPlan(self.backend, self.target_recall)
        except ValueError as err:  # the backend's type check came first: the target's range
            raise ConfigError(f"config key 'evaluation.target_recall': {err}") from None

    @property
    def search_plan(self) -> SearchPlan:
        """The evaluation's :class:`~tfaploss.evaluation.search_plan.SearchPlan` (its
        ``auto`` resolved when first asked)."""
        return self._search_plan


@dataclass
class Config:
    """A whole run. ``run_dir`` receives checkpoints, logs, the model and summary.json."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    run_dir: str = "runs/default"
    description: str | None = None

    def to_dict(self) -> dict:
        """Plain, YAML/JSON-serialisable dict with every default filled in, including the
        loss class's constructor defaults; ``config_from_dict`` reads it back."""
        return _to_plain(self)

    @property
    def multistage_chunk(self) -> int | None:
        """The images of one forward/backward chunk (``MultiStageModel``'s ``chunk_size``),
        or ``None`` when batches are not split: ``training.chunk_size`` unset, or not below
        ``data.batch_size``."""
        chunk = self.training.chunk_size
        return chunk if chunk is not None and self.data.batch_size > chunk else None

    @property
    def uses_multistage(self) -> bool:
        """True when batches are split into chunks (``MultiStageModel``)."""
        return self.multistage_chunk is not None

    @property
    def image_shape(self) -> tuple[int, int]:
        """(height, width) of the training crops."""
        return (self.data.image_size, self.data.image_size)

    @property
    def test_image_size(self) -> int | None:
        """Side of the test crops; None keeps each test image's own size."""
        size = self.data.test_image_size
        if size == "original":
            return None
        return self.data.image_size if size is None else size


def _to_plain(value):
    if isinstance(value, LossConfig):
        # Every argument, defaults filled in from the class signature: what prints is
        # what trains, and a later change of a default shows up as a config change.
        kwargs = {**loss_defaults(value.name), **value.kwargs}
        return {"name": value.name, **{k: _to_plain(v) for k, v in kwargs.items()}}
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value

