"""Run configurations: a typed schema for the YAML recipes in ``configs/``.

A run is described by one YAML file with the sections ``data``, ``model``, ``loss``,
``optimizer``, ``training`` and ``evaluation`` plus ``run_dir``::

    cfg = load_config("configs/smoothap_sop_resnet50.yaml",
                      overrides=["optimizer.lr=2e-5", "training.epochs=3"])
    cfg.optimizer.lr        # 2e-05
    cfg.to_dict()           # plain dict, every default filled in (loss arguments too)

The file is read with ``yaml.safe_load`` semantics only (no tags), bounded against alias
bombs, with duplicate keys refused (:mod:`tfaploss.config.yaml_loader`). Validation is strict so that a typo
never silently trains something else: an unknown key, a value of the wrong type or a
value outside its allowed set raises :class:`ConfigError` with the dotted key (e.g.
``optimizer.schedule.end_lr``) and what is allowed there. Settings that would be
ignored are refused too (``momentum`` for Adam, a ``step`` parameter on a ``linear``
schedule, ...); a ``training.chunk_size`` that does not split the batch gives a
:class:`ConfigWarning` saying multi-stage backpropagation is off.

``loss`` names a class of :mod:`tfaploss.losses`; its other keys are that class's
constructor arguments, checked against its signature (``loss.num_bins=25``).

Overrides (``--set`` on the command line) are ``dotted.key=value`` strings whose value
is parsed as YAML (``training.epochs=3`` gives an int, ``evaluation.ks=[1,10]`` a list,
``model.weights=null`` None).

Why dataclasses and not pydantic: pydantic v2
models would give strict types, ``extra="forbid"``, ``Field`` bounds and error locations
for free, but they would replace only the generic part of this module, the ~130 lines
of ``_convert`` / ``_build_dataclass``. The rest stays either way: the cross-field
checks (``_check_consistency``: settings that would be ignored, chunking, health
thresholds), the ``loss`` section, whose keys are the constructor arguments of whichever
class it names and so can only be checked against that signature at load time, and the
message format that the config error tests check word for word ("config key
'optimizer.lr': expected a number, received a string 'fast'.", with a "Did you mean"
suggestion on unknown keys). Keeping that format under pydantic means translating each
of its error types back, which is as much code as the converter it replaces. Against
that stands a new runtime dependency with a compiled core for every user, including
those who only read a config. So the schema stays dataclasses, the converter stays
small and total over the annotations it allows (any other annotation is a ``TypeError``
on the first config checked, never a silent pass), and this package imports neither Keras nor
TensorFlow; only checking the ``loss`` section imports :mod:`tfaploss.losses`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from tfaploss.config.fields import ConfigError, Range, ranged
from tfaploss.config.health import HealthConfig

__all__ = [
    "AugmentationConfig",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "DataConfig",
    "DistributeConfig",
    "EvaluationConfig",
    "HealthConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "TrainingConfig",
    "XBMConfig",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "loss_class",
    "loss_classes",
    "loss_defaults",
    "parse_override",
    "read_config_file",
]


class ConfigWarning(UserWarning):
    """A configuration that is valid but probably not what was meant."""


MAX_BATCH = 2 ** 20
MAX_SEED = 2 ** 31 - 1  # tf.random.set_seed and numpy's Generator both take it
MAX_EPOCHS = 10 ** 6


# ---------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------

Backbone = Literal["resnet50", "resnet101", "small_cnn"]
Pooling = Literal["gem", "avg", "max_ln"]
Sampler = Literal["m_per_class", "hierarchical", "all_classes"]
Crop = Literal["random_resized_crop", "center_crop"]
OptimizerName = Literal["adam", "adamw", "sgd"]
ScheduleName = Literal["constant", "linear", "cosine", "step"]
Backend = Literal["exact", "scann", "scann_ah"]
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

    ``weights``: ``null`` (random init), ``imagenet`` (Keras's cache) or the path of a
    weights file. ``freeze_bn: true`` keeps BatchNorm statistics fixed (gamma/beta
    still train), as the papers do when they fine-tune pretrained networks;
    ``false`` normalises with batch statistics (under multi-stage backpropagation,
    each chunk with its own: ghost batch norm, still exact, see
    :mod:`tfaploss.training.multistage`). ``null`` (default) picks: frozen when
    ``weights`` are loaded or ``bn_calibration_images`` is set, batch statistics for a
    network trained from scratch. Why: frozen statistics of a random initialisation
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
    glyph set, MAP@R 49 with them, 72 after re-estimation). 0 keeps them.
    """

    backbone: Backbone = "resnet50"
    pooling: Pooling = "avg"
    embedding_dim: int = ranged(512, low=1, high=65536)
    weights: str | None = None
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
        return self.weights is not None or self.bn_calibration_images > 0


