"""The comparison protocol: every loss tuned alike, then seeds, intervals and pairs.

After Musgrave, Belongie, Lim, "A Metric Learning Reality Check", ECCV 2020:

1. every loss gets the same backbone, embedding, augmentation and optimizer (the
   runner's), and the same number of trials per (loss, batch, budget);
2. the trials are chosen by Optuna's TPE sampler over the learning rate (log-uniform
   over the same range at every batch size) and the loss's own knobs
   (:data:`SEARCH_SPACES`), scored on the VALIDATION classes only (MAP@R), each trial
   with the tuning seed;
3. the best trial's setting is trained again with the evaluation seeds (never the
   tuning seed) and scored on the TEST classes: the mean with a 95 % t-interval, and
   each loss's paired difference against the best peer over the shared seeds (the same
   seed gives both losses the same initialisation and the same batches).

Budgets, per batch size B and with B_max the largest batch of the comparison:

* ``images``: every batch size sees the same number of images (``images / B`` updates);
* ``updates``: every batch size takes the same number of updates (``updates``);
* ``matched``: the compute-matched control: every batch size sees as many images as
  B_max sees in ``updates`` updates (``updates · B_max / B`` updates). Beside
  ``updates`` it separates "a larger batch" from "more images".

Every run is a row of a ledger (``ledger.jsonl``, one JSON object per line, appended
and flushed as each run ends): a comparison cut short resumes where it stopped, and a
run that failed (non-finite loss, collapse) stays in the tables as what it was. TPE is
seeded and replays the cached trials in order, so a resumed search asks for the same
settings.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

from tfaploss import extras
from tfaploss.durable import atomic, faults

LOG = logging.getLogger(__name__)

# The learning rate's range, the same at every batch size.
LR_RANGE = (1e-4, 3e-2)

# name -> (tfaploss.losses class, fixed arguments, searched knobs). A knob is
# (kind, low, high) with kind "log" (log-uniform), "float" or "int"; knobs that are not
# constructor arguments of the loss are run settings (``proxy_lr_multiplier``).
SEARCH_SPACES: dict[str, tuple[str, dict, dict]] = {
    "APLoss": ("APLoss", {}, {"num_bins": ("int", 5, 40)}),
    "FastAP": ("FastAPLoss", {}, {"num_bins": ("int", 5, 40)}),
    "SmoothAP": ("SmoothAPLoss", {}, {"temperature": ("log", 1e-3, 1e-1)}),
    "Triplet": ("TripletLoss", {"mining": "semihard"}, {"margin": ("float", 0.05, 1.0)}),
    "MultiSimilarity": ("MultiSimilarityLoss", {},
                        {"alpha": ("log", 0.5, 10.0), "beta": ("log", 5.0, 80.0),
                         "base": ("float", 0.2, 0.8), "epsilon": ("float", 0.0, 0.3)}),
    "SupCon": ("SupConLoss", {}, {"temperature": ("log", 0.02, 0.5)}),
    "ProxyAnchor": ("ProxyAnchorLoss", {},
                    {"margin": ("float", 0.0, 0.3), "alpha": ("log", 4.0, 64.0),
                     "proxy_lr_multiplier": ("log", 1.0, 1000.0)}),
}
AP_LOSSES = ("APLoss", "FastAP", "SmoothAP")
PEERS = ("Triplet", "MultiSimilarity", "SupCon", "ProxyAnchor")
RUN_KNOBS = ("lr", "proxy_lr_multiplier")
BUDGETS = ("images", "updates", "matched")

# Two-sided 95 % Student t quantiles by degrees of freedom (n - 1).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run: what a runner trains and scores."""

    loss: str
    params: tuple  # sorted (name, value) pairs: the learning rate and the loss's knobs
    batch: int
    updates: int
    seed: int
    test: bool  # also score the test classes (the evaluation seeds)

    @property
    def settings(self) -> dict:
        return dict(self.params)

    def loss_kwargs(self) -> dict:
        _, fixed, _ = SEARCH_SPACES[self.loss]
        return {**fixed, **{k: v for k, v in self.params if k not in RUN_KNOBS}}

    def key(self, tier: str) -> str:
        text = json.dumps([tier, self.loss, list(map(list, self.params)), self.batch,
                           self.updates, self.seed, self.test], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]


