"""The report of a comparison (its rows, differences, flags and labels) and the
command's console lines, from a synthetic comparison (no training)."""

import io
import math

import pytest

from tfaploss.cli.compare import Console
from tfaploss.compare import protocol as P
from tfaploss.compare import report

BASELINES = {"frozen": {"dim": 128, "val_map@r": 97.2, "val_r@1": 99.9, "test_map@r": 94.6,
                        "test_r@1": 99.8},
             "pca": {"dim": 64, "val_map@r": 96.0, "val_r@1": 99.5, "test_map@r": 93.0,
                     "test_r@1": 99.6}}


def _results(tmp_path, repeats=1):
    def runner(spec):
        lr = spec.settings["lr"]
        value = 95 - 3 * abs(math.log10(lr / 1e-3)) + (0.5 if spec.loss == "SmoothAP" else 0)
        row = {"status": "ok", "val_map@r": value, "seconds": 0.1}
        if spec.test:
            row["test_map@r"] = value - 1 + 0.1 * (spec.seed % 10)
        return row

    protocol = P.Protocol(("SmoothAP", "Triplet"), (32, 64), images=512, grid=4,
                          grid_knob_points=1, seeds=(0, 1), tuning_repeats=repeats)
    results = P.run(protocol, P.Ledger(tmp_path / "l.jsonl", "features"), runner)
    return protocol, P.with_baseline_differences(results, BASELINES["frozen"]["test_map@r"])


def test_the_report_has_the_baseline_rows_and_the_differences_from_them(tmp_path):
    protocol, results = _results(tmp_path)
    text = report.markdown(results, report.header(
        tier="features", config="base.yaml", val="val", protocol=protocol, m=4,
        setup={"tier": "features", "head": "residual"}, runs=20, hours=0.01, quick=True),
        BASELINES)
    assert "| frozen features (no head) | 128 | 97.2 | 94.6 | 99.8 |" in text
    assert "| PCA of the training features | 64 | 96.0 | 93.0 | 99.6 |" in text
    assert "| frozen features (no head) | 94.6 | 94.6 |" in text  # beside the losses
    smooth = next(r for r in results if r["loss"] == "SmoothAP" and r["batch"] == 32)
    # the grid 3e-5, 3e-4, 3e-3, 3e-2: 3e-3 is nearest the peak at 1e-3 (0.48 decades)
    assert smooth["params"]["lr"] == pytest.approx(3e-3)
    diff = smooth["test_map@r"] - 94.6
    assert f"| SmoothAP | {diff:+.1f} ± {smooth['ci95']:.1f} |" in text
    assert "**--quick**" in text and "intervals not informative" in text
    assert "Head `residual` (full width, the identity at step 0)" in text
    # the grid's picks: the temperature at its range's middle, the lr inside: no flag
    assert "No pick has a setting in the outer 10% of its range (4 picks)." in text
    assert "vs Triplet" in text
    # SmoothAP is the only AP loss: chosen, with its paired difference's lower bound
    diff, half = smooth["vs_best_peer"]
    assert (f"B=32: SmoothAP vs Triplet {diff:+.1f} ± {half:.1f} (95 % lower bound "
            f"{diff - half:.1f})") in text
    assert "over the 2 evaluation seeds (one tuning: seed noise only" in text


def test_repeats_are_said_and_edge_picks_flagged(tmp_path):
    protocol, results = _results(tmp_path, repeats=2)
    assert {r["interval"] for r in results} == {"repeats"}
    for r in results:
        r["picks"][1]["edges"] = ["lr"]
    text = report.markdown(results, report.header(
        tier="features", config="c", val="v", protocol=protocol, m=4, setup={}, runs=1,
        hours=0.0), BASELINES)
    assert "over the tuning repeats' means" in text
    assert "over the 2 tuning repeats' means (2 x 2 (repeat, seed) runs per cell" in text
    assert "**4 of 8 picks have a setting in the outer 10% of its range**" in text
    assert "SmoothAP B=32 r1: lr" in text and "| ⚠ lr |" in text


def test_the_seconds_budget_says_its_time_and_each_loss_updates(tmp_path):
    def runner(spec):
        row = {"status": "ok", "val_map@r": 90.0 + spec.updates / 100, "seconds": 0.1}
        if spec.test:
            row["test_map@r"] = 89.0 + spec.seed
        return row

    runner.step_seconds = lambda loss, batch: 0.1 if loss == "Triplet" else 0.4
    protocol = P.Protocol(("SmoothAP", "Triplet"), (32,), budgets=("seconds",), seconds=4.0,
                          grid=2, grid_knob_points=1, seeds=(0, 1))
    results = P.run(protocol, P.Ledger(tmp_path / "l.jsonl", "features"), runner)
    text = report.markdown(results)
    assert "| loss | B=32 (4 s) |" in text
    assert "| SmoothAP (AP) | 89.5 ± 6.4 (10 u) |" in text
    assert "| Triplet (peer) | 89.5 ± 6.4 (40 u) |" in text
    assert "B=32: SmoothAP 0.4, Triplet 0.1." in text


def test_intervals_are_clipped_to_0_100():
    assert report.clipped_error(5.0, 24.0) == (5.0, 24.0)
    assert report.clipped_error(90.0, 24.0) == (24.0, 10.0)
    assert report.clipped_error(50.0, float("nan")) == (0.0, 0.0)


def test_the_console_shows_one_line_per_finished_run():
    stream = io.StringIO()  # not a terminal: no bar, just the lines
    console = Console(3, stream=stream)
    spec = P.RunSpec("SupCon", (("lr", 1e-3), ("temperature", 0.05)), 32, 16, 1000, False)
    console({"spec": spec, "row": {"status": "ok", "val_map@r": 91.25, "seconds": 1.5},
             "cached": False, "repeat": 0})
    console({"spec": spec, "row": {}, "cached": True, "repeat": 0})
    test = P.RunSpec("SupCon", (("lr", 1e-3), ("temperature", 0.05)), 32, 16, 10001, True)
    console({"spec": test, "row": {"status": "non-finite", "seconds": 0.2},
             "cached": False, "repeat": 1})
    console.close()
    assert stream.getvalue().splitlines() == [
        "[1/3] SupCon B=32 u=16 trial: val 91.2 in 1.5 s  [lr=0.001 temperature=0.05]",
        ("[3/3] SupCon B=32 u=16 seed 10001 (repeat 1): val –, test – (non-finite) in 0.2 s"
        "  [lr=0.001 temperature=0.05]"),
        "1 of 3 runs taken from the ledger"]
