"""The comparison protocol: every loss tuned alike, then seeds, intervals and pairs.

After Musgrave, Belongie, Lim, "A Metric Learning Reality Check", ECCV 2020: every loss
gets the runner's backbone, embedding, augmentation and optimizer and a tuning budget by
one rule (:func:`trials_for_knobs`) per (loss, batch, budget); the trials (Optuna's TPE,
or a grid) over the learning rate and the loss's knobs (:data:`SEARCH_SPACES`) are scored
on the VALIDATION classes only; the best trial's setting is trained again with the
evaluation seeds and scored on the TEST classes (mean, 95 % interval, paired difference
against the best peer, chosen on validation). Tuning repeats, the nested interval, the
budgets (``images``, ``updates``, ``matched``, ``seconds``) and resuming from the ledger
(:mod:`tfaploss.compare.ledger`): ``docs/batch_sweep.md`` ("The protocol's details").
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
from collections.abc import Callable

from tfaploss import extras
from tfaploss.compare.ledger import DamagedLedgerError, Ledger

__all__ = ["DamagedLedgerError", "Ledger"]  # and the names below

LOG = logging.getLogger(__name__)

# The learning rate's range, the same at every batch size.
LR_RANGE = (3e-5, 3e-2)

# name -> (tfaploss.losses class, fixed arguments, searched knobs). A knob is
# (kind, low, high) with kind "log" (log-uniform), "float" or "int"; knobs that are not
# constructor arguments of the loss are run settings (``proxy_lr_multiplier``). The
# ranges were widened where the first study's picks sat at an edge (SupCon's
# temperature at its 0.02 floor, the histogram bins at 40, the triplet margin at 0.99,
# multi-similarity's base at 0.78 of 0.8, Proxy-Anchor's alpha at 62 of 64).
SEARCH_SPACES: dict[str, tuple[str, dict, dict]] = {
    "APLoss": ("APLoss", {}, {"num_bins": ("int", 5, 100)}),
    "FastAP": ("FastAPLoss", {}, {"num_bins": ("int", 5, 100)}),
    "SmoothAP": ("SmoothAPLoss", {}, {"temperature": ("log", 1e-4, 1e-1)}),
    "ROADMAP": ("ROADMAPLoss", {}, {"temperature": ("log", 1e-3, 1e-1),
                                    "lambda_": ("float", 0.0, 1.0)}),
    "RSk": ("RecallAtKLoss", {}, {"tau1": ("log", 1e-3, 1e-1)}),
    "Triplet": ("TripletLoss", {"mining": "semihard"}, {"margin": ("float", 0.01, 1.5)}),
    "MultiSimilarity": ("MultiSimilarityLoss", {},
                        {"alpha": ("log", 0.5, 20.0), "beta": ("log", 5.0, 200.0),
                         "base": ("float", 0.1, 1.0), "epsilon": ("float", 0.0, 0.3)}),
    "SupCon": ("SupConLoss", {}, {"temperature": ("log", 0.005, 0.5)}),
    "ProxyAnchor": ("ProxyAnchorLoss", {},
                    {"margin": ("float", 0.0, 0.5), "alpha": ("log", 4.0, 128.0),
                     "proxy_lr_multiplier": ("log", 1.0, 1000.0)}),
}
AP_LOSSES = ("APLoss", "FastAP", "SmoothAP", "ROADMAP", "RSk")
PEERS = ("Triplet", "MultiSimilarity", "SupCon", "ProxyAnchor")
RUN_KNOBS = ("lr", "proxy_lr_multiplier")
BUDGETS = ("images", "updates", "matched", "seconds")
# What makes tuning repeats independent: their tuning seeds, or class-disjoint folds of
# the validation classes (repeat r picks on fold r; the trials share one tuning seed, so
# a grid's trials are trained once and scored on every fold).
REPEAT_BY = ("seeds", "folds")
# Repeat r's evaluation seed s runs as s + REPEAT_SEED_STRIDE * r.
REPEAT_SEED_STRIDE = 10_000
# A pick in the outer EDGE of a knob's range (log-scaled for a log range) is flagged.
EDGE = 0.1
TRIALS_RULE = ("trials per tuning = ceil(base x max(2, knobs) / 2), the learning rate "
               "counted as a knob: the base for a loss with one knob of its own, 1.5x for "
               "two (ROADMAP), 2x for three (Proxy-Anchor), 2.5x for four "
               "(multi-similarity)")

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

    def key(self, context: str) -> str:
        """The run's key within ``context`` (a tier, or a ledger's setup digest)."""
        text = json.dumps([context, self.loss, list(map(list, self.params)), self.batch,
                           self.updates, self.seed, self.test], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]


Runner = Callable[[RunSpec], dict]


def updates_for(budget: str, batch: int, images: int, updates: int, largest: int,
                seconds: float | None = None, step_seconds: float | None = None) -> int:
    """Updates a run of ``batch`` gets under ``budget`` (module docstring); the
    ``seconds`` budget also needs the loss's measured ``step_seconds`` at ``batch``."""
    if budget == "images":
        return max(1, math.ceil(images / batch))
    if budget == "updates":
        return updates
    if budget == "matched":
        return max(1, math.ceil(updates * largest / batch))
    if budget == "seconds":
        if not (seconds and step_seconds and step_seconds > 0):
            raise ValueError(f"the seconds budget needs seconds and the loss's seconds per "
                             f"update; received seconds={seconds!r}, "
                             f"step_seconds={step_seconds!r}")
        return max(1, math.floor(seconds / step_seconds))
    raise ValueError(f"budget must be one of {BUDGETS}; received budget={budget!r}")


