"""Preemption: SIGTERM (what a cluster sends before it takes a machine back, with about
30 s of grace) and SIGINT (Ctrl-C) turned into a flag that the training loop reads.

The signal handler only records the signal (:class:`SignalFlag`): saving a checkpoint
from inside a handler would run HDF5 and the backend in the middle of whatever the
interrupted thread was doing. A callback reads the flag at the end of each batch
(:class:`tfaploss.training.preemption.PreemptionCheckpoint`), saves a step checkpoint
and raises :class:`Preempted` (exit 143 for SIGTERM, 130 for SIGINT: :func:`exit_status`).
A second signal while the first is being handled goes to the previous handler.
"""

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
    """Training stopped on a signal, its state checkpointed.

    ``signum``: the signal; ``epoch``: epochs finished; ``step``: batches of the next
    epoch done; ``path``: the checkpoint written (None when none could be: the weights
    were not finite, or the signal came before the first batch ended).
    """

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
    """Record SIGTERM and SIGINT instead of dying on them, for the block's duration.

    ``signum`` is the first signal received (None: none), ``received_at`` its
    ``time.monotonic()``. Handlers are installed only in the main thread (Python allows
    no other); elsewhere the flag stays down and the signals keep their handlers. The
    previous handlers are put back on exit.
    """

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
