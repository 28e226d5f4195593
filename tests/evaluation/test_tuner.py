"""The ScaNN tuner: reaches a target recall, falls back to exact, bounded cost, reports.

Data: seeded clustered unit vectors (a few thousand x 32). Speed comparisons use the
tuner's deterministic cost model (``speed="model"``) or an injected clock, never the
wall time of this (loaded) machine.
"""

import dataclasses
import json
import logging
import math

import numpy as np
import pytest

from tests.support import needs_scann
from tfaploss.cli import build_parser
from tfaploss.config import ConfigError, config_from_dict
from tfaploss.evaluation import ExactSearcher, ScannSearcher, build_searcher, evaluate
from tfaploss.evaluation.scann_search import candidate_settings, estimated_cost
from tfaploss.evaluation.search_plan import SearchPlan
from tfaploss.evaluation.searchers import Searcher, load_searcher
from tfaploss.evaluation.tuner import measure_recall, tune_searcher, wilson_interval

TUNER_LOG = "tfaploss.evaluation.tuner"


def _scann(target, k=10):
    """The plan of a search of ScaNN's settings tuned to recall@k >= ``target``."""
    return SearchPlan("scann", target, k)


def _clustered(seed, n, d=32, clusters=40, spread=0.5, centres_seed=123):
    """Unit vectors around fixed centres (the same distribution for every ``seed``)."""
    centres = np.random.default_rng(centres_seed).standard_normal((clusters, d))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, clusters, n)
    x = centres[labels] + spread * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32), labels


def _random(seed, n, d):
    x = np.random.default_rng(seed).standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


class _Clock:
    """A fake clock: every reading advances it by ``step`` seconds (with ``shrinking``,
    by ``step / n`` at the n-th reading: each timed search looks faster than the one
    before it, so every ScaNN setting beats exact search, which is timed first)."""

    def __init__(self, step=1.0, shrinking=False):
        self.now, self.step, self.shrinking, self.calls = 0.0, step, shrinking, 0

    def __call__(self):
        self.calls += 1
        self.now += self.step / self.calls if self.shrinking else self.step
        return self.now


@needs_scann
def test_tuned_setting_reaches_the_target_on_fresh_queries(caplog):
    db, _ = _clustered(0, 4000)
    target = 0.9
    with caplog.at_level(logging.INFO, logger=TUNER_LOG):
        searcher, info = tune_searcher(db, _scann(target), speed="model", max_settings=40)
    assert isinstance(searcher, ScannSearcher) and searcher.tuning is info
    assert not info["fell_back"] and info["backend"] == "scann_ah"
    assert info["recall"] >= target and info["speedup"] > 1
    assert info["recall_ci"][0] <= info["recall"] <= info["recall_ci"][1]
    assert info["num_sample_queries"] == 1000
    # A progress line per setting tried, then the choice.
    lines = [r.getMessage() for r in caplog.records if r.name == TUNER_LOG]
    progress = [m for m in lines if m.lstrip().startswith("[")]
    assert len(progress) == info["settings_tried"]
    assert all("recall@10" in m and "CI" in m and "q/s" in m for m in progress)
    assert any(m.startswith("tuning: chose") for m in lines)

    fresh, _ = _clustered(1, 1000)
    got = measure_recall(searcher, db, 10, queries=fresh)
    # Tolerance: the sample's recall and the fresh set's are two estimates from 1,000
    # queries each, and the tuner keeps the first setting whose sample estimate crosses
    # the target; 1.96 standard errors of their difference (per-query recall variance
    # <= p (1 - p), see the tuner's interval) bound what sampling alone explains.
    margin = 1.96 * math.sqrt(2 * target * (1 - target) / 1000)
    assert got["recall"] >= target - margin, (got, info["setting"])


def test_falls_back_to_exact_on_a_tiny_database(caplog):
    db, _ = _clustered(0, 300)
    with caplog.at_level(logging.INFO, logger=TUNER_LOG):
        searcher, info = tune_searcher(db, _scann(0.9), speed="model")
    assert isinstance(searcher, ExactSearcher) and searcher.tuning is info
    assert info["fell_back"] and info["backend"] == "exact" and info["recall"] == 1.0
    assert info["settings_tried"] == 0  # the cost model rules every setting out
    assert "faster than exact" in info["reason"]
    assert any(r.levelno == logging.WARNING and "using exact search" in r.getMessage()
               for r in caplog.records)