def t95(n: int) -> float:
    """The two-sided 95 % t quantile for a mean of ``n`` values (n >= 2)."""
    return _T95[max(df for df in _T95 if df <= n - 1)]


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


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def nested_interval(units) -> tuple[float, float, str]:
    """``(mean, 95 % half-width, kind)`` of ``units``, ``(repeat, value)`` pairs.

    Two or more repeats with a finite value: the t-interval over the repeat means
    (``kind`` "repeats": tuning and seed noise). One: the t-interval over its values
    (``kind`` "seeds": seed noise only). Values that are not finite are left out.
    """
    by: dict[int, list[float]] = {}
    for repeat, value in units:
        if _finite(value):
            by.setdefault(repeat, []).append(float(value))
    if len(by) >= 2:
        mean, half = interval([sum(v) / len(v) for v in by.values()])
        return mean, half, "repeats"
    mean, half = interval(next(iter(by.values()), []))
    return mean, half, "seeds"


def trials_for_knobs(base: int, knobs: int) -> int:
    """Trials of one tuning of a loss with ``knobs`` knobs (:data:`TRIALS_RULE`)."""
    return math.ceil(base * max(2, knobs) / 2)


def range_position(spec, value) -> float:
    """Where ``value`` lies in a knob's range ``(kind, low, high)``: 0 at low, 1 at
    high, on a log scale for a log range."""
    kind, low, high = spec
    if kind == "log":
        return math.log(value / low) / math.log(high / low)
    return (value - low) / (high - low)


def search_space(loss: str, lr_range=LR_RANGE) -> dict[str, tuple]:
    """What a trial of ``loss`` sets, each with its range: the learning rate (log), then
    the loss's knobs (:data:`SEARCH_SPACES`)."""
    return {"lr": ("log", *lr_range), **SEARCH_SPACES[loss][2]}


def edge_knobs(loss: str, params: dict, lr_range=LR_RANGE) -> list[str]:
    """The knobs of ``params`` whose value lies in the outer :data:`EDGE` of its range."""
    return [name for name, spec in search_space(loss, lr_range).items()
            if name in params and not EDGE <= range_position(spec, params[name]) <= 1 - EDGE]


def _points(spec, count: int) -> list:
    """``count`` points of a knob's range: its middle for one, else evenly spaced from
    end to end (log-spaced for a log range; integers rounded, each once)."""
    kind, low, high = spec
    fractions = [0.5] if count == 1 else [i / (count - 1) for i in range(count)]
    if kind == "log":
        values = [low * (high / low) ** f for f in fractions]
    else:
        values = [low + (high - low) * f for f in fractions]
    if kind == "int":
        return list(dict.fromkeys(round(v) for v in values))
    return values


