"""One writer per folder: the exclusive lock ``FOLDER/.tfaploss.lock`` of a training run
or a Beam job, created whole (a complete temporary file hard-linked to that name) and
taken over only from a process of this host that no longer runs
(docs/reliability.md, "Two jobs, one output"). URLs are not locked."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from tfaploss.durable import atomic

LOG = logging.getLogger(__name__)

LOCK_NAME = ".tfaploss.lock"
_MAX_BYTES = 64 * 1024  # a lock file holds a few hundred bytes
_YOUNG_SECONDS = 5.0  # an unreadable lock younger than this may still be being written


class LockError(RuntimeError):
    """The lock of a folder could not be taken (e.g. the folder is not writable)."""


class LockHeldError(LockError):
    """The folder is locked by another live writer (or one this host cannot check);
    ``path``: the lock file, ``holder``: what it says (empty if unreadable)."""

    def __init__(self, message: str, path: Path, holder: dict):
        super().__init__(message)
        self.path = path
        self.holder = holder


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time in ticks after boot)`` of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rindex(b")") + 2:].split()
        return fields[0].decode("ascii"), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _command_line() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = [a.decode("utf-8", "backslashreplace") for a in f.read().split(b"\0") if a]
    except OSError:
        argv = [sys.executable, *sys.argv]
    return _printable(" ".join(argv))


def _printable(value, limit: int = 500) -> str:
    """``value`` as one line of plain text: what a message may show of a lock file."""
    text = " ".join("".join(c if c.isprintable() else " " for c in str(value)).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _me() -> dict:
    stat = _proc_stat(os.getpid())
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "started_unix": round(time.time(), 3), "command": _command_line(),
            "boot_id": _boot_id(), "process_start": stat[1] if stat else None}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # PermissionError: someone else's process
    return True


def stale_reason(holder: dict) -> str | None:
    """Why the lock ``holder`` describes is stale, or None (live, or not checkable here)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None  # not a lock this module wrote: never taken over silently
    if holder.get("host") != socket.gethostname():
        return None
    boot = _boot_id()
    if holder.get("boot_id") and boot and holder["boot_id"] != boot:
        return f"the machine restarted since process {pid} took it"
    if not _alive(pid):
        return f"process {pid} is no longer running"
    stat = _proc_stat(pid)
    if stat is not None:
        state, start = stat
        if state in ("Z", "X"):
            return f"process {pid} has exited"
        if holder.get("process_start") not in (None, start):
            return f"PID {pid} now belongs to another process"
    return None


def describe(holder: dict) -> str:
    """``PID 123 on host h, since 2026-01-01 12:00:00 UTC (5 s ago): command``."""
    if not holder:
        return "an unknown process (the lock file is unreadable)"
    text = (f"PID {_printable(holder.get('pid'), 20)} on host "
            f"{_printable(holder.get('host'), 100)}")
    if holder.get("started"):
        text += f", since {_printable(holder['started'], 40)}"
        started = holder.get("started_unix")
        if isinstance(started, (int, float)) and not isinstance(started, bool):
            ago = max(0.0, time.time() - started)
            text += f" ({ago:.0f} s ago)" if ago < 120 else f" ({ago / 60:.0f} min ago)"
    if holder.get("command"):
        text += f", command: {_printable(holder['command'])}"
    return text


class Lock:
    """A lock this process holds (see :func:`acquire`); :meth:`release` deletes it."""

    def __init__(self, path: Path, info: dict, inode: tuple[int, int]):
        self.path = path
        self.info = info
        self._inode = inode
        self._pid = os.getpid()

    def release(self) -> None:
        """Delete the lock file, if it is still this lock (never another's)."""
        if os.getpid() != self._pid:  # a forked child never releases its parent's lock
            return
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)