@needs_scann
def test_falls_back_when_the_target_cannot_be_met():
    db = _random(0, 3000, 64)
    searcher, info = tune_searcher(db, _scann(1.0), speed="model", max_settings=5)
    assert isinstance(searcher, ExactSearcher) and info["fell_back"]
    assert info["settings_tried"] == 5 and info["stopped"].startswith("max_settings")
    assert all(t["recall"] < 1.0 for t in info["tried"])


@needs_scann
def test_falls_back_when_no_setting_is_faster_than_exact():
    # Every search of the sample takes one tick of the fake clock, exact search too:
    # a setting that reaches the target is not faster, so it does not count.
    db, _ = _clustered(0, 3000)
    searcher, info = tune_searcher(db, _scann(0.5), speed="measure", timer=_Clock(),
                                   max_settings=4, max_seconds=1e9)
    assert isinstance(searcher, ExactSearcher) and info["fell_back"]
    assert info["settings_tried"] == 4
    assert any(t["recall"] >= 0.5 for t in info["tried"])
    assert not any(t["met"] for t in info["tried"])


@needs_scann
def test_cost_is_bounded_and_the_search_stops_early():
    db, _ = _clustered(0, 3000)
    space = [s for s in candidate_settings(3000, 32, 10)
             if estimated_cost(s, 3000, 32) < estimated_cost(None, 3000, 32)]
    assert len(space) > 20
    # An easy target is met by one of the first settings, then the search stops.
    _, info = tune_searcher(db, _scann(0.3), speed="model")
    assert info["stopped"] == "target met" and info["settings_tried"] <= 3
    # Measured speed: `patience` more settings after the first success, no more.
    _, info = tune_searcher(db, _scann(0.3), timer=_Clock(shrinking=True), patience=2,
                            max_seconds=1e9)
    first = next(i for i, t in enumerate(info["tried"]) if t["met"])
    later = [t for t in info["tried"][first + 1:]
             if t["estimated_cost"] >= info["tried"][first]["estimated_cost"]]
    assert info["stopped"] == "target met" and len(later) <= 2
    # The time bound (the fake clock makes every step take 10 s).
    _, info = tune_searcher(db, _scann(0.999), speed="model", timer=_Clock(10.0),
                            max_seconds=100)
    assert info["stopped"].startswith("max_seconds") and info["settings_tried"] < 10
    # The number-of-settings bound.
    _, info = tune_searcher(db, _scann(0.999), speed="model", max_settings=3)
    assert info["settings_tried"] <= 3


def test_candidates_are_ordered_by_cost():
    space = candidate_settings(50_000, 64, 10)
    costs = [estimated_cost(s, 50_000, 64) for s in space]
    assert costs == sorted(costs)
    kinds = {(s.num_leaves is None, s.leaf_scoring, s.dimensions_per_block,
              s.anisotropic_quantization_threshold) for s in space}
    assert (True, "ah", 2, 0.2) in kinds and (False, "brute_force", None, None) in kinds
    assert (False, "ah", 1, 0.2) in kinds and (False, "ah", 2, None) in kinds
    assert len({s.num_leaves for s in space}) == 3  # none, sqrt(N), 2 sqrt(N)
    assert len({s.reorder_num_neighbors for s in space if s.leaf_scoring == "ah"}) == 3


def test_wilson_interval():
    lo, hi = wilson_interval(1.0, 1000)
    assert hi == 1.0 and 0.995 < lo < 1.0  # not a point at recall 1
    lo, hi = wilson_interval(0.5, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)


