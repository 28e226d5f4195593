"""Files that are whole or absent (:func:`atomic_write`: a temporary name in the same
folder, ``fsync``, ``os.replace``, folder synced), folders replaced whole
(:func:`replace_folder`, :func:`recover_folder`) and a full disk as one error,
:class:`DiskFullError` (docs/reliability.md, "Full disks"). A kill leaves at most a
temporary file (:func:`is_temp_name`), which :func:`remove_temp_files` deletes."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path

from tfaploss.durable import faults

LOG = logging.getLogger(__name__)

_TEMP_RE = re.compile(r"^\..+\.tmp-\d+(\..*)?$")


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temporary name of :func:`temp_name` (any process's)."""
    return bool(_TEMP_RE.match(name))


def temp_name(path: str | os.PathLike) -> Path:
    """Hidden, same folder, same extension(s) (Keras checks ``.keras`` / ``.weights.h5``)."""
    path = Path(path)
    base, dot, rest = path.name.partition(".")
    return path.with_name(f".{base}.tmp-{os.getpid()}{dot}{rest}")


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in ``path`` durable (no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


class DiskFullError(OSError):
    """No space left for ``path``: ``needed`` and ``free`` bytes (None: unknown); nothing
    was written, the previous file is intact."""

    def __init__(self, path, needed: int | None = None, free: int | None = None):
        self.path, self.needed, self.free = str(path), needed, free
        need = f"about {_size(needed)} needed" if needed else "the space needed is unknown"
        have = f", {_size(free)} free" if free is not None else ""
        super().__init__(errno.ENOSPC, f"no space left on the device to write {self.path} "
                         f"({need}{have}); nothing was written there. Free space (or use "
                         "another folder) and run the same command again")

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):  # crosses process boundaries (Beam workers) intact
        return type(self), (self.path, self.needed, self.free)


def _size(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def free_bytes(folder: str | os.PathLike) -> int | None:
    """Bytes free for this user on ``folder``'s file system (None: unknown)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def is_disk_full(err: BaseException) -> bool:
    """An ``OSError`` with ENOSPC / EDQUOT, or any error whose text carries the C
    library's words for them (h5py, TensorFlow, faiss and ScaNN raise their own types)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(err, Exception) and (
        "No space left on device" in str(err) or "Disk quota exceeded" in str(err))


def disk_full_in(err: BaseException, path: str | os.PathLike) -> DiskFullError | None:
    """The :class:`DiskFullError` behind ``err``, however wrapped (Beam), else None; a
    full disk known only as an ``OSError`` or by its text becomes one for ``path``."""
    seen, found, chain = set(), None, err
    while chain is not None and id(chain) not in seen:
        if isinstance(chain, DiskFullError):
            return chain
        if found is None and is_disk_full(chain):
            found = chain
        seen.add(id(chain))
        chain = chain.__cause__ or chain.__context__
    if found is None:
        return None
    return DiskFullError(path, None, free_bytes(path if os.path.isdir(path)
                                                else os.path.dirname(os.fspath(path)) or "."))


def check_space(path: str | os.PathLike, needed: int | None) -> None:
    """Raise :class:`DiskFullError` when ``path``'s folder has less than ``needed``
    bytes free (unknowns pass; so does everything under the fault ``no_space_check``)."""
    if not needed or faults.requested("no_space_check"):
        return
    free = free_bytes(Path(path).parent)
    if free is not None and free < needed:
        raise DiskFullError(path, needed, free)


