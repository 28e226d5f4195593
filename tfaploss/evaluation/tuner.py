"""The walk to a target recall: tune a backend's settings on the user's own data, and
measure the recall reached.

:func:`tune_searcher` holds out a seeded sample of queries, takes their exact top-k,
walks the settings of the plan's :class:`~tfaploss.evaluation.searchers.SearchSpace`
cheapest first by the cost model (skipping settings a probe or a dominating setting
already ruled out), re-times the fastest settings that met the target against exact
search, and falls back to exact search when none beats it. A setting meets the target
when the lower end of the 95 % Wilson interval of its recall@k on the sample reaches
it. The full rule, and why the interval is Wilson's, is in ``docs/search.md`` ("Tuning
to a target recall").
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from tfaploss.evaluation.arrays import as_matrix, check_int
from tfaploss.evaluation.exact_search import ExactSearcher
from tfaploss.evaluation.faiss_search import FaissSpace
from tfaploss.evaluation.scann_search import ScannSpace
from tfaploss.evaluation.search_plan import SearchPlan
from tfaploss.evaluation.searchers import Searcher, SearchSpace, exact_cost

LOG = logging.getLogger(__name__)

__all__ = ["CI_METHOD", "SPACES", "measure_recall", "recall_per_query", "tune_searcher",
           "wilson_interval"]

CI_METHOD = ("95% Wilson score interval over the sample queries (per-query recall@k as one "
             "trial; conservative, see tfaploss.evaluation.tuner)")
_MODEL_UNIT_SECONDS = 1e-10  # the nominal time of one unit when speed="model"
_MAX_BUILDS_KEPT = 4         # built indexes kept for later settings (LRU, the best kept)
_MAX_FINALISTS = 4           # settings that met the target re-timed against each other
# The spaces a plan's `tuner` names.
SPACES: dict[str, SearchSpace] = {"scann": ScannSpace(), "faiss": FaissSpace()}


def wilson_interval(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a success rate ``p`` observed over ``n`` trials."""
    if n <= 0:
        return 0.0, 1.0
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def recall_per_query(found: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Per query, the share of its exact top-k (``truth`` row) present in ``found``."""
    found = np.asarray(found)
    truth = np.asarray(truth)
    hits = np.array([np.isin(t, f).sum() for f, t in zip(found, truth)], np.float64)
    return hits / max(truth.shape[1], 1)


def _summary(per_query: np.ndarray) -> tuple[float, list[float]]:
    mean = float(per_query.mean()) if per_query.size else 0.0
    lo, hi = wilson_interval(mean, int(per_query.size))
    return mean, [round(lo, 6), round(hi, 6)]


def _sample(database, queries, sample_size: int, seed: int):
    """(sample queries, exclude or None, description)."""
    rng = np.random.default_rng(seed)
    if queries is not None:
        pick = np.sort(rng.choice(len(queries), min(sample_size, len(queries)), replace=False))
        return queries[pick], None, "user queries"
    pick = np.sort(rng.choice(len(database), min(sample_size, len(database)), replace=False))
    return database[pick], pick.astype(np.int64), \
        "database points, each excluded from its own results"


def _timed(timer: Callable[[], float], fn):
    t0 = timer()
    out = fn()
    return out, max(timer() - t0, 1e-9)


def _time_stats(name: str, times: list[float]) -> dict[str, Any]:
    mid = float(np.median(times))
    return {"setting": name, "times_s": [float(t) for t in times], "min_s": float(min(times)),
            "median_s": mid, "max_s": float(max(times)),
            "spread": float((max(times) - min(times)) / mid) if mid > 0 else 0.0}


def _retime(tried, built, space, exact, t_exact, sample, k, exclude, timer, start,
            max_seconds, rounds):
    """Time exact search and the finalists (the fastest kept builds that met the target)
    again, round-robin so that a burst of load falls on all of them, while the budget
    lasts. Returns (the report's ``timing``, the finalists in its order)."""
    finalists = sorted((e for e in tried if e["met"] and e["_setting"].build_key in built),
                       key=lambda e: -e["qps"])[:_MAX_FINALISTS]
    exact_times = [t_exact]
    players = [(None, exact, exact_times)] + [
        (e["_setting"], built[e["_setting"].build_key], e["_times"]) for e in finalists]
    done = 0
    for _ in range(rounds if finalists else 0):
        expected = sum(float(np.median(times)) for _, _, times in players)
        if timer() - start + expected > max_seconds:
            break
        for setting, searcher, times in players:
            if setting is not None:
                space.configure(searcher, setting)
            times.append(_timed(timer, lambda s=searcher: s.search(sample, k,
                                                                   exclude=exclude))[1])
        done += 1
    stats = [_time_stats(e["setting"], e["_times"]) for e in finalists]
    exact_stats = _time_stats("exact", exact_times)
    spreads = [s["spread"] for s in [exact_stats, *stats]]
    timing = {
        "rounds": done, "order": "round-robin: exact search, then each finalist, once a round",
        "exact": exact_stats, "finalists": stats,
        # max-min over median of one setting's times: how much the machine moved them
        "noise": {"median_spread": float(np.median(spreads)),
                  "max_spread": float(max(spreads))} if done else None,
    }
    return timing, finalists


def _choose(timing, finalists, target_recall, num_queries):
    """Among the finalists faster than exact search by median time, those whose time
    range overlaps the fastest's cannot be told apart by speed: the largest recall margin
    wins, then the faster. Returns ``(qps, setting, entry)`` or ``None``."""
    exact_median = timing["exact"]["median_s"]
    pool = [(e, s) for e, s in zip(finalists, timing["finalists"])
            if s["median_s"] < exact_median]
    if not pool:
        timing["choice"] = "no finalist faster than exact search by median time"
        return None
    _, fastest = min(pool, key=lambda p: p[1]["median_s"])
    tied = [p for p in pool if p[1]["min_s"] <= fastest["max_s"]]
    entry, stats = max(tied, key=lambda p: (p[0]["recall_ci"][0], -p[1]["median_s"]))
    timing["choice"] = (
        f"fastest by median time of the {len(pool)} finalist(s) faster than exact search"
        if len(tied) == 1 else
        f"largest recall margin among the {len(tied)} finalists whose times overlap the "
        f"fastest's (of {len(pool)} faster than exact search by median time)")
    timing["chosen_margin"] = entry["recall_ci"][0] - target_recall
    return num_queries / stats["median_s"], entry["_setting"], entry


def measure_recall(searcher: Searcher, database, k: int, queries=None,
                   sample_size: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Recall@k of ``searcher`` against exact search on a sample (see the module doc)."""
    database = as_matrix(database, "database")
    q = None if queries is None else as_matrix(queries, "queries")
    sample, exclude, what = _sample(database, q, sample_size, seed)
    truth, _ = ExactSearcher(database).search(sample, k, exclude=exclude)
    found, _ = searcher.search(sample, k, exclude=exclude)
    recall, ci = _summary(recall_per_query(found, truth))
    return {"k": int(truth.shape[1]), "recall": recall, "recall_ci": ci,
            "ci_method": CI_METHOD, "num_sample_queries": len(sample), "sample": what}


def tune_searcher(database, plan: SearchPlan, queries=None, *, sample_size: int = 1000,
                  max_settings: int = 40, max_seconds: float = 120.0, patience: int = 2,
                  speed: str = "measure", timer: Callable[[], float] = time.perf_counter,
                  num_threads: int = 0, seed: int = 0,
                  timing_rounds: int = 3) -> tuple[Searcher, dict[str, Any]]:
    """The fastest searcher of ``plan.tuner``'s space (ScaNN or faiss) whose recall@k on
    a sample reaches ``plan.target_recall``, or the exact searcher when none beats
    exact search (see the module doc).

    Args:
      database: (N, D) embeddings.
      plan: a :class:`~tfaploss.evaluation.search_plan.SearchPlan` with a target
        recall; its ``tuned_k`` is the k of recall@k (capped at the database size, less
        one without queries).
      queries: the user's queries; ``None``: database points (self excluded).
      sample_size: sample queries held out (at most).
      max_settings, max_seconds: the bounds on the tuner's cost (builds included).
      patience: settings still tried once the cost model expects none of those left to
        be cheaper than one that met the target (``speed="measure"`` only).
      speed: ``"measure"`` (wall time via ``timer``) or ``"model"`` (the space's
        deterministic cost model).
      timer: the clock of ``speed="measure"`` and of ``max_seconds``.
      num_threads: ScaNN or faiss threads (0: the library's default).
      timing_rounds: rounds of round-robin re-timing of the finalists
        (``speed="measure"``), each started only when it fits in ``max_seconds``.

    Returns:
      ``(searcher, info)``; ``info`` is also ``searcher.tuning``.
    """
    if plan.tuner is None:
        raise ValueError(f"{plan} tunes nothing: it needs a target recall and a backend "
                         "with settings to tune.")
    if speed not in ("measure", "model"):
        raise ValueError(f"`speed` must be 'measure' or 'model'; received {speed!r}.")
    space, target_recall = SPACES[plan.tuner], plan.target_recall
    check_int("timing_rounds", timing_rounds, low=0)
    check_int("sample_size", sample_size)
    check_int("max_settings", max_settings)
    database = as_matrix(database, "database")
    n, d = database.shape
    q = None if queries is None else as_matrix(queries, "queries")
    if q is None and n < 2:
        raise ValueError("tuning on database points needs at least 2 of them.")
    space.check()
    start = timer()
    sample, exclude, what = _sample(database, q, sample_size, seed)

    def timed_search(searcher, k: int, units: float):
        """(indices found for the sample, seconds): the better of two runs (the first
        pays for the warm-up), or with ``speed="model"`` the nominal time of ``units``."""
        (found, _), t = _timed(timer, lambda: searcher.search(sample, k, exclude=exclude))
        if speed == "measure":
            t = min(t, _timed(timer, lambda: searcher.search(sample, k, exclude=exclude))[1])
        else:
            t = units * _MODEL_UNIT_SECONDS * len(sample)
        return found, t

    exact = ExactSearcher(database)
    truth, t_exact = timed_search(exact, plan.tuned_k, exact_cost(n, d))
    k = int(truth.shape[1])
    exact_qps = len(sample) / t_exact
    exact_units = exact_cost(n, d)
    LOG.info("tuning %s for recall@%d >= %g on %d sample queries (%s); exact search: "
             "%.0f q/s", space.name, k, target_recall, len(sample), what, exact_qps)

    def cost(setting) -> float:
        return space.cost(setting, n, d, k)

    candidates = [s for s in space.candidates(n, d, k) if cost(s) < exact_units]
    built: dict[Any, Searcher] = {}
    failed: list = []
    done: set = set()
    tried: list[dict[str, Any]] = []
    best: tuple[float, Any, dict[str, Any]] | None = None
    best_cost = math.inf  # the lowest estimated cost of a setting that met the target

    def bound_reached() -> str | None:
        if len(tried) >= max_settings:
            return f"max_settings ({max_settings})"
        if timer() - start > max_seconds:
            return f"max_seconds ({max_seconds:g} s)"
        return None

    def trial(setting) -> None:
        nonlocal best, best_cost
        done.add(setting)
        searcher = built.pop(setting.build_key, None)
        if searcher is None:
            searcher = space.build(database, setting, k, num_threads)
        else:
            space.configure(searcher, setting)
        built[setting.build_key] = searcher  # most recently used last
        keep = None if best is None else best[1].build_key
        # Evict the least recently used, but the builds that reached the recall last
        # (their finalists are re-timed at the end), the slowest of those first.
        reached_keys = {e["_setting"].build_key: e["qps"] for e in tried if e["_reached"]}
        order = sorted((key for key in built if key not in (keep, setting.build_key)),
                       key=lambda key: (key in reached_keys, reached_keys.get(key, 0.0)))
        for key in order:
            if len(built) <= _MAX_BUILDS_KEPT:
                break
            del built[key]  # memory: a brute-force tree holds a copy of the database
        found, t = timed_search(searcher, k, cost(setting))
        recall, ci = _summary(recall_per_query(found, truth))
        qps = len(sample) / t
        # The lower end of the interval, not the mean: a setting accepted on its mean
        # lands below the target on fresh queries about half the time.
        met = ci[0] >= target_recall and qps > exact_qps
        entry = {"setting": setting.describe(), "params": asdict(setting),
                 "recall": recall, "recall_ci": ci,
                 "qps": qps, "speedup": qps / exact_qps, "met": met,
                 "estimated_cost": cost(setting) / exact_units,
                 "_setting": setting, "_reached": ci[0] >= target_recall, "_times": [t]}
        tried.append(entry)
        LOG.info("  [%d] %s: recall@%d %.4f (95%% CI %.4f-%.4f), %.0f q/s (%.2fx exact)%s",
                 len(tried), entry["setting"], k, recall, ci[0], ci[1], qps,
                 qps / exact_qps, " <- reaches the target" if met else "")
        if met:
            best_cost = min(best_cost, cost(setting))
            if best is None or qps > best[0]:
                best = (qps, setting, entry)
        elif recall < target_recall:
            failed.append(setting)

    stopped = "search space exhausted"
    after_success = 0
    for setting in candidates:
        if setting in done or any(space.dominates(f, setting) for f in failed):
            continue
        if best is not None and cost(setting) >= best_cost:
            # Nothing left is expected to be cheaper than what met the target.
            if speed == "model" or after_success >= patience:
                stopped = "target met"
                break
            after_success += 1
        if reached := bound_reached():
            stopped = reached
            break
        # A probe that misses rules out every setting it bounds.
        probe = space.probe(setting)
        if probe is not None and probe not in done and cost(probe) < exact_units:
            trial(probe)
            if any(space.dominates(f, setting) for f in failed):
                continue
            if reached := bound_reached():
                stopped = reached
                break
        trial(setting)
    else:
        if best is not None:
            stopped = "target met"
    timing = None
    if speed == "measure":
        timing, finalists = _retime(tried, built, space, exact, t_exact, sample, k, exclude,
                                    timer, start, max_seconds, timing_rounds)
        best = _choose(timing, finalists, target_recall, len(sample))
        LOG.info("tuning: %d round(s) of re-timing over exact search and %d finalist(s); "
                 "timing spread (max-min)/median: %s", timing["rounds"], len(finalists),
                 "n/a" if timing["noise"] is None else
                 f"median {timing['noise']['median_spread']:.2f}, "
                 f"max {timing['noise']['max_spread']:.2f}")
    tried = [{key: v for key, v in e.items() if not key.startswith("_")} for e in tried]
    seconds = timer() - start
    info: dict[str, Any] = {
        "tuned": True, "target_recall": float(target_recall), "k": k,
        "num_sample_queries": len(sample), "sample": what, "ci_method": CI_METHOD,
        "exact_qps": exact_qps, "speed": "measured" if speed == "measure" else "cost model",
        "settings_tried": len(tried), "max_settings": int(max_settings),
        "max_seconds": float(max_seconds), "seconds": seconds, "stopped": stopped,
        "tried": tried,
    }
    if timing is not None:
        info["timing"] = timing
    if best is None:
        reason = (f"no {space.name} setting reached recall@{k} >= {target_recall:g} faster than "
                  f"exact search ({len(tried)} tried, stopped: {stopped})")
        LOG.warning("tuning: %s; using exact search", reason)
        info.update(backend="exact", setting="exact", params={}, recall=1.0,
                    recall_ci=[1.0, 1.0], qps=exact_qps, speedup=1.0, fell_back=True,
                    reason=reason)
        exact.tuning = info
        return exact, info
    qps, setting, entry = best
    # measured speeds compare medians of the same rounds; the model's, nominal times
    speedup = (qps * timing["exact"]["median_s"] / len(sample) if timing is not None
               else qps / exact_qps)
    searcher = built[setting.build_key]
    space.configure(searcher, setting)
    built.clear()
    info.update(backend=searcher.backend, setting=setting.describe(),
                params=asdict(setting), recall=entry["recall"], recall_ci=entry["recall_ci"],
                qps=qps, speedup=speedup, fell_back=False,
                reason=(f"fastest setting reaching recall@{k} >= {target_recall:g}"
                        if timing is None else timing["choice"]))
    LOG.info("tuning: chose %s: recall@%d %.4f (95%% CI %.4f-%.4f) on the sample, %.2fx "
             "exact q/s; %d settings tried in %.1f s (%s)", setting.describe(), k,
             entry["recall"], entry["recall_ci"][0], entry["recall_ci"][1], speedup,
             len(tried), seconds, stopped)
    searcher.tuning = info
    return searcher, info