@needs_scann
def test_build_searcher_knob_and_errors(tmp_path):
    db, _ = _clustered(0, 3000)
    queries, _ = _clustered(5, 200)
    s = build_searcher(db, "scann", target_recall=0.8, k=5, queries=queries, speed="model")
    assert s.tuning["k"] == 5 and s.tuning["sample"] == "user queries"
    assert s.tuning["num_sample_queries"] == 200
    if isinstance(s, ScannSearcher):  # a tuned searcher is saved and restored whole
        restored = load_searcher(s.serialize(str(tmp_path / "s")))
        np.testing.assert_array_equal(restored.search(queries, 5)[0], s.search(queries, 5)[0])
    # The plan owns the rule: a target recall tunes ScaNN whatever the backend names
    # (exact search has recall 1), so "exact" + a target is tuned, not refused.
    tuned = build_searcher(db, "exact", target_recall=0.8, k=5, queries=queries,
                           speed="model")
    assert tuned.tuning["k"] == 5 and tuned.tuning["target_recall"] == 0.8
    with pytest.raises(ValueError, match="target_recall"):
        build_searcher(db, "exact", target_recall=1.5)
    with pytest.raises(ValueError, match="only apply with"):
        build_searcher(db, "exact", k=5)
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            SearchPlan("scann", bad)
    with pytest.raises(ValueError, match="tunes nothing"):
        tune_searcher(db, SearchPlan("scann"))
    # Untuned searchers still work as before.
    assert build_searcher(db).backend == "exact"
    assert build_searcher(db, "scann_ah").backend == "scann_ah"


@needs_scann
def test_tree_with_brute_force_leaves_round_trips(tmp_path):
    db, _ = _clustered(0, 3000)
    s = ScannSearcher(db, mode="ah", num_leaves=50, num_leaves_to_search=50,
                      leaf_scoring="brute_force")
    idx, _ = s.search(db[:50], 10)
    exact, _ = ExactSearcher(db).search(db[:50], 10)
    np.testing.assert_array_equal(idx, exact)  # every leaf, exact scores: exact search
    restored = load_searcher(s.serialize(str(tmp_path / "bf")))
    assert restored.params["leaf_scoring"] == "brute_force"
    np.testing.assert_array_equal(restored.search(db[:50], 10)[0], idx)
    with pytest.raises(ValueError, match="leaf_scoring"):
        ScannSearcher(db, mode="ah", leaf_scoring="lsh")


@needs_scann
def test_every_report_states_backend_setting_and_recall(tmp_path):
    emb, labels = _clustered(0, 3000)
    # Exact (the default): recall 1.
    result = evaluate(emb, labels, ks=(1, 10), verbose=0, output_dir=str(tmp_path / "e"))
    search = json.loads((tmp_path / "e" / "metrics.json").read_text())["details"]["search"]
    assert search["backend"] == "exact" and search["recall"] == 1.0
    assert search["recall_ci"] == [1.0, 1.0]
    assert "search: exact, recall@10 1" in result.table()
    # Tuned.
    result = evaluate(emb, labels, ks=(1, 10), verbose=0, target_recall=0.9, speed="model",
                      output_dir=str(tmp_path / "t"))
    search = json.loads((tmp_path / "t" / "metrics.json").read_text())["details"]["search"]
    assert search["tuned"] and search["target_recall"] == 0.9 and search["k"] == 10
    for key in ("backend", "setting", "recall", "recall_ci", "ci_method", "speedup"):
        assert key in search
    assert "Wilson" in search["ci_method"]
    table = result.table()
    if search["fell_back"]:
        assert "search: exact, recall@10 1 (tuning fell back" in table
    else:
        assert f"search: {search['backend']}, {search['setting']}; recall@10" in table
        assert search["recall"] >= 0.9 and "95% Wilson CI" in table
    # Untuned ScaNN: its recall is measured on a sample.
    result = evaluate(emb, labels, ks=(1, 10), backend="scann_ah", verbose=0)
    search = result.details["search"]
    assert search["backend"] == "scann_ah" and not search["tuned"]
    assert 0 < search["recall"] <= 1 and search["num_sample_queries"] == 1000
    assert "95% Wilson CI" in result.table()
    # A tuner that falls back says so in the table.
    small, small_labels = _clustered(0, 300)
    result = evaluate(small, small_labels, ks=(1, 10), verbose=0, target_recall=0.9,
                      speed="model")
    assert result.details["backend"] == "exact" and result.details["search"]["fell_back"]
    assert "tuning fell back" in result.table()
    with pytest.raises(ValueError, match="target_recall"):
        evaluate(emb, labels, verbose=0, target_recall=1.2)


