"""A command's standard output on a full disk (``tfaploss verify DIR > report.txt``
there): one error line naming where the output went, exit status 2, instead of a
traceback per logged line. :func:`guarded_stdout` puts :class:`GuardedOutput` in front
of ``sys.stdout``, so a write or flush the disk refuses raises :class:`OutputFullError`
(an ``ENOSPC`` ``OSError``); :func:`finish` flushes and raises what the log handler kept.
Cost: one Python call per write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys

from tfaploss.durable.atomic import DiskFullError

_FULL = (errno.ENOSPC, errno.EDQUOT)


class OutputFullError(DiskFullError):
    """The disk holding the command's standard output (``target``) is full."""

    def __init__(self, target: str):
        super().__init__(target)
        self.strerror = (
            f"no space left on the device to write the standard output ({target}); what "
            "the command printed there is cut short. Free space (or send the output "
            "elsewhere) and run the same command again")

    def __reduce__(self):
        return type(self), (self.path,)


def _target(stream) -> str:
    """The file behind ``stream`` (Linux), else its name."""
    try:
        return os.readlink(f"/proc/self/fd/{stream.fileno()}")
    except (AttributeError, OSError, ValueError):  # no descriptor (a test's capture)
        return str(getattr(stream, "name", "<stdout>"))


class GuardedOutput:
    """``stream`` whose ``write`` and ``flush`` raise :class:`OutputFullError` on a full
    disk; everything else is the stream's own."""

    def __init__(self, stream):
        self._stream = stream

    def _call(self, method: str, *args):
        try:
            return getattr(self._stream, method)(*args)
        except OutputFullError:
            raise
        except OSError as err:
            raise (OutputFullError(_target(self._stream)) if err.errno in _FULL
                   else err) from None

    def write(self, text):
        return self._call("write", text)

    def flush(self):
        return self._call("flush")

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def guarded_stdout():
    """``sys.stdout`` behind a :class:`GuardedOutput` for the block."""
    with contextlib.redirect_stdout(GuardedOutput(sys.stdout)):
        yield


def finish(shown) -> None:
    """Flush the command's standard output, and raise :class:`OutputFullError` when it
    or a line of the log handler ``shown`` (:class:`tfaploss.log.PlainHandler`) did not
    fit on the disk."""
    sys.stdout.flush()
    full = getattr(shown, "full", None)
    if full is not None and full[0] is sys.stdout:
        raise full[1] if isinstance(full[1], OutputFullError) \
            else OutputFullError(_target(sys.stdout))