def grid_settings(loss: str, lr_points: int, knob_points: int,
                  lr_range=LR_RANGE) -> list[dict]:
    """The grid of ``loss``: ``lr_points`` learning rates, log-spaced over the whole
    range, times ``knob_points`` points of each knob (:func:`_points`)."""
    space = search_space(loss, lr_range)
    axes = [_points(spec, lr_points if name == "lr" else knob_points)
            for name, spec in space.items()]
    return [dict(zip(space, values)) for values in itertools.product(*axes)]


@dataclasses.dataclass
class Protocol:
    """What a comparison runs: losses, batch sizes, budgets, trials, repeats and seeds.

    ``trials`` is the base of :data:`TRIALS_RULE`; ``grid`` (learning-rate points) puts
    the trials on a grid instead (``grid_knob_points`` per knob); ``carried`` replaces
    the search by settings carried over from another tier, each at ``lr_factors`` times
    its learning rate.
    """

    losses: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    budgets: tuple[str, ...] = ("images",)
    images: int = 49152
    updates: int = 64
    seconds: float = 60.0
    trials: int = 24
    seeds: tuple[int, ...] = (0, 1, 2)
    tuning_seed: int = 1000
    tuning_repeats: int = 1
    repeat_by: str = "seeds"
    lr_range: tuple[float, float] = LR_RANGE
    grid: int | None = None
    grid_knob_points: int = 3
    # Instead of the search: {(loss, batch): settings} carried over from another tier,
    # each tried at these multiples of its learning rate (the fine-tuning tier).
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
        if not self.seconds > 0:
            raise ValueError(f"seconds must be > 0; received seconds={self.seconds}.")
        if self.trials < 1:
            raise ValueError(f"trials must be >= 1; received trials={self.trials}.")
        if self.tuning_repeats < 1:
            raise ValueError(f"tuning_repeats must be >= 1; received "
                             f"tuning_repeats={self.tuning_repeats}.")
        if self.repeat_by not in REPEAT_BY:
            raise ValueError(f"repeat_by must be one of {REPEAT_BY}; received "
                             f"repeat_by={self.repeat_by!r}.")
        if self.grid is not None and self.grid < 2:
            raise ValueError(f"grid must be >= 2 learning rates; received grid={self.grid}.")
        if self.grid_knob_points < 1:
            raise ValueError(f"grid_knob_points must be >= 1; received "
                             f"grid_knob_points={self.grid_knob_points}.")
        seeds = [self.eval_seed(s, r) for r in range(self.tuning_repeats) for s in self.seeds]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"the evaluation seeds {list(self.seeds)} repeat a seed across "
                             f"the {self.tuning_repeats} tuning repeats (repeat r runs seed "
                             f"s as s + {REPEAT_SEED_STRIDE} r): use smaller seeds.")
        tuning = sorted({self.tuning_seed_of(r) for r in range(self.tuning_repeats)}
                        & set(seeds))
        if tuning:
            raise ValueError(f"the tuning seeds {tuning} must not be evaluation seeds (it "
                             "would score a pick on its own run).")

    def tuning_seed_of(self, repeat: int) -> int:
        return self.tuning_seed + (0 if self.repeat_by == "folds" else repeat)

    @property
    def folds(self) -> int | None:
        """The validation folds the repeats pick on (None: each picks on every class)."""
        return (self.tuning_repeats if self.repeat_by == "folds" and self.tuning_repeats > 1
                else None)

    def fold_of(self, repeat: int) -> int | None:
        """The validation fold repeat ``repeat`` picks on (None: every class)."""
        return repeat if self.folds else None

    @staticmethod
    def eval_seed(seed: int, repeat: int) -> int:
        return seed + REPEAT_SEED_STRIDE * repeat

    def search(self) -> str:
        return "carried" if self.carried is not None else "grid" if self.grid else "tpe"

    def trials_for(self, loss: str) -> int:
        """Trials of one tuning of ``loss``."""
        if self.carried is not None:
            return len(self.lr_factors)
        if self.grid:
            return len(grid_settings(loss, self.grid, self.grid_knob_points, self.lr_range))
        return trials_for_knobs(self.trials, len(search_space(loss, self.lr_range)))

    def cells(self):
        """``(budget, batch, updates, same)`` of every cell; ``same`` marks a budget whose
        updates equal an earlier budget's at that batch (the same cell, run once).
        Under the ``seconds`` budget the updates are each loss's (None here)."""
        largest = max(self.batch_sizes)
        seen = set()
        for budget in self.budgets:
            for batch in sorted(self.batch_sizes):
                if budget == "seconds":
                    yield budget, batch, None, False
                    continue
                updates = updates_for(budget, batch, self.images, self.updates, largest)
                yield budget, batch, updates, (batch, updates) in seen
                seen.add((batch, updates))

    def total_runs(self) -> int:
        """Runs of the whole comparison (at most, under the ``seconds`` budget: a loss
        whose updates there equal another budget's reuses that cell)."""
        distinct = sum(1 for *_, repeat in self.cells() if not repeat)
        # Folds with fixed proposals (grid, carried): one set of trials for every repeat.
        shared = self.folds and self.search() != "tpe"
        trial_sets = 1 if shared else self.tuning_repeats
        return distinct * sum(trial_sets * self.trials_for(loss)
                              + self.tuning_repeats * len(self.seeds)
                              for loss in self.losses)


