"""What each fuzz case cost, and the bounds it must stay within.

Every case of a fuzz target runs inside :func:`case`, which

* bounds its time twice: a hard bound (``faulthandler`` dumps every thread's stack and
  ends the process when a case runs past it, so a hang fails the run instead of
  stalling it) and a soft one, asserted after the case, scaled by the host's speed at
  the start of the module (:func:`tests.support.timing.speed_factor`, since the 2 CI
  cores are shared);
* measures the peak of the process's resident memory while the case runs, above what
  it was just before (one sampling thread, every 2 ms, from ``/proc/self/statm``), and
  asserts it under the target's bound when one is given;
* tallies the case under its target: cases, outcomes, the worst time and memory.

``make fuzz`` sets ``TFAPLOSS_FUZZ_REPORT`` to a folder; each pytest process then writes
its tally there at the end of the session (``tests/fuzz/conftest.py``) and
``tests/fuzz/report.py`` adds them up into the table of ``docs/reliability.md``.
Hypothesis counts every run of a test body, shrinking included, so the cases are
those the bodies ran.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field

REPORT_ENV = "TFAPLOSS_FUZZ_REPORT"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MB = 1 << 20


def rss() -> int:
    """Resident memory of this process now, in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


class _PeakSampler:
    """One daemon thread that, while armed, keeps the largest RSS it samples."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.peak = 0
        self._armed = threading.Event()
        self._lock = threading.Lock()
        self._thread = None

    def arm(self) -> int:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fuzz-rss", daemon=True)
            self._thread.start()
        now = rss()
        with self._lock:
            self.peak = now
        self._armed.set()
        return now

    def disarm(self) -> int:
        self._armed.clear()
        now = rss()
        with self._lock:
            self.peak = max(self.peak, now)
            return self.peak

    def _run(self):
        while True:
            self._armed.wait()
            now = rss()
            with self._lock:
                self.peak = max(self.peak, now)
            time.sleep(self.interval)


_SAMPLER = _PeakSampler()


@dataclass
class Tally:
    """One target's cases: how many, their outcomes, the worst time and memory."""

    cases: int = 0
    outcomes: dict = field(default_factory=dict)
    worst_s: float = 0.0
    worst_case: str = ""
    worst_rss_mb: float = 0.0
    worst_rss_case: str = ""


TALLIES: dict[str, Tally] = {}


class Case:
    """What the body of a case reports: its ``outcome`` (a short word) and ``label``
    (what was tried, for the worst-case columns)."""

    def __init__(self, label: str = ""):
        self.outcome = "done"
        self.label = label


@contextlib.contextmanager
def case(target: str, *, soft_s: float, hard_s: float = 120.0, rss_mb: float | None = None,
         label: str = ""):
    """Run one fuzz case of ``target`` within ``soft_s`` seconds (asserted afterwards;
    pass a bound already scaled to the host) and ``hard_s`` (the process ends, dumping
    its threads, past it), its memory growth under ``rss_mb`` when given."""
    info = Case(label)
    faulthandler.dump_traceback_later(hard_s, exit=True, file=sys.stderr)
    before = _SAMPLER.arm()
    started = time.perf_counter()
    try:
        yield info
    finally:
        elapsed = time.perf_counter() - started
        grown = max(0, _SAMPLER.disarm() - before) / _MB
        faulthandler.cancel_dump_traceback_later()
        tally = TALLIES.setdefault(target, Tally())
        tally.cases += 1
        tally.outcomes[info.outcome] = tally.outcomes.get(info.outcome, 0) + 1
        if elapsed > tally.worst_s:
            tally.worst_s, tally.worst_case = elapsed, info.label
        if grown > tally.worst_rss_mb:
            tally.worst_rss_mb, tally.worst_rss_case = grown, info.label
    assert elapsed <= soft_s, (
        f"{target}: a case took {elapsed:.2f} s, more than its bound of {soft_s:.2f} s "
        f"({info.label})")
    if rss_mb is not None:
        assert grown <= rss_mb, (
            f"{target}: a case grew the process by {grown:.0f} MB, more than its bound of "
            f"{rss_mb:.0f} MB ({info.label})")


def write_report() -> str | None:
    """This process's tallies as ``$TFAPLOSS_FUZZ_REPORT/tally-<pid>.json`` (written
    to a temporary name and renamed), or None when the variable is unset."""
    folder = os.environ.get(REPORT_ENV)
    if not folder or not TALLIES:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"tally-{os.getpid()}.json")
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({name: vars(t) for name, t in TALLIES.items()}, f, indent=1)
    os.replace(tmp, path)
    return path
