"""SIGTERM (a cluster taking a machine back, ~30 s of grace) and SIGINT turned into a
flag (:class:`SignalFlag`) that a callback reads after each batch
(:class:`tfaploss.training.preemption.PreemptionCheckpoint`): saving from inside a
handler would run HDF5 in the middle of whatever the thread was doing."""

from __future__ import annotations

import logging
import signal
import threading
import time

LOG = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by ``signum``: 128 + its number."""
    return 128 + int(signum)


class Preempted(Exception):
    """Training stopped on a signal after ``epoch`` epochs and ``step`` batches of the
    next; ``path``: the checkpoint written (None when none could be)."""

    def __init__(self, signum: int, epoch: int, step: int, path=None, seconds=0.0):
        self.signum, self.epoch, self.step, self.path = signum, epoch, step, path
        self.status = exit_status(signum)
        name = signal.Signals(signum).name
        at = (f"after step {step} of epoch {epoch + 1}" if step
              else f"after epoch {epoch}")
        saved = (f"checkpoint saved {at} to {path}, {seconds:.1f} s after the signal"
                 if path else "no new checkpoint (the last epoch's is kept)")
        super().__init__(f"stopped by {name}: {saved}. Run the same command again to "
                         "continue from there.")


class SignalFlag:
    """Record SIGTERM and SIGINT instead of dying on them, for the block's duration
    (main thread only: Python allows no other); a second signal goes to the previous
    handler. ``signum``: the first received (None: none), at ``received_at``."""

    def __init__(self, signals=SIGNALS):
        self.signals = tuple(signals)
        self.signum: int | None = None
        self.received_at = 0.0
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.signum is not None:
            # A second signal: do not make the user wait for the checkpoint.
            previous = self._previous.get(signum, signal.SIG_DFL)
            signal.signal(signum, previous)
            if callable(previous):
                previous(signum, frame)
            else:
                signal.raise_signal(signum)
            return
        self.signum = signum
        self.received_at = time.monotonic()

    def seconds_since(self) -> float:
        return time.monotonic() - self.received_at if self.signum is not None else 0.0

    def __enter__(self) -> SignalFlag:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
