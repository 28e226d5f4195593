"""Crash-safe checkpoints for a training run: a kill at any moment loses at most one epoch.

Every file is written the same way (:func:`atomic_write`): to a temporary name in the
same folder, flushed to disk (``fsync``), then renamed over the final name with
``os.replace`` (atomic on POSIX and Windows), and the folder is synced so the rename
itself survives a power cut. A reader therefore sees either the old complete file or
the new complete file, never a torn one.

:class:`RunBackup` keeps a training run's state in one folder (``RUN_DIR/backup``)::

    epoch-0003.weights.h5   model + optimizer state after epoch 3 (model.save_weights)
    checkpoint.json         index: the latest checkpoint, its size and SHA-256

Saving epoch N writes ``epoch-N`` next to the previous checkpoint, then the index, and
only then deletes the previous checkpoint: whatever moment a kill hits, one complete
checkpoint is on disk. Restoring trusts the files, not the index alone: it takes the
newest checkpoint that is complete (its SHA-256 matches the index, or, when the index
is missing, empty, corrupt or stale, every HDF5 dataset in it reads back), says so when
it falls back, and deletes leftover temporary files.

Fault injection (for tests): ``TFAPLOSS_FAULT="checkpoint_write:2"`` makes the process
exit at once (``os._exit``, as a kill would, no clean-up) at that point. Points:
``batch:E:B`` (after batch B of epoch E, 1-based), ``epoch_end:E`` (epoch E trained and
logged, not yet saved), ``checkpoint_write:E`` / ``metadata_write:E`` / ``model_write`` /
``summary_write`` (the temporary file is cut to half its bytes, then exit: a kill in the
middle of the write), ``checkpoint_rename:E`` / ``metadata_rename:E`` / ``model_rename`` /
``summary_rename`` (complete temporary file, not yet renamed), ``prune:E`` (new
checkpoint recorded, previous one not yet deleted), ``after_checkpoint:E``,
``backup_delete`` (the finished run's backup renamed aside, not yet deleted). And one
that does not kill: ``nan_weights:E:B`` sets a weight to NaN after batch B of epoch E
(to test the non-finite guard). Several points may be given, comma-separated.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

FAULT_ENV = "TFAPLOSS_FAULT"
FAULT_EXIT_CODE = 75  # EX_TEMPFAIL: "try again", which is what resuming does

_TEMP_RE = re.compile(r"^\..+\.tmp-\d+(\..*)?$")
_CHECKPOINT_RE = re.compile(r"^epoch-(\d{4,})\.weights\.h5$")
INDEX_NAME = "checkpoint.json"
_TRASH_PREFIX = ".backup-trash-"


# ---------------------------------------------------------------------------------------
# Fault injection
# ---------------------------------------------------------------------------------------


def requested_fault(name: str, epoch: int | None = None,
                    batch: int | None = None) -> str | None:
    """The item of ``$TFAPLOSS_FAULT`` that names this point (``name[:epoch[:batch]]``;
    a missing epoch or batch matches any), else None. Costs one environment lookup."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    for item in spec.split(","):
        parts = item.strip().split(":")
        if parts[0] != name:
            continue
        if len(parts) > 1 and parts[1] and (epoch is None or int(parts[1]) != epoch):
            continue
        if len(parts) > 2 and parts[2] and (batch is None or int(parts[2]) != batch):
            continue
        return item.strip()
    return None


