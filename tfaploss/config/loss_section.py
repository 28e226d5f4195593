"""The ``loss`` section: a class of :mod:`tfaploss.losses` (``name``) and its constructor
arguments, checked against its signature when the config is loaded. Listing the classes
imports :mod:`tfaploss.losses` (and Keras) inside the functions only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from tfaploss.config.convert import close_match, convert, fail
from tfaploss.config.fields import MAX_BATCH, ConfigError, Range

__all__ = ["MULTI_LEVEL_LOSSES", "NONE_DEFAULT_LOSS_ARGS", "LossConfig", "loss_class",
           "loss_classes", "loss_defaults", "loss_parameters"]


@dataclass
class LossConfig:
    """A class of :mod:`tfaploss.losses` (``name``) and its constructor arguments."""

    name: str = "APLoss"
    kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_raw(cls, raw: dict, path: str) -> LossConfig:
        """The section read from YAML, checked against the named class's signature;
        :func:`tfaploss.config.convert.build_dataclass` calls it."""
        return _build_loss(raw, path)

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
            f"{close_match(name, classes)} Available: "
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


def loss_defaults(name: str) -> dict:
    """Constructor defaults of the loss class ``name`` that a config may set."""
    return {key: param.default for key, param in loss_parameters(loss_class(name)).items()
            if param.default is not inspect.Parameter.empty}


def _build_loss(raw: dict, path: str) -> LossConfig:
    if not isinstance(raw, dict):
        fail(path, raw, dict)
    raw = dict(raw)
    if "name" not in raw:
        raise ConfigError(
            f"config key '{path}.name' is missing: name a loss class of tfaploss.losses "
            f"(available: {', '.join(sorted(loss_classes())) or '(none yet)'})."
        )
    name = convert(raw.pop("name"), str, f"{path}.name")
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
                f"{close_match(str(key), params)} Allowed: {', '.join(params) or '(none)'}."
            )
        kwargs[key] = _check_like_default(value, params[key].default, where)
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


def _check_like_default(value, default, path):
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
        value = convert(value, tp, path)
        if low is not None and value < low:
            raise ConfigError(f"config key '{path}': must be at least {low} (or null for "
                              f"the automatic choice); received {value!r}.")
        return value
    if isinstance(default, bool):
        return convert(value, bool, path)
    if isinstance(default, int):
        value = convert(value, int, path)  # 2.0 is 2; 2.5 is refused, never truncated
        LOSS_ARG_RANGES.get(name, _INT_RANGE).check(value, path)
        return value
    if isinstance(default, (int, float)):
        return convert(value, float, path)
    if isinstance(default, str):
        return convert(value, str, path)
    if isinstance(default, (tuple, list)) and name in VARIABLE_LENGTH_LOSS_ARGS:
        if not isinstance(value, (list, tuple)) or not value:
            raise ConfigError(f"config key '{path}': expected a non-empty list of values like "
                              f"{list(default)!r}, received {value!r}.")
        return tuple(_check_like_default(v, default[0], f"{path}[{i}]")
                     for i, v in enumerate(value))
    if isinstance(default, (tuple, list)):
        if not isinstance(value, (list, tuple)) or len(value) != len(default):
            raise ConfigError(
                f"config key '{path}': expected a list of {len(default)} values like "
                f"{list(default)!r}, received {value!r}."
            )
        return tuple(_check_like_default(v, d, f"{path}[{i}]")
                     for i, (v, d) in enumerate(zip(value, default)))
    return value