MINIMAL = {"loss": {"name": "APLoss"}}


@pytest.mark.parametrize("value", [0.5, 0.95, 1, None])
def test_config_accepts_target_recall(value):
    cfg = config_from_dict(MINIMAL, [f"evaluation.target_recall={json.dumps(value)}"],
                           warn=False)
    assert cfg.evaluation.target_recall == value


def test_config_default_is_exact_search():
    cfg = config_from_dict(MINIMAL, [], warn=False)
    # auto, which without a target recall is exact search
    assert cfg.evaluation.target_recall is None and cfg.evaluation.backend == "auto"
    assert cfg.evaluation.search_plan == SearchPlan("auto", None)
    assert cfg.evaluation.search_plan.resolved == "exact"


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "true", "'high'"])
def test_config_refuses_target_recall(value):
    with pytest.raises(ConfigError, match="evaluation.target_recall"):
        config_from_dict(MINIMAL, [f"evaluation.target_recall={value}"], warn=False)


@pytest.mark.parametrize("target", [None, pytest.param(0.9, marks=needs_scann)])
def test_training_time_evaluation_honours_target_recall(monkeypatch, target):
    """The evaluation of `tfaploss train` (every N epochs and at the end) searches as
    `evaluation.target_recall` asks, and says what it measured."""
    from tfaploss.run import trainer

    emb, labels = _clustered(0, 3000)
    monkeypatch.setattr(trainer, "embed_split", lambda *args, **kwargs: (emb, labels))
    cfg = config_from_dict(MINIMAL, [f"evaluation.target_recall={json.dumps(target)}",
                                     "evaluation.ks=[1,10]"], warn=False)
    search = {}
    metrics = trainer.evaluate_split(None, cfg, "unused", search=search)
    exact = trainer.evaluate_split(None, config_from_dict(MINIMAL, ["evaluation.ks=[1,10]"],
                                                          warn=False), "unused")
    if target is None:
        # backend auto (the default) records its choice, exact search; nothing tuned
        assert "search_recall" not in metrics and search["auto"]["chosen"] == "exact"
        assert search["backend"] == "exact" and search["recall"] == 1.0
        named = {}
        trainer.evaluate_split(None, config_from_dict(
            MINIMAL, ["evaluation.ks=[1,10]", "evaluation.backend=exact"], warn=False),
            "unused", search=named)
        # a named backend: the report says how it searched, and records no auto choice
        assert named == {"backend": "exact", "setting": "exact", "k": 10, "recall": 1.0,
                         "recall_ci": [1.0, 1.0],
                         "ci_method": "exact search: recall 1 by construction"}
        return
    assert search["backend"] in ("scann_ah", "exact") and search["setting"]
    assert search["recall"] == metrics["search_recall"]
    assert search["recall_ci"][0] >= target  # the tuner's acceptance rule
    # approximate search loses a little, never a lot, of the exact metrics
    assert metrics["recall@1"] == pytest.approx(exact["recall@1"], abs=0.02)


def test_cli_target_recall_flag(capsys):
    from tfaploss.cli import main

    parser = build_parser()
    base = ["evaluate", "--model", "m.keras", "--data", "d"]
    assert parser.parse_args(base).target_recall is None
    assert parser.parse_args([*base, "--target-recall", "0.95"]).target_recall == 0.95
    assert parser.parse_args([*base, "--target-recall", "1"]).target_recall == 1.0
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--target-recall", "abc"])
    assert "--target-recall" in capsys.readouterr().err
    # a number out of range: refused by the search plan, naming the flag, before any
    # file is read
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit, match=r"^error: --target-recall: .*\(0, 1\]"):
            main([*base, "--target-recall", bad])