def _suggest(trial, name, spec):
    kind, low, high = spec
    if kind == "int":
        return trial.suggest_int(name, int(low), int(high))
    return trial.suggest_float(name, float(low), float(high), log=(kind == "log"))


def _stable_seed(*parts) -> int:
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:8], 16)


def settings_text(params: dict, sep: str = " ") -> str:
    """A run's settings as people read them: ``name=value``, sorted, floats to 3 digits."""
    return sep.join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in sorted(params.items()))


def _cached_run(ledger: Ledger, runner: Runner, spec: RunSpec, progress,
                repeat: int) -> dict:
    """The ledger's row of ``spec``, or the run's, trained now and added to it;
    ``progress`` hears of it either way."""
    row = ledger.get(spec)
    cached = row is not None
    if not cached:
        LOG.debug("run: %s %s B=%d u=%d seed %d %s", "test" if spec.test else "tune",
                  spec.loss, spec.batch, spec.updates, spec.seed, settings_text(spec.settings))
        row = ledger.add(spec, runner(spec))
    progress({"spec": spec, "row": row, "cached": cached, "repeat": repeat})
    return row


def _value(row: dict, fold: int | None = None) -> float:
    """A tuning run's validation MAP@R, on validation fold ``fold`` if not None; a failed
    run (no finite value) scores 0."""
    value = row.get("val_map@r") if fold is None else (row.get("val_folds") or {}).get(
        str(fold))
    return float(value) if _finite(value) else 0.0


