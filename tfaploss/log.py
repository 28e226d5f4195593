"""Where the messages of tfaploss go: the logging scheme.

Library code never calls ``print``: every module logs on ``logging.getLogger(__name__)``
(INFO for the command line's reader, WARNING for what needs attention, DEBUG for
details); a problem in the caller's code is a Python warning. Importing configures
nothing (the ``tfaploss`` logger gets a ``NullHandler``); the ``tfaploss`` command calls
:func:`configure` (a :class:`PlainHandler`, level by ``--quiet`` / ``--verbose``);
``train`` and ``evaluate`` with ``verbose`` run inside :func:`reporting`, which shows
the INFO lines on stdout for the call when the application has not routed them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import sys

ROOT = "tfaploss"
PLAIN_FORMAT = "%(message)s"
DETAILED_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"


class PlainHandler(logging.Handler):
    """Writes each record as one plain line: below WARNING to stdout, WARNING and above
    to stderr, the streams looked up at each record (redirections see the lines) and
    flushed at once. A stream on a full disk takes no more lines: the first error is
    kept in ``full`` (``(stream, OSError)``) for the command to report once."""

    def __init__(self, level=logging.NOTSET, fmt: str = PLAIN_FORMAT):
        super().__init__(level)
        self.setFormatter(logging.Formatter(fmt))
        self.full = None

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        if self.full is not None and self.full[0] is stream:
            return
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except RecursionError:
            raise
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                self.handleError(record)
            elif self.full is None:
                self.full = (stream, err)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


class _CommandHandler(PlainHandler):
    """The handler :func:`configure` installs (replaced when it is called again)."""


def configure(level: int = logging.INFO, *, detailed: bool = False,
              others_level: int = logging.WARNING,
              others: tuple[str, ...] = ("tfaploss.pipelines", "tfaploss.models")) -> PlainHandler:
    """What the ``tfaploss`` command shows: ``tfaploss.*`` at ``level``, the ``others``
    loggers at ``others_level``, through one :class:`PlainHandler` (``detailed``: with
    time, logger and level). Replaces what an earlier call installed; returns the
    handler. For command-line programs, not for library code."""
    handler = _CommandHandler(fmt=DETAILED_FORMAT if detailed else PLAIN_FORMAT)
    for name, lvl in ((ROOT, level), *((n, others_level) for n in others)):
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _CommandHandler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(lvl)
        # Shown once, here: not again through a root handler someone else installed
        # (importing Beam logs a warning on the root logger, which installs one).
        logger.propagate = False
    return handler


@contextlib.contextmanager
def command_output(level: int = logging.INFO, *, detailed: bool = False,
                   others_level: int = logging.WARNING,
                   others: tuple[str, ...] = ("tfaploss.pipelines", "tfaploss.models")):
    """:func:`configure` for the duration of the block, then the loggers' handlers and
    levels as they were (a command run in-process, e.g. by a test, leaves no trace)."""
    loggers = [logging.getLogger(name) for name in (ROOT, *others)]
    saved = [(logger, logger.level, list(logger.handlers), logger.propagate)
             for logger in loggers]
    handler = configure(level, detailed=detailed, others_level=others_level, others=others)
    try:
        yield handler
    finally:
        for logger, lvl, handlers, propagate in saved:
            logger.handlers[:] = handlers
            logger.setLevel(lvl)
            logger.propagate = propagate


def _configured(logger: logging.Logger) -> bool:
    """Has the application said where (or whether) this logger's INFO lines go?"""
    return (logger.level != logging.NOTSET
            or any(not isinstance(h, logging.NullHandler) for h in logger.handlers)
            or logger.getEffectiveLevel() <= logging.INFO)


@contextlib.contextmanager
def reporting(name: str = ROOT):
    """Show the INFO lines of logger ``name`` (stdout; warnings on stderr) during the
    block, unless the application configured where they go (see the module doc)."""
    logger = logging.getLogger(name)
    if _configured(logger):
        yield
        return
    handler = PlainHandler()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    # Not also through handlers an application put on the root logger for its warnings
    # only (``logging.basicConfig()``): each line is shown once.
    propagate, logger.propagate = logger.propagate, False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = propagate


def is_terminal() -> bool:
    """Progress bars (carriage returns, colour codes) only on a terminal, never in a log."""
    return hasattr(sys.stdout, "isatty") and sys.stdout.isatty()