Runner = Callable[[RunSpec], dict]


def updates_for(budget: str, batch: int, images: int, updates: int, largest: int) -> int:
    """Updates a run of ``batch`` gets under ``budget`` (module docstring)."""
    if budget == "images":
        return max(1, math.ceil(images / batch))
    if budget == "updates":
        return updates
    if budget == "matched":
        return max(1, math.ceil(updates * largest / batch))
    raise ValueError(f"budget must be one of {BUDGETS}; received budget={budget!r}")


def t95(n: int) -> float:
    """The two-sided 95 % t quantile for a mean of ``n`` values (n >= 2)."""
    df = n - 1
    known = max(k for k in _T95 if k <= df)
    return _T95[known]


def interval(values) -> tuple[float, float]:
    """``(mean, half-width of the 95 % t-interval)``; half-width NaN for one value."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n == 1:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t95(n) * sd / math.sqrt(n)


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


class Ledger:
    """The runs of a comparison, one JSON row per line, keyed by :meth:`RunSpec.key`.

    Reading it: a last line that a kill cut short (no newline, or not a row) is cut off
    the file, with a note (logger ``tfaploss.compare.protocol``, INFO), and its run is
    done again; any other line that is not a row raises :class:`DamagedLedgerError`
    naming the file and the line. Only one process may write a ledger: ``tfaploss
    compare`` holds its output folder's lock (:mod:`tfaploss.durable.locks`) while it
    runs. Cost: one read of the file.
    """

    def __init__(self, path: str | os.PathLike, tier: str):
        self.path, self.tier = Path(path), tier
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

    def _cut(self, offset: int, number: int, problem: str) -> None:
        """Cut the torn last line (``number``, from byte ``offset``) off the file."""
        with open(self.path, "r+b") as f:
            f.truncate(offset)
            os.fsync(f.fileno())
        LOG.info("note: dropped the last line of %s (line %d %s), which a kill cut "
                 "short as it was appended; that run is done again", self.path, number,
                 problem)

    def get(self, spec: RunSpec) -> dict | None:
        return self.rows.get(spec.key(self.tier))

    def add(self, spec: RunSpec, row: dict) -> dict:
        row = {**row, "key": spec.key(self.tier), "tier": self.tier, "loss": spec.loss,
               "params": spec.settings, "batch": spec.batch, "updates": spec.updates,
               "images": spec.updates * spec.batch, "seed": spec.seed, "test": spec.test}
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


@dataclasses.dataclass
class Protocol:
    """What a comparison runs: losses, batch sizes, budgets, trials and seeds."""

    losses: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    budgets: tuple[str, ...] = ("images",)
    images: int = 49152
    updates: int = 64
    trials: int = 12
    seeds: tuple[int, ...] = (0, 1, 2)
    tuning_seed: int = 1000
    lr_range: tuple[float, float] = LR_RANGE
    # Instead of TPE: {(loss, batch): settings} carried over from another tier, each
    # tried at these multiples of its learning rate (the fine-tuning tier).
    carried: dict | None = None
    lr_factors: tuple[float, ...] = (0.1, 0.3, 1.0)

    def __post_init__(self):
        unknown = [name for name in self.losses if name not in SEARCH_SPACES]
        if unknown:
            raise ValueError(f"losses: {unknown} not known; choose from "
                             f"{sorted(SEARCH_SPACES)}.")
        bad = [b for b in self.budgets if b not in BUDGETS]
        if bad:
            raise ValueError(f"budgets: {bad} not known; choose from {list(BUDGETS)}.")
        if not self.batch_sizes or min(self.batch_sizes) < 2:
            raise ValueError(f"batch_sizes must be >= 2; received {self.batch_sizes}.")
        if self.trials < 1:
            raise ValueError(f"trials must be >= 1; received trials={self.trials}.")
        if self.tuning_seed in self.seeds:
            raise ValueError(f"the tuning seed {self.tuning_seed} must not be an "
                             "evaluation seed (it would score the pick on its own run).")

    def cells(self):
        """``(budget, batch, updates)`` of every cell; a budget whose updates equal an
        earlier budget's at that batch is the same cell, listed once."""
        largest = max(self.batch_sizes)
        seen = set()
        for budget in self.budgets:
            for batch in sorted(self.batch_sizes):
                updates = updates_for(budget, batch, self.images, self.updates, largest)
                yield budget, batch, updates, (batch, updates) in seen
                seen.add((batch, updates))

    def total_runs(self) -> int:
        distinct = sum(1 for *_, repeat in self.cells() if not repeat)
        trials = len(self.lr_factors) if self.carried is not None else self.trials
        return distinct * len(self.losses) * (trials + len(self.seeds))