@dataclass
class LossConfig:
    """A class of :mod:`tfaploss.losses` (``name``) and its constructor arguments."""

    name: str = "APLoss"
    kwargs: dict = field(default_factory=dict)


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
    are per device (not synchronised). Several machines: not through this key (see
    the README's scale-out section).
    """

    strategy: Strategy = "auto"
    devices: int | None = ranged(None, low=1, high=4096)


@dataclass
class TrainingConfig:
    """How long and how to train.

    ``steps_per_epoch``: updates per epoch (``null``: the training split's image count
    divided by the batch size). ``chunk_size``: images embedded at once by multi-stage
    backpropagation; a batch larger than it is trained with
    :class:`tfaploss.training.MultiStageModel`, giving the same gradient as one pass.
    ``health``: when to warn about, and stop, a run that has collapsed or stalled
    (:class:`HealthConfig`). ``distribute``: one device or several
    (:class:`DistributeConfig`).
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


@dataclass
class EvaluationConfig:
    """Retrieval evaluation on ``data.test`` (each image queries all the others).

    ``every_n_epochs``: evaluate during training every N epochs (0: only at the end,
    if ``at_end``). ``max_images``: evaluate on at most this many test images during
    training (the final evaluation uses all of them). ``target_recall``: ``null``
    (default) searches with ``backend`` as is (exact search by default); a value in
    (0, 1] tunes ScaNN to reach that recall@k against exact search on a sample of the
    queries, or falls back to exact search when no setting beats it (the report says
    which, with the recall measured).
    """

    every_n_epochs: int = ranged(0, low=0, high=MAX_EPOCHS)
    at_end: bool = True
    ks: list[int] = ranged(default_factory=lambda: [1, 10, 100], low=1, high=MAX_BATCH)
    backend: Backend = "exact"
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
    def uses_multistage(self) -> bool:
        """True when batches are split into chunks (``MultiStageModel``)."""
        chunk = self.training.chunk_size
        return chunk is not None and self.data.batch_size > chunk

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


def loss_defaults(name: str) -> dict:
    """Constructor defaults of the loss class ``name`` that a config may set."""
    return {key: param.default for key, param in loss_parameters(loss_class(name)).items()
            if param.default is not inspect.Parameter.empty}


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


# ---------------------------------------------------------------------------------------
# Generic typed conversion
# ---------------------------------------------------------------------------------------

_FLOAT_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} values, each {_describe(args[0])}"
        return f"a list of {_describe(args[0])}" if args else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping with keys " + ", ".join(f.name for f in dataclasses.fields(tp))
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _type_name(value) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _fail(path: str, value, tp, extra: str = "") -> typing.NoReturn:
    raise ConfigError(
        f"config key '{path}': expected {_describe(tp)}, received {_type_name(value)} "
        f"{value!r}.{(' ' + extra) if extra else ''}"
    )