def _tpe(protocol: Protocol, loss: str, batch: int, updates: int, repeat: int):
    """TPE's proposals, told each value (a generator: ``send`` the value)."""
    optuna = extras.import_extra("compare", "the comparison protocol's tuning (Optuna TPE)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trials = protocol.trials_for(loss)
    sampler = optuna.samplers.TPESampler(seed=_stable_seed(loss, batch, updates, repeat),
                                         n_startup_trials=max(2, trials // 3))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for _ in range(trials):
        trial = study.ask()
        params = {name: _suggest(trial, name, spec)
                  for name, spec in search_space(loss, protocol.lr_range).items()}
        study.tell(trial, (yield params))


def _proposals(protocol: Protocol, loss: str, batch: int, updates: int, repeat: int):
    search = protocol.search()
    if search == "grid":
        return iter(grid_settings(loss, protocol.grid, protocol.grid_knob_points,
                                  protocol.lr_range))
    if search == "carried":
        carried = protocol.carried.get((loss, batch))
        if carried is None:
            raise ValueError(f"no carried settings for {loss} at batch {batch}; carried: "
                             f"{sorted(protocol.carried)}")
        return iter([{**carried, "lr": float(carried["lr"]) * f}
                     for f in protocol.lr_factors])
    return _tpe(protocol, loss, batch, updates, repeat)


def tune(protocol: Protocol, ledger: Ledger, runner: Runner, loss: str, batch: int,
         updates: int, repeat: int = 0,
         progress: Callable[[dict], None] = lambda _: None) -> tuple[dict, list[dict]]:
    """One tuning of ``loss`` at (batch, updates), tuning repeat ``repeat``: its trials
    (TPE, a grid or carried settings; :meth:`Protocol.search`) on the validation
    classes with the repeat's tuning seed. Returns the best trial's settings (the
    highest validation MAP@R; a failed trial scores 0; the first of a tie) and the
    trials' rows."""
    proposals = _proposals(protocol, loss, batch, updates, repeat)
    seed = protocol.tuning_seed_of(repeat)
    best, best_value, rows = None, -1.0, []
    params = next(proposals)
    while True:
        spec = RunSpec(loss, tuple(sorted(params.items())), batch, updates, seed, False)
        row = _cached_run(ledger, runner, spec, progress, repeat)
        rows.append(row)
        value = _value(row, protocol.fold_of(repeat))
        if value > best_value:
            best, best_value = params, value
        try:
            params = proposals.send(value) if hasattr(proposals, "send") else next(proposals)
        except StopIteration:
            return best, rows


def carried_settings(results, budget: str) -> dict:
    """``{(loss, batch): params}`` picked by another comparison (its ``results.json``:
    a list of results, or this version's ``{"results": [...], ...}``) under ``budget``."""
    if isinstance(results, dict):
        results = results.get("results", [])
    return {(r["loss"], r["batch"]): dict(r["params"]) for r in results
            if r["budget"] == budget}


def evaluate(protocol: Protocol, ledger: Ledger, runner: Runner, loss: str, batch: int,
             updates: int, params: dict, repeat: int = 0,
             progress=lambda _: None) -> list[dict]:
    """The evaluation seeds of ``params`` for tuning repeat ``repeat``: one row each,
    test scores included."""
    return [_cached_run(ledger, runner, RunSpec(
                loss, tuple(sorted(params.items())), batch, updates,
                protocol.eval_seed(seed, repeat), True), progress, repeat)
            for seed in protocol.seeds]


def check_runner(protocol: Protocol, runner: Runner) -> None:
    """Refuse, before any run, a protocol that ``runner`` cannot run: the ``seconds``
    budget needs a runner that times its updates (``runner.step_seconds``); repeats by
    folds, one that scores that many validation folds (``runner.val_folds``)."""
    if "seconds" in protocol.budgets and not hasattr(runner, "step_seconds"):
        raise ValueError("the seconds budget times each loss's updates, which this runner "
                         "cannot (the cached-feature tier can: --features)")
    if protocol.folds and getattr(runner, "val_folds", None) != protocol.folds:
        raise ValueError(f"tuning repeats by folds pick on {protocol.folds} "
                         "class-disjoint folds of the validation classes, which this runner "
                         "does not score (the cached-feature tier does: --features)")


def step_seconds(ledger: Ledger, runner: Runner, losses, batch: int) -> dict:
    """``{loss: seconds per update at batch}``: the ledger's timings, the missing ones
    measured now by ``runner.step_seconds``, back to back, and added to it."""
    return {loss: ledger.step_seconds(loss, batch, lambda loss=loss: runner.step_seconds(
        loss, batch)) for loss in losses}


def run(protocol: Protocol, ledger: Ledger, runner: Runner,
        progress: Callable[[dict], None] = lambda _: None) -> list[dict]:
    """The whole comparison: one result per (budget, batch, loss), smallest batch first
    so that a comparison cut short has every loss at the batches it reached.
    ``progress`` hears of every run as it ends (or is found in the ledger): a dict with
    its ``spec``, ``row``, ``repeat`` and whether it was ``cached``."""
    check_runner(protocol, runner)
    results = []
    tuned: dict[tuple, list[dict]] = {}
    for budget, batch, cell_updates, _ in protocol.cells():
        timed = (step_seconds(ledger, runner, protocol.losses, batch)
                 if budget == "seconds" else {})
        for loss in protocol.losses:
            updates = cell_updates or updates_for(
                budget, batch, protocol.images, protocol.updates, max(protocol.batch_sizes),
                protocol.seconds, timed.get(loss))
            if (loss, batch, updates) not in tuned:
                tunings = []
                for repeat in range(protocol.tuning_repeats):
                    params, trials = tune(protocol, ledger, runner, loss, batch, updates,
                                          repeat, progress)
                    rows = evaluate(protocol, ledger, runner, loss, batch, updates, params,
                                    repeat, progress)
                    tunings.append({"repeat": repeat, "params": params, "trials": trials,
                                    "rows": rows})
                tuned[(loss, batch, updates)] = tunings
            results.append(summarise(budget, batch, updates, loss,
                                     tuned[(loss, batch, updates)], protocol))
            if budget == "seconds":
                results[-1].update(budget_seconds=protocol.seconds,
                                   step_seconds=timed[loss])
    return with_paired_differences(results)


def summarise(budget, batch, updates, loss, tunings: list[dict], protocol: Protocol) -> dict:
    """The result of one cell: its tunings' picks and trials counted per tuning, and
    the (repeat, seed) units of their evaluation runs with the interval over them."""
    units = [(t["repeat"], row) for t in tunings for row in t["rows"]]
    mean, half, kind = nested_interval((r, row.get("test_map@r")) for r, row in units)
    vals = [row["val_map@r"] for _, row in units if _finite(row.get("val_map@r"))]
    picks = [{"repeat": t["repeat"], "params": t["params"], "trials": len(t["trials"]),
              "val_map@r": max((_value(r, protocol.fold_of(t["repeat"]))
                                for r in t["trials"]), default=None),
              "edges": edge_knobs(loss, t["params"], protocol.lr_range)} for t in tunings]
    seconds = sum(r.get("seconds", 0.0) for t in tunings for r in t["trials"] + t["rows"])
    return {"budget": budget, "batch": batch, "updates": updates, "images": batch * updates,
            "loss": loss, "params": tunings[0]["params"], "picks": picks,
            "test_map@r": mean, "ci95": half, "interval": kind,
            "repeats": [r for r, _ in units], "seeds": [row["seed"] for _, row in units],
            "per_seed": [row.get("test_map@r") for _, row in units],
            "val_eval": sum(vals) / len(vals) if vals else float("nan"),
            "statuses": [row.get("status", "ok") for _, row in units],
            "val_map@r": picks[0]["val_map@r"], "trials": picks[0]["trials"],
            "seconds": seconds, "curves": [row.get("curve") for _, row in units]}


def _units(result: dict) -> dict:
    return {(r, s): v for r, s, v in zip(result["repeats"], result["seeds"],
                                         result["per_seed"])}


def with_paired_differences(results: list[dict]) -> list[dict]:
    """Each result gains ``best_peer`` and ``vs_best_peer``: its paired test difference
    (mean, 95 % half-width; :func:`nested_interval` over the shared (repeat, seed)
    units) against the peer of its cell with the best validation MAP@R of its
    evaluation runs (chosen on validation, never on test); and ``best_ap``, the AP
    loss of its cell chosen the same way."""
    by_cell: dict[tuple, list[dict]] = {}
    for r in results:
        by_cell.setdefault((r["budget"], r["batch"]), []).append(r)
    for cell in by_cell.values():
        peers = [r for r in cell if r["loss"] in PEERS and _finite(r["val_eval"])]
        if not peers:
            continue
        best = max(peers, key=lambda r: r["val_eval"])
        aps = [r for r in cell if r["loss"] in AP_LOSSES and _finite(r["val_eval"])]
        best_ap = max(aps, key=lambda r: r["val_eval"])["loss"] if aps else None
        theirs = _units(best)
        for r in cell:
            pairs = [(unit[0], v - theirs[unit]) for unit, v in _units(r).items()
                     if unit in theirs and _finite(v) and _finite(theirs[unit])]
            mean, half, _ = nested_interval(pairs)
            r["best_peer"], r["best_ap"] = best["loss"], best_ap
            r["vs_best_peer"] = (mean, half) if r is not best else None
    return results


def with_baseline_differences(results: list[dict], frozen: float) -> list[dict]:
    """Each result gains ``vs_frozen``: its test MAP@R minus the frozen features' (a
    fixed number, so the interval is the result's own)."""
    for r in results:
        r["vs_frozen"] = (r["test_map@r"] - frozen, r["ci95"])
    return results