def _suggest(trial, name, spec):
    kind, low, high = spec
    if kind == "int":
        return trial.suggest_int(name, int(low), int(high))
    return trial.suggest_float(name, float(low), float(high), log=(kind == "log"))


def _stable_seed(*parts) -> int:
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:8], 16)


def _cached_run(ledger: Ledger, runner: Runner, spec: RunSpec, progress) -> dict:
    """The ledger's row of ``spec``, or the run's, trained now and added to it."""
    row = ledger.get(spec)
    if row is not None:
        progress(None)
        return row
    what = "tune" if not spec.test else f"seed {spec.seed}"
    progress(f"{what} {spec.loss} B={spec.batch} u={spec.updates} "
             + _describe(spec.settings))
    return ledger.add(spec, runner(spec))


def _tuning_value(ledger: Ledger, runner: Runner, spec: RunSpec, progress) -> float:
    """A tuning run's validation MAP@R; a failed run (no finite value) scores 0."""
    value = _cached_run(ledger, runner, spec, progress).get("val_map@r")
    return float(value) if value is not None and math.isfinite(value) else 0.0


def tune(protocol: Protocol, ledger: Ledger, runner: Runner, loss: str, batch: int,
         updates: int, progress: Callable[[str], None] = lambda _: None) -> dict:
    """``protocol.trials`` TPE trials of ``loss`` at (batch, updates); returns the best
    trial's settings (the highest validation MAP@R; a failed trial scores 0)."""
    optuna = extras.import_extra("compare", "the comparison protocol's tuning (Optuna TPE)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    _, _, knobs = SEARCH_SPACES[loss]
    sampler = optuna.samplers.TPESampler(
        seed=_stable_seed(loss, batch, updates), n_startup_trials=max(2, protocol.trials // 3))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    best, best_value = None, -1.0
    for _ in range(protocol.trials):
        trial = study.ask()
        params = {"lr": trial.suggest_float("lr", *protocol.lr_range, log=True)}
        for name, spec in knobs.items():
            params[name] = _suggest(trial, name, spec)
        value = _tuning_value(ledger, runner, RunSpec(
            loss, tuple(sorted(params.items())), batch, updates, protocol.tuning_seed,
            False), progress)
        study.tell(trial, value)
        if value > best_value:
            best, best_value = params, value
    return best


def tune_neighbourhood(protocol: Protocol, ledger: Ledger, runner: Runner, loss: str,
                       batch: int, updates: int, progress=lambda _: None) -> dict:
    """The settings carried over for (loss, batch), at each of ``protocol.lr_factors``
    times their learning rate; returns the best on the validation classes."""
    carried = protocol.carried.get((loss, batch))
    if carried is None:
        raise ValueError(f"no carried settings for {loss} at batch {batch}; carried: "
                         f"{sorted(protocol.carried)}")
    best, best_value = None, -1.0
    for factor in protocol.lr_factors:
        params = {**carried, "lr": float(carried["lr"]) * factor}
        value = _tuning_value(ledger, runner, RunSpec(
            loss, tuple(sorted(params.items())), batch, updates, protocol.tuning_seed,
            False), progress)
        if value > best_value:
            best, best_value = params, value
    return best


def carried_settings(results: list[dict], budget: str) -> dict:
    """``{(loss, batch): params}`` picked by another comparison (its ``results.json``)
    under ``budget``."""
    return {(r["loss"], r["batch"]): dict(r["params"]) for r in results
            if r["budget"] == budget}


def evaluate(protocol: Protocol, ledger: Ledger, runner: Runner, loss: str, batch: int,
             updates: int, params: dict, progress=lambda _: None) -> list[dict]:
    """The evaluation seeds of ``params``: one row each, test scores included."""
    rows = []
    for seed in protocol.seeds:
        spec = RunSpec(loss, tuple(sorted(params.items())), batch, updates, seed, True)
        rows.append(_cached_run(ledger, runner, spec, progress))
    return rows


def run(protocol: Protocol, ledger: Ledger, runner: Runner,
        progress: Callable[[str | None], None] = lambda _: None) -> list[dict]:
    """The whole comparison: one result per (budget, batch, loss), smallest batch first
    so that a comparison cut short has every loss at the batches it reached."""
    results = []
    picked: dict[tuple, tuple] = {}
    for budget, batch, updates, repeat in protocol.cells():
        for loss in protocol.losses:
            if repeat:
                params, rows = picked[(loss, batch, updates)]
            else:
                search = tune if protocol.carried is None else tune_neighbourhood
                params = search(protocol, ledger, runner, loss, batch, updates, progress)
                rows = evaluate(protocol, ledger, runner, loss, batch, updates, params,
                                progress)
                picked[(loss, batch, updates)] = (params, rows)
            results.append(summarise(budget, batch, updates, loss, params, rows, ledger))
    return with_paired_differences(results)


def _describe(params: dict) -> str:
    return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in params.items())


def summarise(budget, batch, updates, loss, params, rows, ledger) -> dict:
    tests = [r.get("test_map@r") for r in rows]
    ok = [t for t in tests if t is not None and math.isfinite(t)]
    mean, half = interval(ok)
    trials = [r for r in ledger.rows.values()
              if r["loss"] == loss and r["batch"] == batch and r["updates"] == updates
              and not r["test"]]
    return {"budget": budget, "batch": batch, "updates": updates, "images": batch * updates,
            "loss": loss, "params": params, "test_map@r": mean, "ci95": half,
            "seeds": [r["seed"] for r in rows], "per_seed": tests,
            "statuses": [r.get("status", "ok") for r in rows],
            "val_map@r": max((r.get("val_map@r") or 0.0) for r in trials) if trials else None,
            "trials": len(trials), "seconds": sum(r.get("seconds", 0.0) for r in rows)
            + sum(r.get("seconds", 0.0) for r in trials),
            "curves": [r.get("curve") for r in rows]}


def with_paired_differences(results: list[dict]) -> list[dict]:
    """Each result gains ``vs_best_peer``: its paired test difference (mean, 95 %
    half-width over the shared seeds) against the peer with the best mean in its cell."""
    by_cell: dict[tuple, list[dict]] = {}
    for r in results:
        by_cell.setdefault((r["budget"], r["batch"]), []).append(r)
    for cell in by_cell.values():
        peers = [r for r in cell if r["loss"] in PEERS and math.isfinite(r["test_map@r"])]
        if not peers:
            continue
        best = max(peers, key=lambda r: r["test_map@r"])
        theirs = dict(zip(best["seeds"], best["per_seed"]))
        for r in cell:
            pairs = [(v, theirs[s]) for s, v in zip(r["seeds"], r["per_seed"])
                     if s in theirs and v is not None and theirs[s] is not None]
            mean, half = interval([a - b for a, b in pairs])
            r["best_peer"] = best["loss"]
            r["vs_best_peer"] = (mean, half) if r is not best else None
    return results
