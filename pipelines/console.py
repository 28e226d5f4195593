"""What a job prints: its own progress and summary, and Beam's internals only when asked.

Beam logs dozens of lines per local run (``apitools not found``, Google Cloud scopes,
worker start-up, snappy/CRC notices); none of them helps a user. The jobs keep Beam's
loggers at WARNING (``--verbose``: INFO) and print their own lines through the
``pipelines`` logger: the plan, progress every few seconds on long runs, and a summary.
"""

from __future__ import annotations

import logging
import sys
import time

LOG = logging.getLogger("pipelines")

_NOISY = ("apache_beam", "apache_beam.io.tfrecordio", "absl", "tensorflow", "urllib3",
          "google", "oauth2client")


def import_beam_quietly():
    """Import ``apache_beam`` without its import-time warnings (``apitools not found``,
    logged on the root logger, which also makes Python install a root handler).

    Only when nobody configured logging yet; returns the module.
    """
    root = logging.getLogger()
    if "apache_beam" in sys.modules or root.handlers:
        import apache_beam

        return apache_beam
    sink = logging.NullHandler()
    root.addHandler(sink)
    try:
        import apache_beam
    finally:
        root.removeHandler(sink)
    return apache_beam


def wants_verbose(argv) -> bool:
    return "--verbose" in (sys.argv[1:] if argv is None else argv)


def configure(verbose: bool = False) -> None:
    """Job lines on stderr as ``pipelines: message``; Beam at WARNING unless verbose."""
    root = logging.getLogger()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(name)s %(levelname)s: %(message)s" if verbose else "%(message)s"))
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    LOG.setLevel(logging.INFO)
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR
                                         if name.endswith("tfrecordio") else logging.WARNING)


class Progress:
    """Logs ``what: done/total (rate/s)`` at most every ``every`` seconds."""

    def __init__(self, what: str, total: int | None = None, every: float = 10.0):
        self.what, self.total, self.every = what, total, every
        self.started = self.last = time.time()
        self.done = 0

    def add(self, n: int) -> None:
        self.done += n
        now = time.time()
        if now - self.last >= self.every:
            self.last = now
            rate = self.done / max(now - self.started, 1e-9)
            of = f"/{self.total}" if self.total else ""
            LOG.info("%s: %d%s (%.1f/s)", self.what, self.done, of, rate)
