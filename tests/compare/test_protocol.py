"""What the comparison protocol guarantees, checked with synthetic runners (no training):

* tuning repeats: R independent tunings, each evaluated on the seeds; the interval over
  the repeats' means holds the tuning noise that one tuning's seed interval leaves out;
* the best peer is chosen on validation, never on test;
* the ledger keys every run on its whole setup: a changed setup starts new cells (and
  says what changed), the old setup's rows are found again, rows of no setup are never
  reused, and a cell's trials are counted per tuning, not per ledger row;
* the grid mode, the budget rule and the flags of picks at the edge of a range;
* tuning repeats by validation folds: each repeat picks on its own fold, and a grid's
  trials are trained once for every repeat.
"""

import json
import math

import pytest

from tfaploss.compare import protocol as P


def test_nested_interval_is_the_t_interval_over_repeat_means():
    # repeat 0: 1, 3 (mean 2); repeat 1: 5, 7 (mean 6): t(0.975, 1) = 12.706, sd = 2*sqrt(2)
    mean, half, kind = P.nested_interval([(0, 1.0), (0, 3.0), (1, 5.0), (1, 7.0)])
    assert kind == "repeats" and mean == 4.0
    assert half == pytest.approx(12.706 * (2 * math.sqrt(2)) / math.sqrt(2))
    # one repeat: the seeds' t-interval; non-finite values are left out
    mean, half, kind = P.nested_interval([(0, 1.0), (0, 2.0), (0, 3.0), (1, float("nan"))])
    assert kind == "seeds" and mean == 2.0
    assert half == pytest.approx(4.303 / math.sqrt(3), rel=1e-4)


def _noisy_tuning(calls, noise=8.0):
    """Validation peaks at lr = 3e-3 plus a tuning noise that depends on the seed and
    the setting (so each repeat picks another rate); test = 80 - 10 |log10(lr/3e-3)|
    plus a small seed effect. SupCon scores 5 more on test but 5 less on validation
    than the triplet."""

    def runner(spec):
        calls.append(spec)
        lr = spec.settings["lr"]
        quality = 80 - 10 * abs(math.log10(lr / 3e-3))
        offset = {"SupCon": 5.0, "Triplet": 0.0}.get(spec.loss, 1.0)
        if spec.test:
            return {"status": "ok", "val_map@r": quality - offset,
                    "test_map@r": quality + offset + 0.1 * (spec.seed % 10), "seconds": 0.1}
        tuning = noise * math.sin(1e4 * lr + 7 * spec.seed)
        return {"status": "ok", "val_map@r": quality + tuning, "seconds": 0.1}

    return runner


def test_tuning_repeats_widen_the_interval_and_pair_units(tmp_path):
    one = P.Protocol(("APLoss",), (32,), images=256, trials=6, seeds=(0, 1, 2))
    two = P.Protocol(("APLoss",), (32,), images=256, trials=6, seeds=(0, 1, 2),
                     tuning_repeats=2)
    calls = []
    ledger = P.Ledger(tmp_path / "ledger.jsonl", "features")
    [single] = P.run(one, ledger, _noisy_tuning(calls))
    [double] = P.run(two, ledger, _noisy_tuning(calls))
    # repeat 0 is the single tuning itself, found in the ledger; repeat 1 is new
    assert len(calls) == one.total_runs() + two.total_runs() // 2 == 9 + 9
    assert {c.seed for c in calls if not c.test} == {1000, 1001}
    assert {c.seed for c in calls if c.test} == {0, 1, 2, 10000, 10001, 10002}
    picks = [p["params"]["lr"] for p in double["picks"]]
    assert picks[0] == single["params"]["lr"] and picks[1] != picks[0]
    assert single["interval"] == "seeds" and double["interval"] == "repeats"
    # the seed interval of one tuning: the seed effect alone (0, 0.1, 0.2)
    assert single["ci95"] == pytest.approx(4.303 * 0.1 / math.sqrt(3), rel=1e-3)
    # two tunings: the spread of the repeat means, which holds the tuning noise
    by = {}
    for r, v in zip(double["repeats"], double["per_seed"]):
        by.setdefault(r, []).append(v)
    means = [sum(v) / len(v) for v in by.values()]
    assert double["ci95"] == pytest.approx(P.interval(means)[1])
    assert double["ci95"] > 10 * single["ci95"]
    assert double["trials"] == 6 and [p["trials"] for p in double["picks"]] == [6, 6]


def test_the_best_peer_is_chosen_on_validation_not_test(tmp_path):
    # a grid through lr = 3e-3 and no tuning noise: every loss picks 3e-3
    protocol = P.Protocol(("APLoss", "Triplet", "SupCon"), (32,), images=256, grid=4,
                          grid_knob_points=1, seeds=(0, 1))
    results = P.run(protocol, P.Ledger(tmp_path / "l.jsonl", "features"),
                    _noisy_tuning([], noise=0.0))
    by = {r["loss"]: r for r in results}
    # SupCon leads on test, the triplet on validation: the triplet is the best peer
    assert by["SupCon"]["test_map@r"] > by["Triplet"]["test_map@r"]
    assert by["SupCon"]["val_eval"] < by["Triplet"]["val_eval"]
    assert by["APLoss"]["best_peer"] == "Triplet" and by["Triplet"]["vs_best_peer"] is None
    assert {r["best_ap"] for r in results} == {"APLoss"}
    diff = by["APLoss"]["test_map@r"] - by["Triplet"]["test_map@r"]
    assert by["APLoss"]["vs_best_peer"][0] == pytest.approx(diff)


