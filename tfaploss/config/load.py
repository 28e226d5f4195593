"""Loading a run configuration: the YAML read safely, ``--set`` overrides applied
(``dotted.key=value``, the value parsed as YAML), the result checked into a
:class:`~tfaploss.config.schema.Config`::

    cfg = load_config("recipe:smoothap_sop_resnet50", overrides=["training.epochs=3"])
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import yaml

from tfaploss.config.consistency import ConfigWarning, check_consistency
from tfaploss.config.convert import build_dataclass, type_name
from tfaploss.config.fields import ConfigError
from tfaploss.config.loss_section import LossConfig
from tfaploss.config.recipes import resolve_config_path
from tfaploss.config.schema import Config

__all__ = ["apply_overrides", "config_from_dict", "config_notes", "load_config", "parse_override",
           "read_config_file"]


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
                          f"received {type_name(raw)}.")
    raw = _normalise_raw(apply_overrides(raw, overrides))
    raw.setdefault("loss", {"name": LossConfig.name})  # validate the default loss too
    cfg = build_dataclass(Config, raw, "")
    for note in check_consistency(cfg):
        if warn:
            warnings.warn(note, ConfigWarning, stacklevel=3)
    return cfg


def read_config_file(path: str | Path):
    """The raw YAML of a config file or ``recipe:NAME`` (:mod:`tfaploss.config.yaml_loader`);
    every failure is a :class:`ConfigError` naming the file."""
    from tfaploss.config.yaml_loader import MAX_CONFIG_BYTES, YAMLLimitError, load_yaml_text

    path = resolve_config_path(path)
    shown = f"config file {str(path)!r}"
    if path.is_dir():
        raise ConfigError(f"{shown} is a directory; pass a YAML file, or recipe:NAME for a "
                          "shipped recipe (`tfaploss recipes` lists them).")
    if not path.exists():
        raise ConfigError(f"{shown} does not exist. For a shipped recipe pass --config "
                          "recipe:NAME (`tfaploss recipes` lists them).")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{shown} cannot be read: {err.strerror or err}.") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{shown} is larger than {MAX_CONFIG_BYTES} bytes; a run "
                          "configuration is a short YAML file.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ConfigError(f"{shown} is not UTF-8 text: byte 0x{data[err.start]:02x} on line "
                          f"{line} cannot be decoded. Save the file as UTF-8.") from None
    try:
        return load_yaml_text(text, name=str(path))
    except YAMLLimitError as err:
        raise ConfigError(f"{shown} is refused: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{shown} is not valid YAML: {err}") from None


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
    return check_consistency(cfg)