def fault_point(name: str, epoch: int | None = None, batch: int | None = None,
                path: str | os.PathLike | None = None) -> None:
    """Exit the process here if ``$TFAPLOSS_FAULT`` names this point (see module doc).

    With ``path`` (a ``*_write`` point) the file is first cut to half its size, leaving
    what a kill in the middle of writing it leaves.
    """
    item = requested_fault(name, epoch, batch)
    if item is None:
        return
    if path is not None and os.path.exists(path):
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size // 2)
            f.flush()
            os.fsync(f.fileno())
    where = name + (f" (epoch {epoch}" + (f", batch {batch}" if batch else "") + ")"
                    if epoch is not None else "")
    print(f"{FAULT_ENV}={item}: simulated kill at {where}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(FAULT_EXIT_CODE)


# ---------------------------------------------------------------------------------------
# Atomic files
# ---------------------------------------------------------------------------------------


def temp_name(path: str | os.PathLike) -> Path:
    """The temporary name :func:`atomic_write` uses for ``path``: hidden, same folder,
    same extension(s) (Keras checks ``.keras`` / ``.weights.h5``)."""
    path = Path(path)
    base, dot, rest = path.name.partition(".")
    return path.with_name(f".{base}.tmp-{os.getpid()}{dot}{rest}")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in ``path`` durable (no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[str], object], *,
                 fault: str | None = None, epoch: int | None = None) -> Path:
    """Create ``path`` through ``write(temp_path)``, all or nothing.

    ``write`` receives a temporary path in the same folder; the file is fsynced and
    renamed over ``path``. If ``write`` raises, the temporary file is removed and the
    previous ``path`` (if any) is untouched. ``fault`` names the fault-injection points
    ``<fault>_write`` and ``<fault>_rename``. Returns ``path``.
    """
    path = Path(path)
    tmp = temp_name(path)
    try:
        write(str(tmp))
        _fsync_file(tmp)
        if fault:
            fault_point(f"{fault}_write", epoch, path=tmp)
            fault_point(f"{fault}_rename", epoch)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path, text: str, **kwargs) -> Path:
    """:func:`atomic_write` of a UTF-8 text."""
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    return atomic_write(path, write, **kwargs)


def atomic_write_json(path, obj, **kwargs) -> Path:
    """:func:`atomic_write` of ``json.dumps(obj, indent=2)``."""
    return atomic_write_text(path, json.dumps(obj, indent=2) + "\n", **kwargs)


def remove_temp_files(folder: str | os.PathLike) -> list[str]:
    """Delete what killed :func:`atomic_write` calls left in ``folder``; returns names."""
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        if entry.is_file() and _TEMP_RE.match(entry.name):
            entry.unlink()
            removed.append(entry.name)
    return removed


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


# ---------------------------------------------------------------------------------------
# The run's backup folder
# ---------------------------------------------------------------------------------------