def test_a_changed_setup_starts_new_cells_and_says_what_changed(tmp_path, caplog):
    protocol = P.Protocol(("APLoss", "Triplet"), (32,), images=256, trials=4, seeds=(0, 1))
    path = tmp_path / "ledger.jsonl"
    setup = {"config": "c1", "features": "f1", "head": "residual", "m": 4,
             "test_classes": None}
    calls = []
    first = P.run(protocol, P.Ledger(path, "features", setup), _noisy_tuning(calls))
    assert len(calls) == protocol.total_runs() == 2 * (4 + 2)
    changed = {**setup, "head": "mlp", "test_classes": 500}
    calls.clear()
    with caplog.at_level("INFO", logger="tfaploss.compare.protocol"):
        again = P.run(protocol, P.Ledger(path, "features", changed), _noisy_tuning(calls))
    assert len(calls) == protocol.total_runs()  # every run anew: new cells
    assert ("holds 12 runs of another setup; this comparison starts new cells beside them "
            "(what changed: head: 'residual' -> 'mlp'; test_classes: None -> 500)"
            in caplog.text)
    # trials are counted per tuning, not per row of the cell (24 rows now hold it)
    assert [r["trials"] for r in again] == [4, 4]
    assert len(path.read_text().splitlines()) == 2 * protocol.total_runs()

    def refuse(spec):
        raise AssertionError(f"ran {spec} again")

    # back to the first setup: its rows are found again, none run
    back = P.run(protocol, P.Ledger(path, "features", setup), refuse)
    assert [r["per_seed"] for r in back] == [r["per_seed"] for r in first]


def test_rows_of_no_setup_are_kept_but_never_reused(tmp_path, caplog):
    protocol = P.Protocol(("APLoss",), (32,), images=256, trials=2, seeds=(0,))
    path = tmp_path / "ledger.jsonl"
    P.run(protocol, P.Ledger(path, "features"), _noisy_tuning([]))
    # as an earlier version wrote them: keyed on the tier alone, no setup in the row
    legacy = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        spec = P.RunSpec(row["loss"], tuple(sorted(row["params"].items())), row["batch"],
                         row["updates"], row["seed"], row["test"])
        row["key"] = spec.key("features")
        del row["setup"], row["setup_id"]
        legacy.append(json.dumps(row))
    path.write_text("\n".join(legacy) + "\n")
    calls = []
    with caplog.at_level("INFO", logger="tfaploss.compare.protocol"):
        P.run(protocol, P.Ledger(path, "features"), _noisy_tuning(calls))
    assert len(calls) == protocol.total_runs() == 3
    assert ("holds 3 runs written before runs were keyed on their setup" in caplog.text)
    assert len(path.read_text().splitlines()) == 6  # kept beside the new ones


def test_grid_mode_tries_every_point_and_flags_picks_at_the_edge(tmp_path):
    protocol = P.Protocol(("SupCon",), (32,), images=256, seeds=(0,), grid=4,
                          grid_knob_points=2)
    assert protocol.trials_for("SupCon") == 8
    calls = []
    [result] = P.run(protocol, P.Ledger(tmp_path / "l.jsonl", "features"),
                     _noisy_tuning(calls))
    tried = sorted({(c.settings["lr"], c.settings["temperature"]) for c in calls
                    if not c.test})
    lrs = [3e-5, 3e-4, 3e-3, 3e-2]  # 4 points log-spaced over [3e-5, 3e-2]
    assert [t[0] for t in tried] == pytest.approx([lr for lr in lrs for _ in (0, 1)])
    assert sorted({t[1] for t in tried}) == pytest.approx([0.005, 0.5])
    # every pick of this grid has its temperature at an end of the range
    assert "temperature" in result["picks"][0]["edges"]
    assert P.grid_settings("APLoss", 2, 1) == [{"lr": 3e-5, "num_bins": 52},
                                               {"lr": pytest.approx(3e-2), "num_bins": 52}]


def _folded(calls, best_lr_of_fold):
    """Three validation folds, each peaking at its own learning rate (fold f at
    ``best_lr_of_fold[f]``); the whole validation set at 3e-3."""

    def runner(spec):
        calls.append(spec)
        lr = spec.settings["lr"]
        peak = lambda at: 80 - 10 * abs(math.log10(lr / at))
        row = {"status": "ok", "val_map@r": peak(3e-3), "seconds": 0.1,
               "val_folds": {str(f): peak(at) for f, at in enumerate(best_lr_of_fold)}}
        if spec.test:
            row["test_map@r"] = peak(3e-3) + 0.1 * (spec.seed % 10)
        return row

    runner.val_folds = len(best_lr_of_fold)
    return runner


