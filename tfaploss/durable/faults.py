"""Fault injection for the crash tests: the one mechanism, for training and the Beam jobs.

A *fault point* is a named place in the code where a test may have the process die at
once (``os._exit``, as ``kill -9`` would: no clean-up, no ``finally``), to check that
whatever was on disk at that moment is recovered. Off in production: nothing is armed
unless a test arms it, through the environment variable :data:`ENV`
(``TFAPLOSS_FAULT=checkpoint_write:2``, read once, at import) for a child process, or
:func:`armed` in this process. Several points may be armed, comma-separated; an item
is ``name``, ``name:E`` or ``name:E:B`` (a missing epoch or batch matches any). A
killed process logs ``TFAPLOSS_FAULT=<item>: simulated kill at <where>`` and exits with
:data:`EXIT_CODE` (75, ``EX_TEMPFAIL``: "try again", which is what resuming does).

Fault points of a training run (:mod:`tfaploss.run.trainer`, :mod:`tfaploss.durable.checkpoints`;
E: epoch, B: batch, 1-based):

* ``batch:E:B`` after batch B; ``epoch_end:E`` epoch E logged, its checkpoint not written;
* ``checkpoint_write:E``, ``metadata_write:E`` (the index), ``model_write``,
  ``summary_write``: the file's temporary copy cut to half its bytes, then exit;
  ``..._rename``: the temporary file complete, not yet renamed into place;
* ``prune:E`` checkpoint E recorded, the previous one not yet deleted;
  ``after_checkpoint:E`` and the previous one deleted; ``backup_delete`` the finished
  run's backup renamed aside, not yet deleted;
* ``<file>_enospc:E`` (no kill): that file's write fails with ENOSPC as on a full disk
  (``checkpoint``, ``metadata``, ``step_checkpoint``, ``model``, ``summary``, ``config``,
  ``epochs``; evaluation's ``metrics``, ``figure``, ``searcher``, ``projector``;
  compare's ``report``, ``ledger``; ``export``; the Beam jobs' ``storage`` (every write),
  ``work_list``, ``part``, ``shard``, ``report``, ``manifest``);
* ``sigterm:E:B``, ``sigint:E:B`` (no kill): the process sends itself the signal;
  ``nan_weights:E:B`` (no kill): the first trainable weight set to NaN.

Fault points of the Beam jobs: ``images:N`` after N images processed (counted per
worker; one integer comparison per image); ``publish`` between the two renames of a
publish (arming it also turns off the one-call ``renameat2`` exchange);
``worker_kill:N`` an image worker SIGKILLs itself as it starts its N-th image, as the
OOM killer would: the job must notice and end cleanly.
"""

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
    items = []
    for item in (spec or "").split(","):
        item = item.strip()
        if item:
            items.append(tuple(item.split(":")))
    return tuple(items)


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
    if not _ARMED:
        return None
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
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def kill(item: str, where: str) -> None:
    """Log the simulated kill, flush stdout/stderr and exit at once (``os._exit``)."""
    LOG.warning("%s=%s: simulated kill at %s", ENV, item, where)
    _flush()
    os._exit(EXIT_CODE)


def point(name: str, epoch: int | None = None, batch: int | None = None,
          path: str | os.PathLike | None = None) -> None:
    """Exit the process here if this point is armed (see the module doc).

    With ``path`` (a ``*_write`` point) the file is first cut to half its size, leaving
    what a kill in the middle of writing it leaves.
    """
    if not _ARMED:
        return
    item = requested(name, epoch, batch)
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
    kill(item, where)


def no_space(name: str, epoch: int | None = None, path=None) -> None:
    """Raise ``OSError(ENOSPC)`` here if ``name`` is armed, as a write on a full disk
    does; ``path`` (the file being written, if any) is first cut to half its size."""
    if not _ARMED or requested(name, epoch) is None:
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