def _write_exclusive(path: Path, data: bytes) -> None:
    """Create ``path`` holding ``data`` (FileExistsError if it exists); removed again
    if the write fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if os.write(fd, data) != len(data):  # a short write to a file: the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def _create(path: Path, data: bytes) -> tuple[int, int]:
    """Create ``path`` holding ``data``, or raise FileExistsError; atomic."""
    # Named as the run directory's temporary files are (tfaploss.durable.checkpoints),
    # so a kill between this create and its unlink leaves nothing a run keeps.
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.{uuid.uuid4().hex[:8]}")
    _write_exclusive(tmp, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links here: the exclusive create itself
        _write_exclusive(path, data)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _read_open(path: Path) -> tuple[int, dict | None] | None:
    """``(fd, what the lock file says or None)``, or None when it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        raw = os.read(fd, _MAX_BYTES)
        holder = json.loads(raw.decode("utf-8"))
        if not isinstance(holder, dict):
            holder = None
    except (ValueError, OSError):
        holder = None
    return fd, holder


def _remove_if_same(path: Path, fd: int) -> bool:
    """Delete ``path`` if it is still the file open as ``fd``, under an exclusive flock
    of it (two writers never both remove, nor remove a lock created since)."""
    with contextlib.suppress(ImportError, OSError):
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        st, now = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
        return False
    os.unlink(path)
    return True


def acquire(folder: str | os.PathLike, what: str = "folder", *, name: str = LOCK_NAME,
            target: str | os.PathLike | None = None,
            log: Callable[[str], None] | None = None) -> Lock:
    """Take the lock of the existing ``folder`` (``what`` in messages), taking over a
    stale one (a note to ``log``). ``name``: the lock file's name (a job replacing a
    whole folder locks it from its parent, naming that output ``target``). Raises
    :class:`LockHeldError` (another live holder) or :class:`LockError` (cannot create).
    """
    path = Path(folder) / name
    shown = str(Path(target if target is not None else folder))
    log = log or (lambda line: LOG.warning("%s", line))
    info = _me()
    data = json.dumps(info).encode("utf-8")
    holder: dict = {}
    for _ in range(50):
        try:
            return Lock(path, info, _create(path, data))
        except FileExistsError:
            pass
        except OSError as err:
            if atomic.is_disk_full(err):
                raise atomic.DiskFullError(path, len(data),
                                           atomic.free_bytes(path.parent)) from None
            raise LockError(f"cannot take the lock of {what} {shown!r}: "
                            f"creating {path} failed ({type(err).__name__}: {err}); is "
                            "it a writable folder?") from None
        opened = _read_open(path)
        if opened is None:
            continue  # released meanwhile: try again
        fd, holder = opened
        try:
            if holder is None:
                try:
                    age = time.time() - os.fstat(fd).st_mtime
                except OSError:
                    age = 0.0
                if age < _YOUNG_SECONDS:
                    time.sleep(0.05)
                    continue  # perhaps being written (no-hard-link file systems)
                reason = "the lock file is unreadable"
                holder = {}
            else:
                reason = stale_reason(holder)
            if reason is None:
                break
            if _remove_if_same(path, fd):
                log(f"warning: took over the lock {path} left by {describe(holder)}: "
                    f"{reason}")
        finally:
            os.close(fd)
    holder = holder or {}
    if holder.get("host") == socket.gethostname():
        way_out = f"Wait for it to finish (or stop it), or use another {what}."
    else:
        way_out = (f"It cannot be checked from this host whether that process still "
                   f"runs: wait for it to finish, or use another {what}; if it is gone, "
                   f"delete {path}.")
    raise LockHeldError(
        f"{what} {shown!r} is in use by another process: {describe(holder)} "
        f"(lock file {path}). Two writers on one {what} would interleave their files. "
        f"{way_out}", path, holder)


@contextlib.contextmanager
def exclusive(folder: str | os.PathLike, what: str = "folder", *, name: str = LOCK_NAME,
              target: str | os.PathLike | None = None,
              log: Callable[[str], None] | None = None) -> Iterator[Lock | None]:
    """Hold :func:`acquire`'s lock for the ``with`` block; a URL is not locked."""
    if "://" in str(folder):
        yield None
        return
    lock = acquire(folder, what, name=name, target=target, log=log)
    try:
        yield lock
    finally:
        lock.release()