class RunBackup:
    """Per-epoch checkpoints of a model (weights and optimizer state) in one folder.

    Args:
        directory: the backup folder (created on the first save).
        log: called with one line for each thing worth telling (fallbacks, clean-ups).

    Cost of a save: one ``model.save_weights`` (model + optimizer variables) plus one
    read of the file for its SHA-256; the disk holds two checkpoints for a moment.
    """

    def __init__(self, directory: str | os.PathLike, log: Callable[[str], None] = print):
        self.directory = Path(directory)
        self.log = log

    # -- paths -------------------------------------------------------------------------

    def checkpoint_path(self, epoch: int) -> Path:
        return self.directory / f"epoch-{epoch:04d}.weights.h5"

    @property
    def index_path(self) -> Path:
        return self.directory / INDEX_NAME

    def checkpoints(self) -> dict[int, Path]:
        """Complete-named checkpoint files, by epoch (newest last)."""
        if not self.directory.is_dir():
            return {}
        found = {}
        for entry in self.directory.iterdir():
            match = _CHECKPOINT_RE.match(entry.name)
            if match and entry.is_file():
                found[int(match.group(1))] = entry
        return dict(sorted(found.items()))

    def exists(self) -> bool:
        return self.directory.is_dir()

    # -- save ----------------------------------------------------------------------------

    def save(self, model, epoch: int, extra: dict | None = None) -> Path:
        """Checkpoint ``model`` after ``epoch`` (1-based) and drop the previous one."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.checkpoint_path(epoch)
        atomic_write(path, lambda tmp: model.save_weights(tmp), fault="checkpoint",
                     epoch=epoch)
        record = {"epoch": epoch, "file": path.name, "bytes": path.stat().st_size,
                  "sha256": sha256_of(path), **(extra or {})}
        atomic_write_json(self.index_path, {"format": 1, "latest": record},
                          fault="metadata", epoch=epoch)
        fault_point("prune", epoch)
        for older, old_path in self.checkpoints().items():
            if older != epoch:
                old_path.unlink()
        fault_point("after_checkpoint", epoch)
        return path

    # -- restore -------------------------------------------------------------------------

    def _read_index(self) -> dict | None:
        if not self.index_path.exists():
            return None
        try:
            with open(self.index_path, encoding="utf-8") as f:
                index = json.load(f)
            latest = index["latest"]
            int(latest["epoch"]), str(latest["file"]), int(latest["bytes"])
            str(latest["sha256"])
            return latest
        except (OSError, ValueError, KeyError, TypeError) as err:
            size = self.index_path.stat().st_size
            self.log(f"note: {self.index_path} is unreadable ({size} bytes; "
                     f"{type(err).__name__}: {err}); checking the checkpoint files "
                     "themselves instead")
            return None

    def _problem(self, epoch: int, path: Path, latest: dict | None) -> str | None:
        if latest is not None and latest["file"] == path.name:
            size = path.stat().st_size
            if size != latest["bytes"]:
                return f"{path.name} has {size} bytes, {latest['bytes']} were written"
            if sha256_of(path) != latest["sha256"]:
                return f"{path.name} does not match the SHA-256 recorded when it was written"
            return None
        problem = _h5_readable(path)
        return f"{path.name} is unreadable ({problem})" if problem else None

    def find(self) -> tuple[int, Path | None]:
        """``(epoch, path)`` of the newest complete checkpoint; ``(0, None)`` if none."""
        if not self.directory.is_dir():
            return 0, None
        removed = remove_temp_files(self.directory)
        if removed:
            self.log(f"note: removed {len(removed)} unfinished file(s) a killed run left "
                     f"in {self.directory}: {', '.join(sorted(removed))}")
        latest = self._read_index()
        candidates = self.checkpoints()
        if latest is not None and latest["epoch"] not in candidates:
            self.log(f"note: {INDEX_NAME} names {latest['file']}, which is not in "
                     f"{self.directory}; using the checkpoints that are there")
        for epoch in sorted(candidates, reverse=True):
            path = candidates[epoch]
            problem = self._problem(epoch, path, latest)
            if problem is None:
                if latest is not None and latest["epoch"] != epoch:
                    self.log(f"note: {INDEX_NAME} is stale (it names epoch "
                             f"{latest['epoch']}); {path.name} is complete, resuming after "
                             f"epoch {epoch}")
                return epoch, path
            older = [e for e in candidates if e < epoch]
            self.log(f"warning: {problem}; "
                     + (f"falling back to the checkpoint of epoch {max(older)}" if older
                        else "no older checkpoint, starting from epoch 1"))
        return 0, None

    def restore(self, model) -> int:
        """Load the newest complete checkpoint into ``model``; returns its epoch (0: none).

        The model must be built and compiled (its optimizer is built here if needed).
        """
        epoch, path = self.find()
        if path is None:
            return 0
        if getattr(model, "optimizer", None) is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        model.load_weights(str(path))
        return epoch

    # -- finish --------------------------------------------------------------------------

    def discard(self) -> None:
        """Delete the backup (the run is complete): renamed aside first, so a kill
        during the deletion never leaves a half-deleted backup that looks resumable."""
        if not self.directory.is_dir():
            return
        trash = self.directory.with_name(f"{_TRASH_PREFIX}{os.getpid()}")
        os.replace(self.directory, trash)
        fsync_dir(self.directory.parent)
        fault_point("backup_delete")
        shutil.rmtree(trash, ignore_errors=True)

    @staticmethod
    def remove_trash(run_dir: str | os.PathLike) -> None:
        """Finish deleting backups a kill interrupted :meth:`discard` on."""
        run_dir = Path(run_dir)
        if run_dir.is_dir():
            for entry in run_dir.iterdir():
                if entry.name.startswith(_TRASH_PREFIX) and entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