def test_repeats_by_folds_pick_on_their_fold_and_share_a_grids_trials(tmp_path):
    protocol = P.Protocol(("APLoss", "SupCon"), (32,), images=256, grid=4,
                          grid_knob_points=1, seeds=(0, 1), tuning_repeats=3,
                          repeat_by="folds")
    calls = []
    results = P.run(protocol, P.Ledger(tmp_path / "l.jsonl", "features"),
                    _folded(calls, [3e-5, 3e-3, 3e-2]))
    # 4 grid trials once (one tuning seed), then 3 repeats x 2 seeds, per loss
    assert len(calls) == protocol.total_runs() == 2 * (4 + 3 * 2)
    assert {c.seed for c in calls if not c.test} == {1000}
    for result in results:
        picks = [p["params"]["lr"] for p in result["picks"]]
        assert picks == pytest.approx([3e-5, 3e-3, 3e-2])  # each repeat's own fold
        assert [p["val_map@r"] for p in result["picks"]] == pytest.approx([80.0] * 3)
        assert result["interval"] == "repeats" and len(set(result["repeats"])) == 3
    # TPE proposes anew for each repeat: no trials shared
    tpe = P.Protocol(("APLoss",), (32,), images=256, trials=4, seeds=(0,),
                     tuning_repeats=3, repeat_by="folds")
    assert tpe.total_runs() == 3 * (4 + 1)


def test_repeats_by_folds_need_a_runner_that_scores_the_folds(tmp_path):
    protocol = P.Protocol(("APLoss",), (32,), images=256, grid=2, grid_knob_points=1,
                          seeds=(0,), tuning_repeats=3, repeat_by="folds")
    ledger = P.Ledger(tmp_path / "l.jsonl", "features")
    for runner in (_noisy_tuning([]), _folded([], [3e-3, 3e-3])):  # none, or 2 folds
        with pytest.raises(ValueError, match="3 class-disjoint folds"):
            P.run(protocol, ledger, runner)
    assert not (tmp_path / "l.jsonl").exists() or not (tmp_path / "l.jsonl").read_text()
    with pytest.raises(ValueError, match="repeat_by must be one of"):
        P.Protocol(("APLoss",), (32,), repeat_by="classes")
    # one repeat by folds is one tuning on every class: no folds needed
    one = P.Protocol(("APLoss",), (32,), images=256, grid=2, grid_knob_points=1,
                     seeds=(0,), repeat_by="folds")
    assert len(P.run(one, ledger, _noisy_tuning([], noise=0.0))) == 1


def test_edges_are_the_outer_tenth_of_a_range_log_scaled_where_the_range_is():
    # lr range [3e-5, 3e-2]: three decades, so the outer tenth is 0.3 decades
    assert P.edge_knobs("SupCon", {"lr": 5e-5, "temperature": 0.05}) == ["lr"]
    assert P.edge_knobs("SupCon", {"lr": 7e-5, "temperature": 0.05}) == []
    # temperature [0.005, 0.5] (log): 0.5 / 10 ** 0.2 = 0.315 is the edge
    assert P.edge_knobs("SupCon", {"lr": 1e-3, "temperature": 0.33}) == ["temperature"]
    assert P.edge_knobs("SupCon", {"lr": 1e-3, "temperature": 0.30}) == []
    # bins 5-100 (linear): 14.5 and 90.5 are the edges
    assert P.edge_knobs("APLoss", {"lr": 1e-3, "num_bins": 14}) == ["num_bins"]
    assert P.edge_knobs("APLoss", {"lr": 1e-3, "num_bins": 15}) == []
    # the study's picks at the old edges are inside the widened ranges
    assert P.edge_knobs("SupCon", {"lr": 1e-3, "temperature": 0.0203}) == []
    assert P.edge_knobs("APLoss", {"lr": 1e-3, "num_bins": 40}) == []


def test_settings_read_the_same_in_the_log_the_console_and_the_report():
    """One home for a run's settings in words: sorted names, floats to 3 digits."""
    params = {"temperature": 0.0523, "lr": 0.001, "m": 4}
    assert P.settings_text(params) == "lr=0.001 m=4 temperature=0.0523"
    assert P.settings_text(params, ", ") == "lr=0.001, m=4, temperature=0.0523"


def test_a_trial_sets_the_learning_rate_then_the_knobs_in_their_ranges():
    space = P.search_space("MultiSimilarity", (1e-4, 1e-2))
    assert list(space) == ["lr", "alpha", "beta", "base", "epsilon"]
    assert space["lr"] == ("log", 1e-4, 1e-2)
    grid = P.grid_settings("MultiSimilarity", 3, 2, (1e-4, 1e-2))
    assert sorted({g["lr"] for g in grid}) == pytest.approx([1e-4, 1e-3, 1e-2])
    assert len(grid) == 3 * 2 ** 4 and {g["alpha"] for g in grid} == {0.5, 20.0}
