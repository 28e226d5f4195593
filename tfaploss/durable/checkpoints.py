"""Crash-safe checkpoints of a training run (:class:`RunBackup`, ``RUN_DIR/backup``):
``epoch-NNNN.weights.h5`` (model + optimizer) and the index ``checkpoint.json`` (its
size and SHA-256). Epoch N is written beside the previous checkpoint, then the index,
and only then is the previous one deleted, so a kill at any moment leaves one complete
checkpoint. What a kill leaves is recovered from with a note; what no kill leaves raises
:class:`DamagedRunError` (docs/reliability.md, "Resuming a damaged run directory")."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from tfaploss.durable import faults
from tfaploss.durable.atomic import (
    atomic_write,
    atomic_write_json,
    fsync_dir,
    remove_temp_files,
    sha256_of,
)

LOG = logging.getLogger(__name__)

_CHECKPOINT_RE = re.compile(r"^epoch-(\d{4,})\.weights\.h5$")
INDEX_NAME = "checkpoint.json"
# A step checkpoint, written when the run is preempted mid-epoch: epoch E in progress,
# S of its batches done. At most one is kept; an epoch checkpoint supersedes it.
_STEP_RE = re.compile(r"^partial-epoch-(\d{4,})-step-(\d{6,})\.weights\.h5$")
STEP_INDEX_NAME = "step.json"
TRASH_PREFIX = ".backup-trash-"  # a finished run's backup, renamed aside to be deleted


class DamagedRunError(RuntimeError):
    """A file of a run directory (``path``) is damaged in a way no kill leaves; the
    message gives ``problem`` and both ways out: ``fix``, or ``--restart``."""

    def __init__(self, path: str | os.PathLike, problem: str, fix: str | None = None):
        self.path = Path(path)
        self.problem = problem
        self.fix = fix or "repair or remove that file"
        super().__init__(
            f"damaged run directory: {self.path} {problem}. No kill leaves this, so the "
            f"run neither resumes nor starts over by itself. Either {self.fix}, and run "
            "the same command again; or start over at epoch 1 with --restart "
            "(train(..., restart=True)), which moves the run's files aside into "
            "damaged-<time>/ in the run directory (never deletes them).")


def log_line(line: str) -> None:
    """:class:`RunBackup`'s default ``log``: ``warning: ...`` at WARNING, else INFO."""
    LOG.log(logging.WARNING if line.startswith("warning:") else logging.INFO, "%s", line)


