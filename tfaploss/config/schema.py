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
the cross-field checks, the ``loss`` section (checked against whichever class it names)
and the error messages, which tests check word for word, would stay, plus a translation
of pydantic's errors into them, at the cost of a compiled runtime dependency for every
user, including those who only read a config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from tfaploss.config.callbacks import check_callbacks
from tfaploss.config.fields import MAX_BATCH, MAX_EPOCHS, MAX_SEED, ranged
from tfaploss.config.health import HealthConfig
from tfaploss.config.loss_section import LossConfig, loss_defaults

Backbone = Literal["resnet50", "resnet101", "small_cnn"]
# A keras-hub preset is any "keras_hub:<preset>" string; check_consistency refuses others.
KERAS_HUB_PREFIX = "keras_hub:"
Pooling = Literal["gem", "avg", "max_ln", "cls"]
Preprocessing = Literal["auto", "torch", "caffe", "none"]
Sampler = Literal["m_per_class", "hierarchical", "all_classes"]
Crop = Literal["random_resized_crop", "center_crop"]
OptimizerName = Literal["adam", "adamw", "sgd"]
ScheduleName = Literal["constant", "linear", "cosine", "step"]
# auto: tfaploss.evaluation.backend_choice (exact, or the best installed tuned searcher)
Backend = Literal["auto", "exact", "scann", "scann_ah", "faiss"]
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
    3/4..4/3, resized to ``image_size``, then a random horizontal flip: the papers'
    recipes) or ``center_crop`` (no randomness: shorter side to ``image_size / 0.875``,
    centre crop). ``scale`` is refused with ``center_crop``.

    ``flip``: random horizontal flip after the crop. ``null`` (default) follows the
    crop: flip after ``random_resized_crop`` (the papers), none after ``center_crop``.
    ``false`` never flips: set it when classes are mirror images of each other
    (left/right arrows, rtl/ltr icons, text glyphs), which a flip would mislabel.
    ``true`` flips after either crop.
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

    ``backbone``: ``resnet50``, ``resnet101``, ``small_cnn``, or ``keras_hub:<preset>``:
    a keras-hub preset name (``keras_hub:resnet_50_imagenet``, ``keras_hub:dinov2_small``,
    ``keras_hub:vit_base_patch16_224_imagenet``), a Kaggle/Hugging Face handle or a local
    preset folder (``pip install "tfaploss[hub]"``). ``backbone_file``: a Keras model file
    of your own (``.keras``) that maps images to a feature map, tokens or pooled
    features; when set it replaces ``backbone`` and brings its own weights.
    ``pooling``: ``gem``, ``avg``, ``max_ln`` for feature maps; for the tokens of a
    ViT-like backbone ``cls`` (the class token) or ``avg`` (the mean of the patch
    tokens), see :func:`tfaploss.models.build_pooling`.

    ``weights``: ``null`` (random init), ``imagenet`` (the built-in ResNets, from Keras's
    cache), ``preset`` (a keras-hub preset's own weights, downloaded by keras-hub on
    first use) or the path of a weights file. ``preprocessing``: how raw pixels are
    normalised inside the model: ``auto`` (the ResNets' caffe mode, a preset's own
    image converter, ImageNet mean/std for ``small_cnn`` and for a ``backbone_file``),
    ``torch``, ``caffe`` or ``none`` (the backbone normalises its input itself).

    ``freeze_bn: true`` keeps BatchNorm statistics fixed (gamma/beta
    still train), as the papers do when they fine-tune pretrained networks;
    ``false`` normalises with batch statistics (under multi-stage backpropagation,
    each chunk with its own: ghost batch norm, still exact, see
    :mod:`tfaploss.training.multistage`). ``null`` (default) picks: frozen when
    ``weights`` are loaded, a ``backbone_file`` is used (it holds trained weights) or
    ``bn_calibration_images`` is set, batch statistics for a network trained from
    scratch. Why: frozen statistics of a random initialisation
    stop normalising as soon as the weights move; on the glyph set that cost 8 points
    of MAP@R and made higher learning rates collapse (``docs/batch_sweep/first_sweep.md``).
    ``head_lr_multiplier``: the head learns this many times faster than the backbone.
    ``proxy_lr_multiplier``: a proxy loss's class proxies (``ProxyAnchorLoss``,
    ``HAPLoss``'s clustering term) learn this many times faster than the backbone
    (Proxy-Anchor's paper: 100).
    ``bn_calibration_images``: with frozen BatchNorm and no pretrained statistics
    (random init), first estimate the frozen statistics from this many training
    images (one forward pass in training mode); 0 keeps the weights' statistics.
    ``precise_bn_images``: after training, BatchNorm layers that use batch statistics
    get their moving statistics re-estimated on this many training images ("precise
    BN", Wu & Johnson 2021), so that the saved model normalises as it trained; the
    running averages lag far behind a network trained for a few hundred steps (on the
    glyph set, MAP@R 49 with them, 72 after re-estimation). At most one pass over the
    training split (its manifest's ``num_images``). 0 keeps them.
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
    """Learning-rate schedule over the run's updates (batches, not chunks).

    ``constant``; ``linear`` from ``optimizer.lr`` to ``end_lr``; ``cosine`` from
    ``optimizer.lr`` to ``end_lr``; ``step``: multiply by ``gamma`` at each epoch listed
    in ``step_epochs``. An optional linear warm-up (``optimizer.warmup_epochs``) comes
    first.
    """

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

    ``strategy``: ``"none"`` trains on one device; ``"data_parallel"`` splits every
    batch over ``devices`` devices (``null``: all GPUs, or all CPU devices where there
    is no GPU) with ``tf.distribute.MirroredStrategy`` (TensorFlow) or
    ``keras.distribution.DataParallel`` (JAX), and the losses rank the global batch;
    ``"auto"`` (default) is ``data_parallel`` where there are 2 GPUs or more, else
    ``none``. ``data.batch_size`` is the global batch and must split evenly over the
    devices; ``training.chunk_size`` counts images per device. BatchNorm statistics
    are per device (not synchronised). Several processes or machines: launch with
    ``torchrun`` or ``tfaploss train --coordinator`` (docs/scale_out.md).

    ``timeout_s``: under several processes (``torchrun``, JAX's ``--coordinator``:
    :mod:`tfaploss.run.processes`), how long a rank waits in a collective (a step's
    gather, a barrier) for the others before it fails: longer than the longest thing
    one rank does while the others wait (rank 0 writing a checkpoint, the slowest
    rank's first step), far shorter than the 30 minutes a hung rank otherwise holds
    the group. Not part of what a run trains: a resumed run may change it.
    """

    strategy: Strategy = "auto"
    devices: int | None = ranged(None, low=1, high=4096)
    timeout_s: int = ranged(600, low=10, high=7 * 24 * 3600)


@dataclass
class TrainingConfig:
    """How long and how to train.

    ``steps_per_epoch``: updates per epoch (``null``: the training split's image count
    divided by the batch size). ``chunk_size``: images embedded at once by multi-stage
    backpropagation; a batch larger than it is trained with
    :class:`tfaploss.training.MultiStageModel`, giving the same gradient as one pass.
    ``health``: when to warn about, and stop, a run that has collapsed or stalled
    (:class:`HealthConfig`). ``distribute``: one device or several
    (:class:`DistributeConfig`). ``callbacks``: the user's Keras callbacks, each an
    import path ``module.Class`` or ``{class: module.Class, kwargs: {...}}``, checked
    when the config is loaded (:mod:`tfaploss.config.callbacks`).
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
    report says which, with the recall measured).
    """

    every_n_epochs: int = ranged(0, low=0, high=MAX_EPOCHS)
    at_end: bool = True
    ks: list[int] = ranged(default_factory=lambda: [1, 10, 100], low=1, high=MAX_BATCH)
    backend: Backend = "auto"
    target_recall: float | None = ranged(None, low=0, low_open=True, high=1)
    max_images: int | None = ranged(None, low=2, high=2 ** 31 - 1)


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