def _convert(value, tp, path: str):
    """Check ``value`` against the annotation ``tp`` and return it in canonical form."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            _fail(path, value, tp)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as err:
                errors.append(err)
        if len(errors) == 1:
            raise errors[0]
        # Several alternatives failed: a nested error (bad enum inside a mapping) is
        # more useful than "expected X or Y".
        for err in errors:
            if not str(err).startswith(f"config key '{path}': expected"):
                raise err
        _fail(path, value, tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise ConfigError(
                f"config key '{path}': {value!r} is not allowed; choose one of "
                f"{', '.join(repr(a) for a in allowed)}."
            )
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            _fail(path, value, tp)
        return _build_dataclass(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            _fail(path, value, tp)
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                _fail(path, value, tp, f"It needs exactly {len(args)} values.")
            return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in
                         enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            _fail(path, value, tp)
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            _fail(path, value, tp)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            _fail(path, value, tp)
        return value
    if tp is float:
        if isinstance(value, bool):
            _fail(path, value, tp)
        if isinstance(value, (int, float)):
            if not math.isfinite(value):
                _fail(path, value, tp, "It must be finite.")
            return float(value)
        # PyYAML reads `1e-4` (no dot) as a string; accept that spelling of a number.
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)
        _fail(path, value, tp)
    if tp is str:
        if not isinstance(value, str):
            _fail(path, value, tp)
        return value
    raise TypeError(f"unsupported schema annotation {tp!r} at {path}")  # a bug here


def _build_dataclass(cls, raw: dict, path: str):
    if cls is LossConfig:
        return _build_loss(raw, path)
    hints = typing.get_type_hints(cls)
    fields_ = {f.name: f for f in dataclasses.fields(cls)}
    names = list(fields_)
    kwargs = {}
    # The loss last: checking it imports TensorFlow, other mistakes are reported first.
    for key, value in sorted(raw.items(), key=lambda item: item[0] == "loss"):
        where = f"{path}.{key}" if path else str(key)
        if key not in names:
            suggestion = _close_match(str(key), names)
            raise ConfigError(
                f"unknown config key '{where}'.{suggestion} Allowed keys"
                f"{' in ' + repr(path) if path else ''}: {', '.join(names)}."
            )
        kwargs[key] = _convert(value, hints[key], where)
        if "range" in fields_[key].metadata:
            fields_[key].metadata["range"].check(kwargs[key], where)
    return cls(**kwargs)


def _close_match(key: str, names) -> str:
    import difflib

    match = difflib.get_close_matches(key, list(names), n=1)
    return f" Did you mean '{match[0]}'?" if match else ""


# ---------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------

# proxies_key: set by a proxy loss itself, pairing it with its proxies layer.
_LOSS_BASE_ARGS = ("self", "reduction", "name", "dtype", "proxies_key")


def loss_classes() -> dict[str, type]:
    """The loss classes :mod:`tfaploss.losses` exports, by name."""
    import keras

    from tfaploss import losses

    names = getattr(losses, "__all__", dir(losses))
    # XBMLoss wraps another loss and needs its memory layer in the model: a run's
    # config asks for it with training.xbm instead.
    not_configurable = {"RetrievalLoss", "XBMLoss"}
    found = {}
    for name in names:
        obj = getattr(losses, name, None)
        if (inspect.isclass(obj) and issubclass(obj, keras.losses.Loss)
                and not inspect.isabstract(obj) and name not in not_configurable):
            found[name] = obj
    return found


def loss_class(name: str, path: str = "loss.name") -> type:
    """The class ``tfaploss.losses.<name>``, or a ConfigError listing what exists."""
    classes = loss_classes()
    if name not in classes:
        raise ConfigError(
            f"config key '{path}': {name!r} is not a loss of tfaploss.losses."
            f"{_close_match(name, classes)} Available: "
            f"{', '.join(sorted(classes)) or '(none yet)'}."
        )
    return classes[name]


def loss_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """Constructor arguments a config may set for the loss class ``cls``."""
    params = {}
    for klass in inspect.getmro(cls):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        signature = inspect.signature(init)
        for name, param in signature.parameters.items():
            if name in _LOSS_BASE_ARGS or param.kind in (param.VAR_POSITIONAL,
                                                         param.VAR_KEYWORD):
                continue
            params.setdefault(name, param)
        # Stop at the first __init__ that does not forward **kwargs to its parent.
        if not any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
            break
    return params


def _build_loss(raw: dict, path: str) -> LossConfig:
    if not isinstance(raw, dict):
        _fail(path, raw, dict)
    raw = dict(raw)
    if "name" not in raw:
        raise ConfigError(
            f"config key '{path}.name' is missing: name a loss class of tfaploss.losses "
            f"(available: {', '.join(sorted(loss_classes())) or '(none yet)'})."
        )
    name = _convert(raw.pop("name"), str, f"{path}.name")
    if "kwargs" in raw and isinstance(raw["kwargs"], dict) and len(raw) == 1:
        raw = dict(raw["kwargs"])  # also accept {name: X, kwargs: {...}}
    cls = loss_class(name, f"{path}.name")
    params = loss_parameters(cls)
    kwargs = {}
    for key, value in raw.items():
        where = f"{path}.{key}"
        if key not in params:
            raise ConfigError(
                f"unknown config key '{where}': {name} has no argument {key!r}."
                f"{_close_match(str(key), params)} Allowed: {', '.join(params) or '(none)'}."
            )
        default = params[key].default
        kwargs[key] = _check_like_default(value, default, params[key].annotation, where)
    _check_loss_accepts(cls, kwargs, path)
    return LossConfig(name=name, kwargs=kwargs)


def _check_loss_accepts(cls, kwargs: dict, path: str) -> None:
    """Build the loss once, so that the values its constructor refuses (a temperature
    of 0, one bin) are config errors naming the key, not a crash when training starts."""
    probe = dict(kwargs)
    if "num_classes" in loss_parameters(cls) and probe.get("num_classes") is None:
        probe["num_classes"] = 1  # `tfaploss train` takes it from the training manifest
    try:
        cls(**probe)
    except (ValueError, TypeError) as err:
        named = [k for k in kwargs if k in str(err)] or [None]
        where = f"{path}.{named[0]}" if named[0] else path
        raise ConfigError(f"config key '{where}': {err}") from None


# Loss arguments whose default is ``None`` ("automatic"/"random"): the default says
# nothing about the type, so the type of a value set in a config is given here.
# tests/config/test_schema.py checks that every such argument of every loss is listed.
NONE_DEFAULT_LOSS_ARGS: dict[str, tuple[type, float | None]] = {
    # name: (type, smallest allowed value or None)
    "pairs_per_block": (int, 1),
    "seed": (int, None),
    "offset": (float, None),
    "num_classes": (int, 1),
    "epsilon": (float, 0.0),
}


# Losses whose y_true may hold several label levels per image (data.label_levels > 1).
MULTI_LEVEL_LOSSES = ("HAPLoss",)

# Integer loss arguments: their class checks the low end; the high end is what a batch
# can afford (num_bins: every pair's score is spread over the bins, B x B x bins).
_INT_RANGE = Range(-(2 ** 31), 2 ** 31 - 1)
LOSS_ARG_RANGES: dict[str, Range] = {"num_bins": Range(2, 4096),
                                    "simix_group": Range(2, MAX_BATCH)}


# List arguments of any length (the cut-offs of a Recall@k surrogate); the other list
# arguments are fixed-length tuples such as a score range.
VARIABLE_LENGTH_LOSS_ARGS = ("at_k", "ks", "k")


def _check_like_default(value, default, annotation, path):
    """Type-check a loss argument against its default (annotations are often strings)."""
    name = path.rsplit(".", 1)[-1]
    if value is None or (default is inspect.Parameter.empty
                         and name not in NONE_DEFAULT_LOSS_ARGS):
        return value
    if default is None or default is inspect.Parameter.empty:
        if name not in NONE_DEFAULT_LOSS_ARGS:
            raise TypeError(f"loss argument {path!r} defaults to None and has no entry in "
                            "NONE_DEFAULT_LOSS_ARGS")  # a bug here, caught by the tests
        tp, low = NONE_DEFAULT_LOSS_ARGS[name]
        value = _convert(value, tp, path)
        if low is not None and value < low:
            raise ConfigError(f"config key '{path}': must be at least {low} (or null for "
                              f"the automatic choice); received {value!r}.")
        return value
    if isinstance(default, bool):
        return _convert(value, bool, path)
    if isinstance(default, int):
        value = _convert(value, int, path)  # 2.0 is 2; 2.5 is refused, never truncated
        LOSS_ARG_RANGES.get(path.rsplit(".", 1)[-1], _INT_RANGE).check(value, path)
        return value
    if isinstance(default, (int, float)):
        return _convert(value, float, path)
    if isinstance(default, str):
        return _convert(value, str, path)
    if isinstance(default, (tuple, list)) and path.rsplit(".", 1)[-1] in VARIABLE_LENGTH_LOSS_ARGS:
        if not isinstance(value, (list, tuple)) or not value:
            raise ConfigError(f"config key '{path}': expected a non-empty list of values like "
                              f"{list(default)!r}, received {value!r}.")
        return tuple(_check_like_default(v, default[0], None, f"{path}[{i}]")
                     for i, v in enumerate(value))
    if isinstance(default, (tuple, list)):
        if not isinstance(value, (list, tuple)) or len(value) != len(default):
            raise ConfigError(
                f"config key '{path}': expected a list of {len(default)} values like "
                f"{list(default)!r}, received {value!r}."
            )
        return tuple(_check_like_default(v, d, None, f"{path}[{i}]")
                     for i, (v, d) in enumerate(zip(value, default)))
    return value


# ---------------------------------------------------------------------------------------
# Cross-field checks
# ---------------------------------------------------------------------------------------


def _check_consistency(cfg: Config) -> list[str]:
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
    if cfg.model.backbone == "small_cnn" and cfg.model.weights == "imagenet":
        raise ConfigError("config key 'model.weights': the small_cnn backbone has no "
                          "ImageNet weights; use null or a file path.")

    for name, keys in OPTIMIZER_PARAMS.items():
        if name == opt.name:
            continue
        for key in keys:
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

    if train.chunk_size is not None:
        if train.chunk_size >= data.batch_size:
            notes.append(
                f"training.chunk_size={train.chunk_size} >= data.batch_size="
                f"{data.batch_size}: multi-stage backpropagation is off, each batch is "
                "one ordinary forward/backward pass.")
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


# ---------------------------------------------------------------------------------------
# Loading and overrides
# ---------------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optimizer.lr=1e-5"`` → (["optimizer", "lr"], 1e-05); the value is YAML."""
    if "=" not in text:
        raise ConfigError(
            f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. "
            "--set optimizer.lr=1e-5 or --set evaluation.ks=[1,10]")
    key, _, value = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {text!r}: the key {key!r} is not a dotted key like "
                          "'training.epochs'.")
    from tfaploss.config.yaml_loader import YAMLLimitError, load_yaml_text

    try:
        parsed = load_yaml_text(value) if value.strip() else None
    except YAMLLimitError as err:
        raise ConfigError(f"--set {key}=...: the value is refused: {err}.") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {text!r}: the value is not valid YAML ({err}).") from None
    return key.split("."), parsed


