"""Where the messages of tfaploss, models and pipelines go: the logging scheme.

Library code never calls ``print``. Every module logs on its own module logger,
``logging.getLogger(__name__)``, so the three packages of this repository are three
logger hierarchies named after them: ``tfaploss.*`` (``tfaploss.run.trainer``,
``tfaploss.durable.checkpoints``, ``tfaploss.durable.faults``, ...), ``pipelines.*`` and
``models.*``. Levels: INFO for what a user of the command line reads (what a run is
about to do, notes on what a resumed run found, where the results went), WARNING for
what needs their attention, DEBUG for details. A problem the caller should fix in their
own code (e.g. a batch without a positive pair) is a Python warning
(``warnings.warn``), the same channel Keras and TensorFlow use for such things.

Who decides what is shown:

* Importing the library configures nothing: no handler, no level, and never the root
  logger. The ``tfaploss`` logger gets a ``NullHandler`` (in ``tfaploss/__init__.py``,
  so on any import of the library), so an application that configures no logging
  does not get our warnings through Python's last-resort handler in a format it did
  not choose.
* The ``tfaploss`` command (:mod:`tfaploss.cli`) calls :func:`configure`: a
  :class:`PlainHandler` on the ``tfaploss`` logger (INFO and DEBUG lines to stdout,
  WARNING and above to stderr, as plain text without escape codes so a log file stays
  readable), at INFO, WARNING with ``--quiet``, DEBUG with ``--verbose`` (which also
  adds the time, level and logger name to each line and shows the ``pipelines`` and
  ``models`` loggers at DEBUG; by default those two show WARNING and above).
* The entry points that report to a person, :func:`tfaploss.run.trainer.train` and
  :func:`tfaploss.evaluation.evaluate` with ``verbose``, run inside :func:`reporting`:
  when the application has not said where the ``tfaploss`` INFO lines go (no handler
  of its own on ``tfaploss``, no level set on it, INFO not enabled through the root
  logger), they are shown on stdout (warnings on stderr) for the duration of the call,
  as the ``print`` calls they replace were, and only there. An application that
  configures logging for them gets them its way.
* The Beam jobs (``python -m tfaploss.pipelines.<job>``) are configured by
  :func:`tfaploss.pipelines.console.configure`: their lines on stderr, the one-line-per-split
  result on stdout (logger ``tfaploss.pipelines.result``), Beam's own loggers at WARNING unless
  ``--verbose``.
* ``absl`` is used only where Beam or TensorFlow already log through it.
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
    to stderr. The streams are looked up when a record is written (so redirections,
    ``contextlib.redirect_stdout`` and pytest's capture see the lines), and flushed at
    once (the lines keep their order with the rest of a log file).

    A stream on a full disk (``> log.txt`` there) takes no more lines: the first error
    is kept in ``full`` (``(stream, OSError)``) for the command to report once, instead
    of logging's traceback for every line after it."""

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
    if logger.level != logging.NOTSET:
        return True
    if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
        return True
    return logger.getEffectiveLevel() <= logging.INFO


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
