"""Run configurations: the typed schema of the YAML recipes in ``configs/``.

A run is one YAML file with the sections ``data``, ``model``, ``loss``, ``optimizer``,
``training`` and ``evaluation`` plus ``run_dir``; each section is a dataclass below. Every
key is described in ``docs/training.md`` ("The run config's keys"). Validation is strict:
an unknown key, a wrong type or a value out of range raises :class:`ConfigError` naming the
dotted key; the checks live in :mod:`~tfaploss.config.convert` (types, ranges),
:mod:`~tfaploss.config.loss_section`, :mod:`~tfaploss.config.consistency` (contradictions)
and :mod:`~tfaploss.config.load` (files, ``--set``). Dataclasses, not pydantic: pydantic
would replace only the generic converter, at the cost of a compiled dependency.
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
    """Training-time augmentation, in the input pipeline (never inside the model, so
    multi-stage backpropagation sees the same pixels twice): ``crop``, its ``scale``,
    ``flip`` (``null``: after ``random_resized_crop`` only)."""

    crop: Crop = "random_resized_crop"
    scale: tuple[float, float] | None = None
    flip: bool | None = None


@dataclass
class DataConfig:
    """Where the TFRecords are (``train`` / ``test``: split folders holding
    ``manifest.json``) and how batches are drawn (``sampler``, ``m`` images per class)."""

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
    """The embedding network: backbone → pooling → Dense head → L2 normalisation,
    its weights, preprocessing and BatchNorm handling (``docs/training.md``)."""

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
    """Learning-rate schedule over the run's updates (batches, not chunks), after
    ``optimizer.warmup_epochs`` of linear warm-up."""

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
    """Cross-batch memory (Wang et al. CVPR'20): queries also ranked against the last
    ``size`` embeddings of earlier batches, that loss added with ``weight``; 0: off."""

    size: int = ranged(0, low=0, high=2 ** 24)
    weight: float = ranged(1.0, low=0, high=1e6)


@dataclass
class DistributeConfig:
    """Data-parallel training on this machine's devices
    (:func:`tfaploss.run.devices.plan_devices`; several machines: docs/scale_out.md)."""

    strategy: Strategy = "auto"
    devices: int | None = ranged(None, low=1, high=4096)
    timeout_s: int = ranged(600, low=10, high=7 * 24 * 3600)


@dataclass
class TrainingConfig:
    """How long and how to train; a batch above ``chunk_size`` is trained with
    :class:`tfaploss.training.MultiStageModel` (same gradient)."""

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
    """Retrieval evaluation on ``data.test`` (each image queries all the others);
    ``backend`` and ``target_recall`` make :attr:`search_plan`, checked once, here."""

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
        """The :class:`~tfaploss.evaluation.search_plan.SearchPlan` to search with."""
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
        """The images of one forward/backward chunk, or ``None`` when batches are not split
        (``training.chunk_size`` unset, or not below ``data.batch_size``)."""
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

