"""A comparison's ledger: every run it trained, one JSON row per line, keyed on
everything that defines the run.

A run's key hashes its :class:`~tfaploss.compare.protocol.RunSpec` with the comparison's
*setup* (tier, config, data or feature fingerprint, head, m, test classes,
``runner.setup()``). A changed setup never reuses another's rows: it starts new cells,
with a note naming what changed; rows without a setup (older ledgers) are never reused.
The ``seconds`` budget's timings are rows too (kind ``"timing"``), so that a resumed
comparison gives its runs the same updates.
Appending is durable: a row is fsynced as its run ends, so a kill cuts short only the
last line and a full disk leaves no half line.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
from pathlib import Path

from tfaploss.durable import atomic, faults

# The logger of the module that used to hold the ledger: its notes keep their name.
LOG = logging.getLogger("tfaploss.compare.protocol")


def digest(value) -> str:
    """A short, stable hash of a JSON-able value."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class DamagedLedgerError(RuntimeError):
    """A line of a comparison's ledger, not its last, is not a row: no kill leaves that
    (a kill cuts short only the line being appended, the last). ``path``, ``line``
    (1-based) and ``problem`` name it."""

    def __init__(self, path: str | os.PathLike, line: int, problem: str):
        self.path, self.line, self.problem = Path(path), line, problem
        super().__init__(
            f"damaged ledger: {self.path}: line {line} {problem}. No kill leaves this "
            "(a kill cuts short only the last line), so the comparison does not go on "
            "by itself: remove or repair that line (its run is then done again) and run "
            "the same command again, or use another --out.")


def _ledger_row(line: bytes) -> tuple[dict | None, str | None]:
    """``(row, None)`` for a ledger line, else ``(None, what is wrong with it)``."""
    if not line.strip():
        return None, "is empty"
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        return None, f"is not JSON ({type(err).__name__}: {str(err)[:120]})"
    if not isinstance(row, dict) or not isinstance(row.get("key"), str):
        return None, "is not a run's row (a JSON object with a 'key')"
    return row, None


def setup_changes(old: dict, new: dict) -> str:
    """What differs between two setups, in words: ``"head: 'mlp' -> 'residual'"``."""
    names = sorted(set(old) | set(new))
    return "; ".join(f"{k}: {old.get(k, '(none)')!r} -> {new.get(k, '(none)')!r}"
                     for k in names if old.get(k) != new.get(k))


class Ledger:
    """The runs of a comparison, one JSON row per line (module docstring).

    Args:
        path: the ``ledger.jsonl`` file (created on the first run).
        tier: ``"features"`` or ``"images"``.
        setup: what defines the runs beside their spec (JSON-able; the tier is added).

    A last line a kill cut short is cut off with a note and its run done again; any other
    line that is not a row raises :class:`DamagedLedgerError`. Rows of another setup are
    kept in ``rows``, never returned by :meth:`get`. One writer: ``tfaploss compare``
    holds its output folder's lock. Cost: one read of the file.
    """

    def __init__(self, path: str | os.PathLike, tier: str, setup: dict | None = None):
        self.path, self.tier = Path(path), tier
        self.setup = {"tier": tier, **(setup or {})}
        self.setup_id = digest(self.setup)
        self.rows: dict[str, dict] = {}
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1  # where the last complete line ends
        lines = data[:end].split(b"\n")[:-1]
        torn = None  # (offset, line number, problem) of a last line a kill cut short
        if data[end:]:  # appended without its newline: the next append would join it
            torn = (end, len(lines) + 1, "has no newline")
        for number, line in enumerate(lines, 1):
            row, problem = _ledger_row(line)
            if problem is not None:
                if number < len(lines) or torn is not None:
                    raise DamagedLedgerError(self.path, number, problem)
                torn = (end - len(line) - 1, number, problem)
                break
            self.rows[row["key"]] = row
        if torn is not None:
            self._cut(*torn)
        self._note_other_setups()

    def _cut(self, offset: int, number: int, problem: str) -> None:
        """Cut the torn last line (``number``, from byte ``offset``) off the file."""
        with open(self.path, "r+b") as f:
            f.truncate(offset)
            os.fsync(f.fileno())
        LOG.info("note: dropped the last line of %s (line %d %s), which a kill cut "
                 "short as it was appended; that run is done again", self.path, number,
                 problem)

    def _note_other_setups(self) -> None:
        """Say which rows this comparison will not reuse, and why."""
        others: dict[str, tuple[dict, int]] = {}
        legacy = 0
        for row in self.rows.values():
            if row.get("kind") == "timing":
                continue
            setup = row.get("setup")
            if not isinstance(setup, dict):
                legacy += 1
            elif row.get("setup_id") != self.setup_id:
                known = others.get(row.get("setup_id"), (setup, 0))
                others[row.get("setup_id")] = (setup, known[1] + 1)
        if legacy:
            LOG.info("note: %s holds %d runs written before runs were keyed on their setup "
                     "(config, features, head, m, test classes): their setup is unknown, "
                     "so they are kept but not reused", self.path, legacy)
        for setup, count in others.values():
            LOG.info("note: %s holds %d runs of another setup; this comparison starts "
                     "new cells beside them (what changed: %s)", self.path, count,
                     setup_changes(setup, self.setup))

    def key(self, spec) -> str:
        return spec.key(self.setup_id)

    def get(self, spec) -> dict | None:
        row = self.rows.get(self.key(spec))
        return row if row is not None and row.get("setup_id") == self.setup_id else None

    def runs(self) -> list[dict]:
        """The runs of this ledger's setup (its timings left out)."""
        return [r for r in self.rows.values()
                if r.get("setup_id") == self.setup_id and r.get("kind") != "timing"]

    def add(self, spec, row: dict) -> dict:
        return self._append({
            **row, "key": self.key(spec), "tier": self.tier, "loss": spec.loss,
            "params": spec.settings, "batch": spec.batch, "updates": spec.updates,
            "images": spec.updates * spec.batch, "seed": spec.seed, "test": spec.test,
            "setup_id": self.setup_id, "setup": self.setup})

    def step_seconds(self, loss: str, batch: int, measure) -> float:
        """Seconds per update of ``loss`` at ``batch`` under this setup: the ledger's
        timing, or ``measure()``'s, added to it (the ``seconds`` budget)."""
        key = digest(["timing", self.setup_id, loss, batch])
        row = self.rows.get(key)
        if row is None:
            seconds = float(measure())
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"the timing of {loss} at batch {batch} is not a positive "
                                 f"number of seconds; received {seconds!r}")
            row = self._append({"key": key, "kind": "timing", "tier": self.tier,
                                "loss": loss, "batch": batch, "step_seconds": seconds,
                                "setup_id": self.setup_id, "setup": self.setup})
            LOG.info("timed %s at B=%d: %.3f s per update", loss, batch, seconds)
        return float(row["step_seconds"])

    def _append(self, row: dict) -> dict:
        """Append ``row`` durably (module docstring) and keep it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(row, sort_keys=True) + "\n").encode("utf-8")
        with open(self.path, "ab", buffering=0) as f:  # unbuffered: truncate never flushes
            start = f.seek(0, os.SEEK_END)
            try:
                if f.write(line) != len(line):  # a short write to a file: the disk is full
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
                faults.no_space("ledger_enospc")
                os.fsync(f.fileno())
            except OSError as err:
                # A half line would swallow the next run's line too: cut it off.
                f.truncate(start)
                if atomic.is_disk_full(err):
                    raise atomic.DiskFullError(self.path, len(line),
                                               atomic.free_bytes(self.path.parent)) from None
                raise
        self.rows[row["key"]] = row
        return row
