"""Whether a run directory holds this config's run: the config comparison (which needs
the schema, to fill in keys added since) over :mod:`tfaploss.durable.run_dir`'s file
checks."""

from __future__ import annotations

import contextlib
from pathlib import Path

from tfaploss.config.fields import ConfigError
from tfaploss.config.load import config_from_dict
from tfaploss.config.schema import Config
from tfaploss.durable import run_dir as files
from tfaploss.durable.run_dir import RunState

__all__ = ["diff_keys", "inspect"]


def inspect(run_dir: Path, cfg: Config) -> RunState:
    """Check every file of ``run_dir`` (:func:`tfaploss.durable.run_dir.inspect`) and
    that a previous run there ran ``cfg``; returns what the run resumes from. Raises
    :class:`~tfaploss.durable.checkpoints.DamagedRunError` or ConfigError."""
    current = _comparable(cfg.to_dict())

    def check_config(previous, what: str) -> None:
        previous = _comparable(previous)
        if previous != current:
            changed = sorted(diff_keys(previous, current))
            raise ConfigError(
                f"run_dir {str(run_dir)!r} holds {what} made with a different config "
                f"(differs in: {', '.join(changed[:12])}{', ...' if len(changed) > 12 else ''})"
                ". Resume it with the same config, use a new run_dir (--set run_dir=...), or "
                "start over here with --restart (the previous run's files are moved aside, "
                "not deleted).")

    return files.inspect(run_dir, cfg.training.epochs, check_config)


def _comparable(raw):
    """A config as compared with a run's: every default filled in (unless invalid),
    without ``run_dir`` (a moved run directory still resumes) and
    ``training.distribute.timeout_s`` (not what ranks train)."""
    if not isinstance(raw, dict):
        return raw
    with contextlib.suppress(ConfigError, TypeError, ValueError, KeyError, AttributeError,
                             RecursionError, OverflowError):
        raw = config_from_dict(raw, warn=False).to_dict()
    out = {k: v for k, v in raw.items() if k != "run_dir"}
    distribute = (out.get("training") or {}).get("distribute")
    if isinstance(distribute, dict) and "timeout_s" in distribute:
        out["training"] = {**out["training"], "distribute": {
            k: v for k, v in distribute.items() if k != "timeout_s"}}
    return out


def diff_keys(a, b, prefix=""):
    """The dotted keys where two config dicts differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in set(a) | set(b):
            yield from diff_keys(a.get(key), b.get(key), f"{prefix}{key}.")
    elif a != b:
        yield prefix.rstrip(".")
