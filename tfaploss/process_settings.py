"""Process-wide settings: the cores this process may use (:func:`available_cores`), and
settings held for the length of a block by holders that overlap (PyTorch's thread count,
CPython's cycle collector). Saving on entry and restoring on exit fails when two threads
overlap; :class:`HeldSetting` counts its holders instead: the first to enter saves the
value and sets its own, the last to leave restores it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class HeldSetting:
    """A process-wide setting, set to ``value`` while any holder is inside :meth:`held`.

    ``read()`` gives the setting's current value and ``write(v)`` sets it. Costs two
    acquisitions of a lock per block; ``read``/``write`` run only at the first entry and
    the last exit.
    """

    def __init__(self, read: Callable[[], Any], write: Callable[[Any], None], value: Any):
        self._read, self._write, self._value = read, write, value
        self._lock = threading.Lock()
        self._holders = 0
        self._found: Any = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._found = self._read()
                self._write(self._value)
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    self._write(self._found)