def _h5_readable(path: Path) -> str | None:
    """None if every dataset of the HDF5 file reads back, else what went wrong."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            def read(_, obj):
                if isinstance(obj, h5py.Dataset):
                    obj[()]
            f.visititems(read)
    except (OSError, KeyError, RuntimeError, ValueError) as err:  # what h5py raises
        return f"{type(err).__name__}: {err}"
    return None


def read_latest(index: Path) -> dict | None:
    """The ``latest`` record of a checkpoint index; None when missing or unreadable."""
    try:
        with open(index, encoding="utf-8") as f:
            latest = json.load(f)["latest"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return latest if isinstance(latest, dict) else None


def weights_bytes(model, factor: float = 1.0) -> int:
    """The bytes of ``model``'s and its optimizer's variables (``save_weights`` writes
    both) x ``factor``, + 4 KB per variable and 64 KB for HDF5's overhead (measured in
    docs/reliability.md, "Full disks")."""
    import numpy as np

    weights = list(getattr(model, "weights", []))
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        seen = {id(w) for w in weights}
        weights += [v for v in optimizer.variables if id(v) not in seen]
    raw = sum(int(np.prod(w.shape)) * np.dtype(getattr(w.dtype, "name", w.dtype)).itemsize
              for w in weights)
    return int(raw * factor) + 4096 * len(weights) + 65536


class RunBackup:
    """Per-epoch checkpoints of a model and its optimizer in ``directory``; ``log`` gets
    one line per fallback or clean-up. Cost of a save: one ``model.save_weights`` and
    one read for its SHA-256; the disk holds two checkpoints for a moment."""

    def __init__(self, directory: str | os.PathLike,
                 log: Callable[[str], None] | None = None):
        self.directory = Path(directory)
        self.log = log or log_line

    def checkpoint_path(self, epoch: int) -> Path:
        return self.directory / f"epoch-{epoch:04d}.weights.h5"

    @property
    def index_path(self) -> Path:
        return self.directory / INDEX_NAME

    def _files(self, pattern, key) -> dict:
        if not self.directory.is_dir():
            return {}
        found = {}
        for entry in self.directory.iterdir():
            match = pattern.match(entry.name)
            if match and entry.is_file():
                found[key(match)] = entry
        return dict(sorted(found.items()))

    def checkpoints(self) -> dict[int, Path]:
        """Complete-named checkpoint files, by epoch (newest last)."""
        return self._files(_CHECKPOINT_RE, lambda m: int(m.group(1)))

    def _write(self, model, path: Path, index: Path, record: dict, fault: str) -> None:
        """``model``'s weights to ``path``, then its record (size, SHA-256) to ``index``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        epoch = record["epoch"]
        atomic_write(path, lambda tmp: model.save_weights(tmp), fault=f"{fault}checkpoint",
                     epoch=epoch, needed=self.expected_bytes(model))
        record = {**record, "file": path.name, "bytes": path.stat().st_size,
                  "sha256": sha256_of(path)}
        atomic_write_json(index, {"format": 1, "latest": record}, fault=f"{fault}metadata",
                          epoch=epoch)

    def save(self, model, epoch: int, extra: dict | None = None) -> Path:
        """Checkpoint ``model`` after ``epoch`` (1-based) and drop the previous one."""
        path = self.checkpoint_path(epoch)
        self._write(model, path, self.index_path, {"epoch": epoch, **(extra or {})}, "")
        faults.point("prune", epoch)
        for older, old_path in self.checkpoints().items():
            if older != epoch:
                old_path.unlink()
        self._remove_steps()  # superseded: this epoch is complete
        faults.point("after_checkpoint", epoch)
        return path

    def expected_bytes(self, model=None) -> int | None:
        """What the next checkpoint will take: the largest one's size x 1.2 + 4 KB;
        before the first, :func:`weights_bytes` of ``model`` (None without one)."""
        sizes = [p.stat().st_size for p in [*self.checkpoints().values(),
                                            *self.steps().values()]]
        if sizes:
            return int(max(sizes) * 1.2) + 4096
        if model is None:
            return None
        return weights_bytes(model, 1.2)

    def step_path(self, epoch: int, step: int) -> Path:
        """The step checkpoint of ``step`` batches done in epoch ``epoch`` (1-based)."""
        return self.directory / f"partial-epoch-{epoch:04d}-step-{step:06d}.weights.h5"

    @property
    def step_index_path(self) -> Path:
        return self.directory / STEP_INDEX_NAME

    def steps(self) -> dict[tuple[int, int], Path]:
        """Step checkpoint files, by (epoch in progress, batches done), newest last."""
        return self._files(_STEP_RE, lambda m: (int(m.group(1)), int(m.group(2))))

    def _remove_steps(self, keep: Path | None = None) -> list[str]:
        removed = []
        for path in self.steps().values():
            if path != keep:
                path.unlink()
                removed.append(path.name)
        if keep is None and self.step_index_path.is_file():
            self.step_index_path.unlink()
            removed.append(self.step_index_path.name)
        return removed

    def save_step(self, model, epoch: int, step: int, extra: dict | None = None) -> Path:
        """Checkpoint ``model`` after ``step`` batches of epoch ``epoch`` (1-based), what
        a preempted run resumes from; replaces any older step checkpoint."""
        path = self.step_path(epoch, step)
        self._write(model, path, self.step_index_path,
                    {"epoch": epoch, "step": step, **(extra or {})}, "step_")
        self._remove_steps(keep=path)
        return path

    def _read_step_index(self) -> dict | None:
        latest = read_latest(self.step_index_path)
        try:
            return {k: latest[k] for k in ("epoch", "step", "file", "bytes", "sha256")}
        except (KeyError, TypeError):
            return None  # missing or torn: the file itself is checked instead

    def find_step(self, done: int) -> tuple[int, Path | None]:
        """``(step, path)`` of the step checkpoint of epoch ``done + 1`` (``done``: the
        newest epoch checkpoint's, 0 for none), checked complete, or ``(0, None)``.
        Superseded ones are removed with a note; :class:`DamagedRunError` when it is
        damaged or of a later epoch than the epoch checkpoints account for."""
        found = self.steps()
        stale = [p for (e, _), p in found.items() if e <= done]
        for path in stale:
            path.unlink()
        if stale:
            self.log(f"note: removed {len(stale)} step checkpoint(s) that the checkpoint "
                     f"of epoch {done} supersedes: {', '.join(p.name for p in stale)}")
        current = {s: p for (e, s), p in found.items() if e == done + 1}
        later = [p for (e, _), p in found.items() if e > done + 1]
        if later:
            raise DamagedRunError(
                later[-1], f"is a step checkpoint of a later epoch than the newest epoch "
                f"checkpoint ({done or 'none'}) accounts for (the checkpoints between "
                "are missing)", f"put back the missing checkpoints, or remove it and "
                f"{self.step_index_path.name}")
        if not current:
            self._remove_steps()  # no step file is left: this removes a stale index
            return 0, None
        step = max(current)
        path = current[step]
        latest = self._read_step_index()
        problem = self._problem(path, latest if latest and latest["file"] == path.name
                                else None)
        if problem is not None:
            raise DamagedRunError(path, problem, f"remove it and {self.step_index_path.name} "
                                  f"to resume from the start of epoch {done + 1}")
        return step, path

    def _read_index(self) -> dict | None:
        """The index's checked record of the latest checkpoint, or None when missing or
        unreadable (a crash can tear it: the checkpoint files are checked instead)."""
        if not self.index_path.exists():
            return None
        try:
            if self.index_path.stat().st_size > 1 << 20:
                raise ValueError("far larger than an index")
            with open(self.index_path, encoding="utf-8") as f:
                latest = json.load(f)["latest"]
            record = {k: latest[k] for k in ("epoch", "file", "bytes", "sha256")}
            if not (type(record["epoch"]) is int and record["epoch"] >= 1
                    and type(record["bytes"]) is int and record["bytes"] >= 0
                    and isinstance(record["file"], str)
                    and isinstance(record["sha256"], str)
                    and re.fullmatch(r"[0-9a-f]{64}", record["sha256"])):
                raise ValueError(f"not a checkpoint record: {latest!r:.200}")
            return record
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
            size = self.index_path.stat().st_size
            self.log(f"note: {self.index_path} is unreadable ({size} bytes; "
                     f"{type(err).__name__}: {str(err)[:200]}); checking the checkpoint "
                     "files themselves instead")
            return None

    def _problem(self, path: Path, latest: dict | None) -> str | None:
        try:
            size = path.stat().st_size
            if latest is not None and latest["file"] == path.name:
                if size != latest["bytes"]:
                    return (f"has {size} bytes, but {latest['bytes']} were written (a "
                            f"checkpoint cut short{', emptied' if size == 0 else ''} or "
                            "grown)")
                if sha256_of(path) != latest["sha256"]:
                    return ("does not match the SHA-256 recorded when it was written "
                            "(its bytes were altered)")
                return None
            if size == 0:
                return "is empty (0 bytes)"
        except OSError as err:
            return f"cannot be read ({type(err).__name__}: {err})"
        problem = _h5_readable(path)
        return f"is not a readable checkpoint ({problem})" if problem else None

    def _check_types(self) -> None:
        if self.directory.exists() and not self.directory.is_dir():
            raise DamagedRunError(self.directory, "is a file, not the backup folder")
        if self.index_path.exists() and not self.index_path.is_file():
            raise DamagedRunError(self.index_path, "is a folder, not the checkpoint index")
        for entry in self.directory.iterdir():
            if _CHECKPOINT_RE.match(entry.name) and not entry.is_file():
                raise DamagedRunError(entry, "is a folder, not a checkpoint file")

    def find(self) -> tuple[int, Path | None]:
        """``(epoch, path)`` of the newest checkpoint, checked complete, or ``(0, None)``.
        Raises :class:`DamagedRunError` when it (or the backup) is damaged: no older
        checkpoint is taken in its place."""
        if not self.directory.exists():
            return 0, None
        self._check_types()
        removed = remove_temp_files(self.directory)
        if removed:
            self.log(f"note: removed {len(removed)} unfinished file(s) a killed run left "
                     f"in {self.directory}: {', '.join(sorted(removed))}")
        latest = self._read_index()
        candidates = self.checkpoints()
        newest = max(candidates, default=0)
        if latest is not None and latest["epoch"] > newest:
            raise DamagedRunError(
                self.index_path,
                f"names {latest['file']} (epoch {latest['epoch']}), which is not in "
                f"{self.directory}" + (f" (the newest checkpoint there is of epoch {newest})"
                                       if newest else " (no checkpoint is)"),
                f"put {latest['file']} back" + (
                    f", or remove {self.index_path} to resume from "
                    f"{candidates[newest].name} (after epoch {newest}; the epochs after it "
                    "are trained again)" if newest else ""))
        if not newest:
            return 0, None
        path = candidates[newest]
        problem = self._problem(path, latest)
        if problem is not None:
            older = [e for e in sorted(candidates, reverse=True)[1:]
                     if self._problem(candidates[e], None) is None]
            fix = (f"remove it and {self.index_path} to resume from "
                   f"{candidates[older[0]].name} (after epoch {older[0]}; the epochs after "
                   "it are trained again)" if older
                   else "put back a copy of it, if you have one")
            raise DamagedRunError(path, problem, fix)
        if latest is not None and latest["epoch"] != newest:
            self.log(f"note: {INDEX_NAME} is stale (it names epoch {latest['epoch']}); "
                     f"{path.name} is complete, resuming after epoch {newest}")
        return newest, path

    def restore(self, model, found: tuple[int, Path | None] | None = None) -> int:
        """Load the newest checkpoint (``found``: :meth:`find`'s result, if known) into
        the built, compiled ``model``; returns its epoch (0: none). Raises
        :class:`DamagedRunError` when it is damaged or does not load."""
        epoch, path = found if found is not None else self.find()
        if path is None:
            return 0
        if getattr(model, "optimizer", None) is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        try:
            model.load_weights(str(path))
        except Exception as err:  # noqa: BLE001 - whatever the file makes the loader raise
            raise DamagedRunError(
                path, f"does not load into this run's model ({type(err).__name__}: "
                f"{str(err)[:300]})", "put back a copy of it, if you have one") from None
        return epoch

    def discard(self) -> None:
        """Delete the backup of a complete run, renamed aside first so that a kill never
        leaves a half-deleted backup that looks resumable."""
        if not self.directory.is_dir():
            return
        trash = self.directory.with_name(f"{TRASH_PREFIX}{os.getpid()}")
        os.replace(self.directory, trash)
        fsync_dir(self.directory.parent)
        faults.point("backup_delete")
        shutil.rmtree(trash, ignore_errors=True)

    @staticmethod
    def remove_trash(run_dir: str | os.PathLike) -> None:
        """Finish deleting backups a kill interrupted :meth:`discard` on."""
        run_dir = Path(run_dir)
        if run_dir.is_dir():
            for entry in run_dir.iterdir():
                if entry.name.startswith(TRASH_PREFIX) and entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
