"""The checks of a run directory before a run uses it (:func:`inspect`: what a kill
leaves is recovered from, anything else raises
:class:`~tfaploss.durable.checkpoints.DamagedRunError`; docs/reliability.md) and
``--restart`` (:func:`move_aside`). The config comparison is the caller's
(:mod:`tfaploss.run.resume`): this module reads files only."""

from __future__ import annotations

import json
import logging
import math
import os
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tfaploss.durable.atomic import fsync_dir, is_temp_name
from tfaploss.durable.checkpoints import TRASH_PREFIX, DamagedRunError, RunBackup

LOG = logging.getLogger(__name__)

# A run folder's entries: named here only, so that the trainer writes what resume reads.
CONFIG, EPOCH_LOG, MODEL, SUMMARY = "config.yaml", "epochs.jsonl", "model.keras", "summary.json"
BACKUP, LOGS = "backup", "logs"
FILES = (CONFIG, EPOCH_LOG, MODEL, SUMMARY)
FOLDERS = (BACKUP, LOGS)
RUN_ENTRIES = FILES + FOLDERS  # what --restart moves aside, with temporary files and eval_*

_MAX_CONFIG_BYTES = 1 << 20  # a run's config.yaml is a few kilobytes
_MAX_SUMMARY_BYTES = 64 << 20
_FLOAT32_MAX = 3.4028234663852886e38  # no logged value is larger: Keras logs float32
_ROW_START = b'{"epoch": '  # every epoch row starts so (json.dumps, "epoch" first)


@dataclass
class RunState:
    """What :func:`inspect` found: a finished run's summary, or what to resume from."""

    finished: dict | None = None
    resuming: bool = False
    checkpoint: tuple[int, Path | None] = (0, None)
    # A preempted run's step checkpoint: (batches done of epoch checkpoint[0] + 1, path).
    step: tuple[int, Path | None] = (0, None)
    rows: list[dict] = field(default_factory=list)


def _kind(value) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing",
            bool: "a boolean", int: "a number", float: "a number"}.get(type(value),
                                                                       type(value).__name__)


def read_config_snapshot(path: Path) -> dict | None:
    """``config.yaml`` of a previous run (a mapping), None if there is none."""
    if not path.exists():
        return None
    if not path.is_file():
        raise DamagedRunError(path, "is a folder, not the run's config file",
                              "remove it (the run's config is written again)")
    try:
        size = path.stat().st_size
        if size > _MAX_CONFIG_BYTES:
            raise DamagedRunError(path, f"holds {size} bytes; a run config is a few KB")
        text = path.read_bytes().decode("utf-8")
        raw = yaml.safe_load(text)
    except UnicodeDecodeError as err:
        raise DamagedRunError(path, f"is not UTF-8 text (byte {err.start} is "
                                    f"{err.object[err.start:err.start + 1]!r})") from None
    except yaml.YAMLError as err:
        raise DamagedRunError(path, "is not YAML (" + " ".join(str(err).split())[:200]
                              + ")") from None
    except RecursionError:
        raise DamagedRunError(path, "nests too deeply to be a run config") from None
    except OSError as err:
        raise DamagedRunError(path, f"cannot be read ({type(err).__name__}: {err})") from None
    except (ValueError, OverflowError, TypeError) as err:  # e.g. an integer of 5000 digits
        raise DamagedRunError(path, f"holds a value no run config holds ({type(err).__name__}"
                                    f": {str(err)[:120]})") from None
    if not isinstance(raw, dict):
        raise DamagedRunError(path, f"holds {_kind(raw)}, not a mapping of config keys")
    return raw


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number an epoch row holds")