def atomic_write(path: str | os.PathLike, write: Callable[[str], object], *,
                 fault: str | None = None, epoch: int | None = None,
                 needed: int | None = None) -> Path:
    """Create ``path`` through ``write(temp_path)``, all or nothing; if ``write`` raises,
    the temporary file is removed (files it left open in the folder closed first) and
    ``path`` is untouched. ``fault``: the fault points ``<fault>_write``, ``_rename``,
    ``_enospc``; ``needed``: bytes checked free first. Raises :class:`DiskFullError`."""
    path = Path(path)
    tmp = temp_name(path)
    open_before = _descriptors()
    failure = None
    try:
        check_space(path, needed)
        write(str(tmp))
        if fault:
            faults.no_space(f"{fault}_enospc", epoch, path=tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if fault:
            faults.point(f"{fault}_write", epoch, path=tmp)
            faults.point(f"{fault}_rename", epoch)
        os.replace(tmp, path)
    except BaseException as err:
        _let_go_of_files_left_open(path.parent, open_before)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if not is_disk_full(err) or isinstance(err, DiskFullError):
            raise
        # The writer's frames still hold its file objects (Keras's HDF5 store, its
        # zip, the temporary file of a large .keras): drop them now, not at exit.
        traceback.clear_frames(err.__traceback__)
        failure = DiskFullError(path, needed, free_bytes(path.parent))
    if failure is not None:
        raise failure  # outside the except: not chained to the writer's error
    fsync_dir(path.parent)
    return path


def _descriptors() -> dict[int, str] | None:
    """This process's open descriptors and what each names (``/proc/self/fd``; None
    elsewhere). Cost: one ``readlink`` (~2 us) per descriptor."""
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        return None
    found = {}
    for entry in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):  # closed meanwhile (the listing's)
            found[int(entry)] = os.readlink(f"/proc/self/fd/{entry}")
    return found


def _let_go_of_files_left_open(folder: Path, before: dict[int, str] | None) -> list[str]:
    """Point the descriptors a failed write left open in ``folder`` at an anonymous
    memory file (``dup2``); returns their names. Keras leaves its HDF5 file open when a
    write fails, and HDF5's later flush on a full disk kills the process by SIGSEGV."""
    if before is None:
        return []
    folder = os.path.realpath(folder)  # as /proc names it: links resolved
    left = []
    for fd, target in (_descriptors() or {}).items():
        name = target.removesuffix(" (deleted)")
        if before.get(fd) == target or os.path.dirname(name) != folder:
            continue
        memory = os.memfd_create("tfaploss-discarded-write")
        try:
            os.dup2(memory, fd)
        finally:
            os.close(memory)
        left.append(name)
    if left:
        LOG.debug("a failed write left %d file(s) open, now closed: %s", len(left),
                  ", ".join(left))
    return left


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


def _previous_folder(final: str) -> str:
    parent, base = os.path.split(os.fspath(final).rstrip("/"))
    return os.path.join(parent, f".{base}.previous")


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    if faults.requested("publish"):
        return False  # the crash test exercises the two-rename path
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def replace_folder(staged: str | os.PathLike, final: str | os.PathLike) -> None:
    """Replace the local folder ``final`` by the complete folder ``staged`` (beside it):
    a reader sees the old folder or the new one, never a mix."""
    staged, final = os.fspath(staged), os.fspath(final)
    if not os.path.exists(final):
        os.rename(staged, final)
    elif _exchange(staged, final):
        shutil.rmtree(staged)  # now holds the old version
    else:
        previous = _previous_folder(final)
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(final, previous)
        faults.point("publish")
        os.rename(staged, final)
        shutil.rmtree(previous)
    fsync_dir(os.path.dirname(final) or ".")


def interrupted_replacements(parent: str | os.PathLike) -> list[str]:
    """The folders of ``parent`` whose :func:`replace_folder` a kill interrupted
    between its two renames: what :func:`recover_folder` is for."""
    parent = os.fspath(parent)
    bases = [name[1:-len(".previous")] for name in sorted(os.listdir(parent))
             if name.startswith(".") and name.endswith(".previous")]
    return [os.path.join(parent, base) for base in bases if base]


def recover_folder(final: str | os.PathLike) -> None:
    """Undo a :func:`replace_folder` killed between its two renames: the old folder is
    put back if the new one never arrived, else deleted."""
    previous = _previous_folder(final)
    if os.path.exists(previous):
        if os.path.exists(final):
            shutil.rmtree(previous)
        else:
            os.rename(previous, final)
