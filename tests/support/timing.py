"""Time bounds that hold on a crowded CI host.

CPU time is not immune to other tenants: on a crowded host a thread's CPU seconds
stretch (cache and memory bandwidth are shared). A bound scaled by this thread's speed
at the moment still catches unbounded work, which grows with the input, not with the
host.

Nor is it immune to the process: CPython's cycle collector makes whichever allocation
crosses its threshold pay a pass over every object of the process. CI twice charged
2.63 CPU s to a 0.01 s piece of work in a test worker holding millions of objects; the
probe below, which allocates much, holds the collector off (:data:`COLLECTOR_OFF`).
"""

from __future__ import annotations

import gc
import time

from tfaploss.process_settings import HeldSetting

#: CPython's cycle collector, off while held (counted, so overlapping holders restore it
#: once, as found).
COLLECTOR_OFF = HeldSetting(gc.isenabled, lambda on: gc.enable() if on else gc.disable(),
                            False)

_IDLE_SECONDS = 0.033  # the loop below on an idle core of the CI machine: 0.027-0.03 s


def speed_factor(wall: bool = False) -> float:
    """How many times slower this thread runs now than on an idle core (at least 1):
    a fixed allocation-heavy loop timed in this thread's CPU time (``wall``: in wall
    time, which also counts waiting for a core)."""
    clock = time.perf_counter if wall else time.thread_time
    # A collection here would time the process's heap, not the thread.
    with COLLECTOR_OFF.held():
        _ = [[] for _ in range(50_000)]  # warm: the first round also grows the heap
        started = clock()
        for _ in range(4):
            _ = [[] for _ in range(50_000)]
        seconds = clock() - started
    return max(1.0, seconds / _IDLE_SECONDS)


def budget(seconds: float, wall: bool = False) -> float:
    """``seconds`` on an idle core, scaled by :func:`speed_factor` measured now."""
    return seconds * speed_factor(wall)
