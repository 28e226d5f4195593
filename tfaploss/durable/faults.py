"""Fault injection for the crash tests, for training and the Beam jobs: named points
where an armed test kills the process (``os._exit``, as ``kill -9`` would), fills the
disk or sends a signal. Nothing is armed unless :data:`ENV` or :func:`armed` arms it;
the syntax and every point are in docs/reliability.md ("Fault points")."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

ENV = "TFAPLOSS_FAULT"
EXIT_CODE = 75  # EX_TEMPFAIL

LOG = logging.getLogger(__name__)


def _parse(spec: str | None) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(item.strip().split(":")) for item in (spec or "").split(",")
                 if item.strip())


_ARMED = _parse(os.environ.get(ENV))  # read once: no fault point reads the environment


def active() -> bool:
    """Whether any fault point is armed (cheap: callers may skip their checks)."""
    return bool(_ARMED)


def arm(spec: str | None) -> str | None:
    """Arm the points of ``spec`` (same syntax as :data:`ENV`; ``None`` or ``""``
    disarms everything) in this process; returns the previous spec."""
    global _ARMED
    previous = ",".join(":".join(parts) for parts in _ARMED) or None
    _ARMED = _parse(spec)
    return previous


@contextlib.contextmanager
def armed(spec: str | None):
    """Arm ``spec`` for the duration of the block (in-process tests)."""
    previous = arm(spec)
    try:
        yield
    finally:
        arm(previous)


def requested(name: str, epoch: int | None = None, batch: int | None = None) -> str | None:
    """The armed item that names this point (``name[:epoch[:batch]]``), else None."""
    for parts in _ARMED:
        if parts[0] != name:
            continue
        if len(parts) > 1 and parts[1] and (epoch is None or int(parts[1]) != epoch):
            continue
        if len(parts) > 2 and parts[2] and (batch is None or int(parts[2]) != batch):
            continue
        return ":".join(parts)
    return None


def threshold(name: str) -> int:
    """N of an armed ``name:N`` (e.g. ``images:6``), else 0 (not armed)."""
    for parts in _ARMED:
        if parts[0] == name and len(parts) > 1 and parts[1]:
            return int(parts[1])
    return 0


def _flush() -> None:
    """stdout and stderr out before a simulated death, which flushes nothing."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()


def kill(item: str, where: str) -> None:
    """Log the simulated kill, flush stdout/stderr and ``os._exit``."""
    LOG.warning("%s=%s: simulated kill at %s", ENV, item, where)
    _flush()
    os._exit(EXIT_CODE)


def point(name: str, epoch: int | None = None, batch: int | None = None,
          path: str | os.PathLike | None = None) -> None:
    """Exit the process here if this point is armed; with ``path`` (a ``*_write``
    point) the file is first cut to half its size, as a kill mid-write leaves it."""
    item = requested(name, epoch, batch)
    if item is None:
        return
    if path is not None and os.path.exists(path):
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
            f.flush()
            os.fsync(f.fileno())
    where = name + (f" (epoch {epoch}" + (f", batch {batch}" if batch else "") + ")"
                    if epoch is not None else "")
    kill(item, where)


def no_space(name: str, epoch: int | None = None, path=None) -> None:
    """Raise ``OSError(ENOSPC)`` here if ``name`` is armed, as a write on a full disk
    does; ``path`` (the file being written, if any) is first cut to half its size."""
    if requested(name, epoch) is None:
        return
    import errno

    if path is not None and os.path.exists(path):
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    LOG.warning("%s=%s: simulated full disk", ENV, name)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path) if path else None)


def sigkill_self(item: str, where: str) -> None:
    """Log the simulated kill, flush, and send this process SIGKILL (what the OOM killer
    does: unlike :func:`kill`, the exit status is the signal's, -9)."""
    LOG.warning("%s=%s: simulated SIGKILL at %s (process %d)", ENV, item, where, os.getpid())
    _flush()
    os.kill(os.getpid(), signal.SIGKILL)


def count_reached(name: str, limit: int, done: int) -> None:
    """Exit if ``limit`` (from :func:`threshold`, read once by the caller) is armed and
    ``done`` reached it: the per-record check of ``images:N``."""
    if limit and done >= limit:
        kill(f"{name}:{limit}", f"{name} {done}")
