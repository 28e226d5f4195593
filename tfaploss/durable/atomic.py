"""Files that are whole or absent: what a kill in the middle of a write leaves is never
read as the file.

Every file is written the same way (:func:`atomic_write`): to a temporary name in the
same folder, flushed to disk (``fsync``), then renamed over the final name with
``os.replace`` (atomic on POSIX and Windows), and the folder is synced so the rename
itself survives a power cut. A reader therefore sees either the old complete file or
the new complete file, never a torn one. A kill leaves at most a temporary file
(:func:`is_temp_name`), which :func:`remove_temp_files` deletes.

Fault points ``<fault>_write`` and ``<fault>_rename`` (:mod:`tfaploss.durable.faults`)
let the crash tests kill a write at either step.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from tfaploss.durable import faults

_TEMP_RE = re.compile(r"^\..+\.tmp-\d+(\..*)?$")


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temporary name of :func:`temp_name` (any process's)."""
    return bool(_TEMP_RE.match(name))


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
    previous ``path`` (if any) is untouched. ``fault`` names the fault points
    ``<fault>_write`` and ``<fault>_rename`` (:mod:`tfaploss.durable.faults`). Returns ``path``.
    """
    path = Path(path)
    tmp = temp_name(path)
    try:
        write(str(tmp))
        _fsync_file(tmp)
        if fault:
            faults.point(f"{fault}_write", epoch, path=tmp)
            faults.point(f"{fault}_rename", epoch)
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
        if entry.is_file() and is_temp_name(entry.name):
            entry.unlink()
            removed.append(entry.name)
    return removed


def sha256_of(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, as hex (read in 1 MB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