def apply_overrides(raw: dict, overrides) -> dict:
    """Apply ``dotted.key=value`` strings to a raw config dict (a deep copy is returned)."""
    import copy

    raw = copy.deepcopy(raw) if raw else {}
    for text in overrides or ():
        keys, value = parse_override(text)
        node = raw
        for i, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif isinstance(child, str) and key == "schedule":
                child = node[key] = {"name": child}
            elif not isinstance(child, dict):
                raise ConfigError(
                    f"--set {text!r}: '{'.'.join(keys[:i + 1])}' holds {child!r}, not a "
                    "section, so it has no key "
                    f"{keys[i + 1]!r}.")
            node = child
        node[keys[-1]] = value
    return raw


def _normalise_raw(raw: dict) -> dict:
    opt = raw.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("schedule"), str):
        opt = raw["optimizer"] = dict(opt)
        opt["schedule"] = {"name": opt["schedule"]}
    return raw


def config_from_dict(raw: dict | None, overrides=None, *, warn: bool = True) -> Config:
    """Validate a raw dict (as read from YAML) plus overrides into a :class:`Config`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"a run configuration must be a mapping of sections "
                          f"({', '.join(f.name for f in dataclasses.fields(Config))}); "
                          f"received {_type_name(raw)}.")
    raw = _normalise_raw(apply_overrides(raw, overrides))
    raw.setdefault("loss", {"name": LossConfig.name})  # validate the default loss too
    cfg = _build_dataclass(Config, raw, "")
    for note in _check_consistency(cfg):
        if warn:
            warnings.warn(note, ConfigWarning, stacklevel=3)
    return cfg


def read_config_file(path: str | Path):
    """The raw YAML of a config file, read with :mod:`tfaploss.config.yaml_loader`
    (safe_load semantics, bounded alias expansion, duplicate keys refused); every
    failure is a :class:`ConfigError` naming the file."""
    from tfaploss.config.yaml_loader import MAX_CONFIG_BYTES, YAMLLimitError, load_yaml_text

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; pass a YAML file "
                          "(e.g. one of configs/*.yaml).")
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist (see configs/ for "
                          "the recipes).")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err.strerror or err}."
                          ) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {str(path)!r} is larger than {MAX_CONFIG_BYTES} "
                          "bytes; a run configuration is a short YAML file.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text: byte 0x{data[err.start]:02x} on "
            f"line {line} cannot be decoded. Save the file as UTF-8.") from None
    try:
        return load_yaml_text(text, name=str(path))
    except YAMLLimitError as err:
        raise ConfigError(f"config file {str(path)!r} is refused: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None


def load_config(path: str | Path, overrides=None, *, warn: bool = True) -> Config:
    """Read a YAML run configuration (see :func:`read_config_file`), apply overrides,
    validate."""
    raw = read_config_file(path)
    try:
        return config_from_dict(raw, overrides, warn=warn)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def config_notes(cfg: Config) -> list[str]:
    """The non-fatal remarks validation makes about ``cfg`` (see :class:`ConfigWarning`)."""
    return _check_consistency(cfg)
