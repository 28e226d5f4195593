"""``training.callbacks``: the user's Keras callbacks, named by import path.

Each entry is ``module.Class`` or ``{class: module.Class, kwargs: {...}}``::

    training:
      callbacks:
        - class: keras.callbacks.EarlyStopping
          kwargs: {monitor: val_map@r, mode: max, patience: 3}

The path is imported and its arguments bound when the config is loaded, so a typo fails
before any training. ``tfaploss train`` adds each after the retrieval evaluation, so it
sees the ``val_*`` logs.
"""

from __future__ import annotations

import importlib
import inspect
import sys

from tfaploss.config.fields import ConfigError

__all__ = ["build_callback", "callback_spec", "check_callbacks"]

_KEYS = ("class", "kwargs")


def callback_spec(entry, where: str) -> tuple[str, dict]:
    """``(import path, kwargs)`` of one entry of ``training.callbacks``."""
    if isinstance(entry, str):
        path, kwargs = entry, {}
    elif isinstance(entry, dict):
        unknown = sorted(set(map(str, entry)) - set(_KEYS))
        if unknown or "class" not in entry:
            raise ConfigError(
                f"config key '{where}': a callback is an import path ('module.Class') or "
                f"a mapping with the keys 'class' and optionally 'kwargs'; received "
                f"{entry!r}.")
        path, kwargs = entry["class"], entry.get("kwargs") or {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ConfigError(f"config key '{where}.kwargs': expected a mapping of "
                              f"argument names to values; received {kwargs!r}.")
    else:
        raise ConfigError(f"config key '{where}': expected an import path "
                          f"('module.Class') or a mapping; received {entry!r}.")
    if not isinstance(path, str) or "." not in path.strip(".") or " " in path:
        raise ConfigError(f"config key '{where}': {path!r} is not an import path; write "
                          "'module.Class' (e.g. keras.callbacks.EarlyStopping).")
    return path, dict(kwargs)


def _resolve(path: str, where: str):
    module_name, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"config key '{where}': {path!r} cannot be imported: module "
                          f"{module_name!r} not found ({err}). Is it installed, or on "
                          "PYTHONPATH?") from None
    except Exception as err:  # noqa: BLE001 - the user's module failed while importing
        raise ConfigError(f"config key '{where}': importing {module_name!r} for {path!r} "
                          f"failed: {type(err).__name__}: {err}") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise ConfigError(f"config key '{where}': {path!r} not found: module "
                          f"{module_name!r} has no attribute {name!r}.") from None


def _checked_target(entry, where: str) -> tuple[str, dict, object]:
    """``(import path, kwargs, the class)`` of one entry, refused unless the class is a
    callback that takes those kwargs."""
    path, kwargs = callback_spec(entry, where)
    target = _resolve(path, where)
    if not callable(target):
        raise ConfigError(f"config key '{where}': {path!r} is a {type(target).__name__}, "
                          "not a callback class.")
    keras = sys.modules.get("keras")  # loaded by the user's module if it needs Keras
    if (keras is not None and isinstance(target, type)
            and not issubclass(target, keras.callbacks.Callback)):
        raise ConfigError(f"config key '{where}': {path!r} is not a "
                          "keras.callbacks.Callback subclass.")
    try:
        inspect.signature(target).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"config key '{where}.kwargs': {path} does not take "
                          f"{kwargs!r}: {err}.") from None
    except ValueError:
        pass  # no signature to check (a builtin): its call will say
    return path, kwargs, target


def check_callbacks(entries, path: str = "training.callbacks") -> None:
    """Refuse, with the key and value, an entry that is not an importable callback
    taking its kwargs (at load time)."""
    for i, entry in enumerate(entries):
        _checked_target(entry, f"{path}[{i}]")


def build_callback(entry, where: str):
    """The callback of one entry of ``training.callbacks``, built with its kwargs."""
    name, kwargs, target = _checked_target(entry, where)
    callback = target(**kwargs)
    keras = sys.modules.get("keras")
    if keras is not None and not isinstance(callback, keras.callbacks.Callback):
        raise ConfigError(f"config key '{where}': {name}(...) returned a "
                          f"{type(callback).__name__}, not a keras.callbacks.Callback.")
    return callback