@needs_scann
def test_unfilled_rows_are_padding_not_neighbours():
    # 2 of 100 leaves hold ~60 points: a search for 500 cannot be filled. Batched ScaNN
    # pads such rows with index 0 and a NaN score; they must come back as -1 / -inf
    # (counted as index 0 they inflated mAP above 1).
    db, labels = _clustered(0, 3000)
    s = ScannSearcher(db, mode="ah", num_leaves=100, num_leaves_to_search=2,
                      leaf_scoring="brute_force")
    idx, scores = s.search(db[:20], 500, exclude=np.arange(20))
    real = idx >= 0
    assert (~real).any() and np.all(np.isneginf(scores[~real]))
    for row, ok in zip(idx, real):
        assert len(set(row[ok].tolist())) == ok.sum()  # no duplicates
    from tfaploss.evaluation import retrieval_metrics

    m = retrieval_metrics(db, labels, ks=(1, 10), searcher=s)
    assert all(0 <= v <= 1 for v in m.values())


# -- Re-timing: a fake backend whose searches take scripted times on a fake clock --------

class _ScriptedClock:
    """Reads the time without moving it; a fake search moves it by its duration."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@dataclasses.dataclass(frozen=True)
class _FakeSetting:
    name: str
    missing: int  # result columns replaced by non-neighbours: recall = 1 - missing / k

    @property
    def build_key(self):
        return self.name

    def describe(self):
        return self.name


class _FakeSearcher(Searcher):
    """Exact results with ``missing`` columns knocked out; each search takes the next
    of its scripted durations on the shared clock and is logged by name."""

    backend = "fake"
    approximate = True

    def __init__(self, database, setting, clock, durations, log):
        super().__init__(database)
        self.database, self.setting = database, setting
        self.clock, self.durations, self.log = clock, durations, log

    def _search(self, queries, k):
        self.clock.now += self.durations[self.setting.name].pop(0)
        self.log.append(self.setting.name)
        idx, scores = ExactSearcher(self.database, engine="numpy")._search(queries, k)
        if self.setting.missing:
            idx = idx.copy()
            idx[:, k - self.setting.missing:] = -1
        return idx, scores


class _FakeSpace:
    name = "fake"

    def __init__(self, settings, clock, durations, log):
        self.settings, self.clock, self.durations, self.log = settings, clock, durations, log

    def check(self):
        pass

    def candidates(self, n, d, k):
        return list(self.settings)

    def cost(self, setting, n, d, k):
        return 0.5 * n * d if setting is not None else float(n * d)

    def dominates(self, a, b):
        return False

    def probe(self, setting):
        return None

    def build(self, database, setting, k, num_threads):
        return _FakeSearcher(database, setting, self.clock, self.durations, self.log)

    def configure(self, searcher, setting):
        searcher.setting = setting


def _tune_fake(monkeypatch, durations, settings, target=0.8, **kwargs):
    """Tune over ``settings`` with scripted search durations (seconds, per search, in
    call order; "exact" for exact search). Returns (info, the log of searches)."""
    from tfaploss.evaluation import tuner

    clock, log = _ScriptedClock(), []
    durations = {name: list(times) for name, times in durations.items()}

    class _SlowExact(ExactSearcher):
        def _search(self, queries, k):
            clock.now += durations["exact"].pop(0)
            log.append("exact")
            return super()._search(queries, k)

    monkeypatch.setattr(tuner, "ExactSearcher", _SlowExact)
    # the fake space stands in for ScaNN's, which the plan's tuner names
    monkeypatch.setitem(tuner.SPACES, "scann", _FakeSpace(settings, clock, durations, log))
    db = _random(0, 400, 8)
    queries = _random(1, 200, 8)
    kwargs.setdefault("max_seconds", 1e6)
    _, info = tune_searcher(db, _scann(target), queries, timer=clock, patience=5, **kwargs)
    return info, log


# A: recall 1.0 (margin ~0.18 above 0.8 at 200 queries); B: recall 0.9 (margin ~0.05).
_A, _B = _FakeSetting("A", 0), _FakeSetting("B", 1)


def test_retiming_is_round_robin_over_exact_and_the_finalists(monkeypatch):
    durations = {"exact": [2.0] * 5, "A": [1.0] * 5, "B": [0.5] * 5}
    info, log = _tune_fake(monkeypatch, durations, [_B, _A])
    # the walk: exact twice, then each setting twice (warm-up + timed); then three
    # rounds, each timing every finalist once (fastest first) after exact search
    assert log[:6] == ["exact", "exact", "B", "B", "A", "A"]
    assert log[6:] == ["exact", "B", "A"] * 3
    assert info["timing"]["rounds"] == 3
    assert [f["setting"] for f in info["timing"]["finalists"]] == ["B", "A"]
    # B is twice as fast as A and their times do not overlap: speed decides
    assert info["setting"] == "B"


def test_choice_holds_when_noise_reorders_overlapping_timings(monkeypatch):
    # A and B overlap in time; which is faster by median flips with the noise (A on a
    # quiet machine, B when A's runs are slowed), the choice does not: A, whose recall
    # margin above the target is larger. Fastest-by-median would flip from A to B.
    quiet = {"exact": [5.0] * 5, "A": [1.0, 1.0, 0.90, 0.95, 0.92],
             "B": [0.9, 0.9, 0.95, 1.05, 1.00]}
    busy_a = dict(quiet, A=[1.0, 1.0, 1.05, 1.02, 1.04])  # A inflated within B's range
    choices, faster = [], []
    for durations in (quiet, busy_a):
        info, _ = _tune_fake(monkeypatch, durations, [_B, _A])
        a, b = info["timing"]["finalists"][::-1] if info["timing"]["finalists"][0][
            "setting"] == "B" else info["timing"]["finalists"]
        faster.append("A" if a["median_s"] < b["median_s"] else "B")
        choices.append(info["setting"])
        assert "largest recall margin" in info["reason"]
        assert info["timing"]["chosen_margin"] > 0.1
    assert faster == ["A", "B"] and choices == ["A", "A"]


def test_margin_preference_only_among_overlapping_timings(monkeypatch):
    # B is clearly faster (its slowest run beats A's fastest): speed wins over margin.
    durations = {"exact": [5.0] * 5, "A": [2.0, 2.0, 2.1, 1.9, 2.0],
                 "B": [1.0, 1.0, 1.05, 0.95, 1.1]}
    info, _ = _tune_fake(monkeypatch, durations, [_B, _A])
    assert info["setting"] == "B" and info["reason"].startswith("fastest by median")
    a, b = (next(t for t in info["tried"] if t["setting"] == s) for s in "AB")
    assert a["recall_ci"][0] > b["recall_ci"][0] >= 0.8


def test_report_records_the_timing_noise_and_rounds_fit_the_budget(monkeypatch):
    durations = {"exact": [4.0, 4.0, 4.4, 3.6, 4.0], "A": [1.0, 1.0, 1.5, 1.0, 0.5],
                 "B": [9.0] * 5}  # B misses the target: never a finalist
    info, log = _tune_fake(monkeypatch, durations, [_A, _FakeSetting("B", 4)])
    assert log.count("B") == 2  # timed in the walk only
    timing = info["timing"]
    exact, (a,) = timing["exact"], timing["finalists"]
    assert exact["times_s"] == pytest.approx([4.0, 4.4, 3.6, 4.0])
    assert a["times_s"] == pytest.approx([1.0, 1.5, 1.0, 0.5])
    assert (a["min_s"], a["median_s"], a["max_s"]) == pytest.approx((0.5, 1.0, 1.5))
    assert a["spread"] == pytest.approx(1.0) and exact["spread"] == pytest.approx(0.2)
    assert timing["noise"] == {"median_spread": pytest.approx(0.6),
                               "max_spread": pytest.approx(1.0)}
    assert info["qps"] == pytest.approx(200 / 1.0) and info["speedup"] == pytest.approx(4.0)
    json.dumps(info)  # the report stays JSON-able
    # A budget with room for the walk and one round only: one round is timed.
    durations = {"exact": [4.0] * 5, "A": [1.0] * 5, "B": [9.0] * 5}
    info, _ = _tune_fake(monkeypatch, durations, [_A, _FakeSetting("B", 4)],
                         max_seconds=4 * 2 + 2 + 18 + 5.5)
    assert info["timing"]["rounds"] == 1 and info["seconds"] <= 4 * 2 + 2 + 18 + 5.5