def _bad_number(value, where: str = "") -> str | None:
    """The first non-finite or absurd number in a row (None: all fine)."""
    stack = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, dict):
            stack.extend((x, f"{at}.{k}" if at else str(k)) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            if isinstance(v, float) and not math.isfinite(v):
                return f"{at or 'a value'} is {v} (too large to be a float)"
            if abs(v) > _FLOAT32_MAX:
                return (f"{at or 'a value'} is {v:.3g}, beyond any value a run logs "
                        "(float32: 3.4e38)")
    return None


def read_epoch_log(path: Path, epochs: int) -> list[dict]:
    """The checked rows of ``epochs.jsonl`` as written, a last line a kill cut short
    left out; :class:`DamagedRunError` on the first damaged line."""
    if not path.exists():
        return []
    if not path.is_file():
        raise DamagedRunError(path, "is a folder, not the epoch log")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DamagedRunError(path, f"cannot be read ({type(err).__name__}: {err})") from None
    end = data.rfind(b"\n") + 1
    tail = data[end:]
    if tail and tail.strip(b"\0") and not _ROW_START.startswith(tail[:len(_ROW_START)]):
        raise DamagedRunError(
            path, f"ends in {len(tail)} bytes that do not start an epoch row "
            f"({tail[:40]!r}): not what a kill in the middle of a write leaves",
            "remove that last line")
    rows, top = [], 0
    fix_line = "remove or repair that line"
    for number, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        def damaged(problem, fix=fix_line, number=number):
            return DamagedRunError(path, f"line {number}: {problem}", fix)

        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise damaged(f"is not UTF-8 text (byte {err.start} is "
                          f"{line[err.start:err.start + 1]!r})") from None
        try:
            row = json.loads(text, parse_constant=_reject_constant)
        except RecursionError:
            raise damaged("nests too deeply to be an epoch row") from None
        except ValueError as err:
            raise damaged(f"is not JSON ({str(err)[:120]})") from None
        if not isinstance(row, dict):
            raise damaged(f"holds {_kind(row)}, not an epoch row (a JSON object)")
        bad = _bad_number(row)
        if bad:
            raise damaged(bad)
        epoch = row.get("epoch")
        if type(epoch) is not int:
            raise damaged(f"the epoch is {epoch!r:.40}, not a whole number")
        if not 1 <= epoch <= epochs:
            raise damaged(f"epoch {epoch} is outside 1..{epochs} (training.epochs)")
        if epoch > top + 1:
            raise damaged(f"epoch {epoch} follows epoch {top}: "
                          + (f"epoch {top + 1} is" if epoch == top + 2 else
                             f"epochs {top + 1}-{epoch - 1} are") + " missing")
        if epoch < top:
            raise damaged(f"epoch {epoch} comes after epoch {top} (out of order: a resumed "
                          "run repeats only the epoch a kill interrupted)")
        top = max(top, epoch)
        rows.append(row)
    return rows


def _read_summary(path: Path) -> dict | None:
    if not path.exists():
        return None
    if not path.is_file():
        raise DamagedRunError(path, "is a folder, not the run's summary")
    try:
        if path.stat().st_size > _MAX_SUMMARY_BYTES:
            raise ValueError("far larger than a run summary")
        summary = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise DamagedRunError(path, f"is not UTF-8 text (byte {err.start})") from None
    except (ValueError, RecursionError) as err:
        raise DamagedRunError(path, f"is not JSON ({str(err)[:120]})") from None
    except OSError as err:
        raise DamagedRunError(path, f"cannot be read ({type(err).__name__}: {err})") from None
    if not isinstance(summary, dict):
        raise DamagedRunError(path, f"holds {_kind(summary)}, not a run summary")
    return summary


def inspect(run_dir: Path, epochs: int,
            check_config: Callable[[object, str], None]) -> RunState:
    """Check every file of ``run_dir`` against what a run, killed or not, leaves there;
    returns what the run resumes from, or raises :class:`DamagedRunError`.

    ``epochs``: ``training.epochs``. ``check_config(config, what)`` gets the config a
    previous run recorded and ``"an unfinished run"`` or ``"a finished run"``, and
    raises when it is not this run's.
    """
    for name in FILES:
        if (run_dir / name).is_dir():
            raise DamagedRunError(run_dir / name, "is a folder, not a file",
                                  "remove it, or put the file back")
    for name in FOLDERS:
        if (run_dir / name).exists() and not (run_dir / name).is_dir():
            raise DamagedRunError(run_dir / name, "is a file, not a folder",
                                  "remove it, or put the folder back")
    previous = read_config_snapshot(run_dir / CONFIG)
    summary = _read_summary(run_dir / SUMMARY)
    model = run_dir / MODEL
    backup = RunBackup(run_dir / BACKUP)
    resuming = backup.directory.is_dir()
    if not resuming and (summary is not None or model.exists()):
        return RunState(finished=_finished(run_dir, epochs, check_config, summary, model))
    if resuming and previous is not None:
        check_config(previous, "an unfinished run")
    log = run_dir / EPOCH_LOG
    rows = read_epoch_log(log, epochs)
    checkpoint = backup.find() if resuming else (0, None)
    done, top = checkpoint[0], max((row["epoch"] for row in rows), default=0)
    if top > done + 1:
        where = (f"the newest checkpoint in {backup.directory} is of epoch {done}" if done
                 else f"there is no checkpoint in {backup.directory}" if resuming
                 else f"there is no checkpoint ({backup.directory} is missing)")
        raise DamagedRunError(
            log, f"records {top} finished epochs, but {where}: the checkpoints of "
            f"epochs {done + 1}-{top - 1} are missing (a kill loses at most one epoch)",
            f"put back the backup folder of this run, or remove the rows after epoch "
            f"{done} from {log.name} to resume after epoch {done}")
    if top < done:
        raise DamagedRunError(
            log, ("is missing" if not log.exists() else f"records {top} finished epochs")
            + f", but the checkpoint {checkpoint[1]} is of epoch {done}: rows are missing "
            "(each epoch is logged before its checkpoint is written)",
            "put back the epoch log of this run")
    step = backup.find_step(done) if resuming else (0, None)
    return RunState(resuming=resuming, checkpoint=checkpoint, step=step, rows=rows)


def _finished(run_dir: Path, epochs: int, check_config, summary: dict | None,
              model: Path) -> dict:
    if summary is None:
        raise DamagedRunError(
            run_dir / SUMMARY, f"is missing, but {model.name} is there and no "
            "backup: a finished run whose summary was removed",
            "put summary.json back")
    if not model.exists():
        raise DamagedRunError(model, "is missing, but summary.json describes a finished "
                                     "run", "put model.keras back")
    if not zipfile.is_zipfile(model):
        raise DamagedRunError(model, f"is not a Keras model file ({model.stat().st_size} "
                                     "bytes, not a complete .keras archive)",
                              "put back a copy of it, if you have one")
    check_config(summary.get("config"), "a finished run")
    completed = summary.get("epochs_completed")
    if completed != epochs and not summary.get("stopped_early"):
        raise DamagedRunError(
            run_dir / SUMMARY, f"says {completed!r:.20} of {epochs} "
            "epochs were completed, but there is no backup to resume from",
            "put back the backup folder of this run")
    return summary


def _entries(run_dir: Path) -> list[Path]:
    return [entry for entry in sorted(run_dir.iterdir())
            if entry.name in RUN_ENTRIES or is_temp_name(entry.name)
            or entry.name.startswith(TRASH_PREFIX)
            or (entry.name.startswith("eval_") and entry.is_dir())]


def move_aside(run_dir: Path, damaged: bool) -> tuple[Path | None, list[str]]:
    """Move the previous run's files into ``run_dir/damaged-<time>/`` (else
    ``previous-<time>/``); returns the folder and the names moved, or ``(None, [])``."""
    entries = _entries(run_dir)
    if not entries:
        return None, []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{'damaged' if damaged else 'previous'}-{stamp}"
    aside, k = run_dir / base, 1
    while aside.exists():
        k += 1
        aside = run_dir / f"{base}-{k}"
    aside.mkdir()
    for entry in entries:
        os.replace(entry, aside / entry.name)
    fsync_dir(run_dir)
    return aside, [e.name + ("/" if (aside / e.name).is_dir() else "") for e in entries]
