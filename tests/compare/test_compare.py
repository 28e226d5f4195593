"""``tfaploss compare``: the tuning protocol (budgets, intervals, TPE replay, the ledger,
paired differences) with a synthetic runner, and the command end to end (``--quick``,
cached-feature tier) on a tiny split of the demo's digits: the frozen and PCA rows,
resumed from its ledger, and a changed setup that starts new cells."""

import json
import math

import numpy as np
import pytest

from tfaploss.compare import protocol as P


def test_budgets_give_equal_images_updates_and_the_matched_control():
    assert P.updates_for("images", 128, 49152, 64, 2048) == 384
    assert P.updates_for("images", 2048, 49152, 64, 2048) == 24
    assert P.updates_for("updates", 128, 49152, 64, 2048) == 64
    # matched: as many images as B_max in `updates` updates (64 x 2048 = 131,072)
    assert P.updates_for("matched", 128, 49152, 64, 2048) == 1024
    assert P.updates_for("matched", 2048, 49152, 64, 2048) == 64
    with pytest.raises(ValueError, match="budget must be one of"):
        P.updates_for("epochs", 128, 1, 1, 1)


def test_interval_is_the_t_interval():
    mean, half = P.interval([1.0, 2.0, 3.0])
    # sd 1, n 3: t(0.975, 2) = 4.303
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3), rel=1e-4)
    assert math.isnan(P.interval([5.0])[1]) and P.interval([5.0])[0] == 5.0
    assert P.t95(6) == 2.571 and P.t95(40) == 2.042


def test_protocol_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match=r"losses: \['Arcface'\] not known"):
        P.Protocol(("Arcface",), (128,))
    with pytest.raises(ValueError, match=r"budgets: \['epochs'\]"):
        P.Protocol(("APLoss",), (128,), budgets=("epochs",))
    with pytest.raises(ValueError, match=r"tuning seeds \[1000\] must not be evaluation seeds"):
        P.Protocol(("APLoss",), (128,), seeds=(0, 1000))
    # repeat 1 tunes with seed 1001
    with pytest.raises(ValueError, match=r"tuning seeds \[1001\] must not be evaluation seeds"):
        P.Protocol(("APLoss",), (128,), seeds=(0, 1001), tuning_repeats=2)
    # repeat 1 runs seed 0 as 10000, which is already repeat 0's seed 10000
    with pytest.raises(ValueError, match="repeat a seed across the 2 tuning repeats"):
        P.Protocol(("APLoss",), (128,), seeds=(0, 10000), tuning_repeats=2)
    with pytest.raises(ValueError, match="tuning_repeats must be >= 1"):
        P.Protocol(("APLoss",), (128,), tuning_repeats=0)
    protocol = P.Protocol(("APLoss", "Triplet"), (128, 512), budgets=("updates", "matched"),
                          updates=8, trials=3, seeds=(0, 1))
    cells = list(protocol.cells())
    # matched at the largest batch is the updates cell itself: run once
    assert cells[-1] == ("matched", 512, 8, True)
    assert protocol.total_runs() == 3 * 2 * (3 + 2)
    # the budget rule: multi-similarity (lr + 4 knobs) gets 2.5 times the base
    assert P.Protocol(("MultiSimilarity",), (128,), trials=24).trials_for("MultiSimilarity") == 60
    repeated = P.Protocol(("APLoss", "MultiSimilarity"), (128,), trials=4, seeds=(0, 1),
                          tuning_repeats=3)
    assert repeated.total_runs() == 3 * ((4 + 2) + (10 + 2))


def _synthetic(calls):
    """A runner whose validation score peaks at lr = 3e-3 (and, for the triplet, at a
    margin of 0.3); test = validation + a seed effect shared by every loss."""

    def runner(spec):
        calls.append(spec)
        s = spec.settings
        score = 80 - 10 * abs(math.log10(s["lr"] / 3e-3))
        if spec.loss == "Triplet":
            score -= 20 * abs(s["margin"] - 0.3)
        else:
            score += 2.0
        if spec.batch == 64 and spec.loss == "Triplet":
            return {"status": "non-finite"}
        row = {"status": "ok", "val_map@r": score, "seconds": 0.1, "curve": [[1, score]]}
        if spec.test:
            row["test_map@r"] = score + spec.seed
        return row

    return runner


def test_protocol_tunes_on_validation_pairs_seeds_and_resumes(tmp_path):
    protocol = P.Protocol(("APLoss", "Triplet"), (32, 64), budgets=("images",),
                          images=256, trials=8, seeds=(0, 1, 2))
    calls = []
    ledger = P.Ledger(tmp_path / "ledger.jsonl", "features")
    results = P.run(protocol, ledger, _synthetic(calls))
    assert len(calls) == protocol.total_runs() == 2 * 2 * (8 + 3)
    tuning = [c for c in calls if not c.test]
    assert {c.seed for c in tuning} == {1000}  # the tuning seed, never an evaluation seed
    assert P.LR_RANGE == (3e-5, 3e-2)
    assert all(3e-5 <= c.settings["lr"] <= 3e-2 for c in tuning)
    by = {(r["loss"], r["batch"]): r for r in results}
    ap = by[("APLoss", 32)]
    # TPE found a rate near the peak within 8 trials; the seeds add 0, 1, 2
    assert abs(math.log10(ap["params"]["lr"] / 3e-3)) < 0.6
    assert ap["per_seed"][1] - ap["per_seed"][0] == pytest.approx(1.0)
    assert ap["ci95"] == pytest.approx(4.303 / math.sqrt(3), rel=1e-4)
    # paired against the triplet (the only peer): the seed effect cancels exactly
    diff, half = ap["vs_best_peer"]
    assert ap["best_peer"] == "Triplet" and half == pytest.approx(0.0, abs=1e-9)
    assert diff == pytest.approx(ap["test_map@r"] - by[("Triplet", 32)]["test_map@r"])
    # a failed run stays in the table as what it was
    failed = by[("Triplet", 64)]
    assert failed["statuses"] == ["non-finite"] * 3 and math.isnan(failed["test_map@r"])

    def refuse(spec):
        raise AssertionError(f"ran {spec} again")

    again = P.run(protocol, P.Ledger(tmp_path / "ledger.jsonl", "features"), refuse)
    assert [r["params"] for r in again] == [r["params"] for r in results]

    # a line a kill cut short is ignored (that run is redone), the rest kept
    path = tmp_path / "ledger.jsonl"
    path.write_text(path.read_text() + '{"key": "torn", "lo')
    assert len(P.Ledger(path, "features").rows) == len(calls)


def test_carried_settings_try_a_learning_rate_neighbourhood(tmp_path):
    carried = {("APLoss", 32): {"lr": 1e-2, "num_bins": 20},
               ("Triplet", 32): {"lr": 3e-3, "margin": 0.3}}
    protocol = P.Protocol(("APLoss", "Triplet"), (32,), images=256, seeds=(0, 1, 2),
                          carried=carried, lr_factors=(0.1, 0.3, 1.0))
    calls = []
    results = P.run(protocol, P.Ledger(tmp_path / "l.jsonl", "images"), _synthetic(calls))
    assert len(calls) == protocol.total_runs() == 2 * (3 + 3)
    tried = sorted(c.settings["lr"] for c in calls if c.loss == "APLoss" and not c.test)
    assert tried == pytest.approx([1e-3, 3e-3, 1e-2])
    by = {r["loss"]: r for r in results}
    # the synthetic score peaks at 3e-3: the neighbourhood finds it for both
    assert by["APLoss"]["params"] == {"lr": pytest.approx(3e-3), "num_bins": 20}
    assert by["Triplet"]["params"]["lr"] == pytest.approx(3e-3)
    with pytest.raises(ValueError, match="no carried settings for APLoss at batch 64"):
        P.run(P.Protocol(("APLoss",), (64,), carried=carried),
              P.Ledger(tmp_path / "m.jsonl", "images"), _synthetic([]))


@pytest.fixture(scope="module")
def digit_splits(tmp_path_factory):
    """The digits as train (0-4), val (5-6) and test (7-9) splits of the folder job."""
    from PIL import Image
    from sklearn.datasets import load_digits

    from tfaploss.pipelines import folder

    root = tmp_path_factory.mktemp("compare")
    digits = load_digits()
    images = np.clip(digits.images * (255 / 16), 0, 255).astype("uint8")
    splits = {"train": range(5), "val": (5, 6), "test": (7, 8, 9)}
    for split, classes in splits.items():
        for c in classes:
            (root / "pngs" / split / str(c)).mkdir(parents=True)
    count = {}
    for i, (image, label) in enumerate(zip(images, digits.target)):
        split = next(s for s, cs in splits.items() if label in cs)
        if count.get(label, 0) >= 60:  # 60 images per digit: a tiny split
            continue
        count[label] = count.get(label, 0) + 1
        Image.fromarray(image, mode="L").save(root / "pngs" / split / str(label) / f"{i}.png")
    folder.run(["--input_dir", str(root / "pngs"), "--output_dir", str(root / "records"),
                "--splits_from_folders", "--direct_running_mode", "in_memory",
                "--direct_num_workers", "1"])
    return root


@pytest.mark.long
def test_compare_quick_runs_resumes_and_writes_its_report(digit_splits, tmp_path, capsys):
    from tfaploss.cli import main

    root = digit_splits
    out = tmp_path / "compare"
    args = ["compare", "--config", "configs/demo_digits.yaml", "--features", "--quick",
            "--set", f"data.train={root / 'records' / 'train'}",
            "--set", f"data.test={root / 'records' / 'test'}",
            "--val", str(root / "records" / "val"), "--out", str(out),
            "--losses", "APLoss,MultiSimilarity", "--m", "8", "--quiet"]
    assert main(args) == 0
    report = (out / "report.md").read_text()
    assert "| APLoss (AP) |" in report and "| MultiSimilarity (peer) |" in report
    assert "B=16 (32 u, 512 im)" in report and "B=32 (16 u, 512 im)" in report
    document = json.loads((out / "results.json").read_text())
    results, baselines = document["results"], document["baselines"]
    # the baselines, from the same command, on the test classes the runs are scored on
    frozen, pca = baselines["frozen"], baselines["pca"]
    assert pca["dim"] == 32 < frozen["dim"]  # demo_digits' embedding_dim; small_cnn's width
    assert 0.0 < pca["test_map@r"] <= 100.0 and 0.0 < frozen["test_map@r"] <= 100.0
    assert f"| frozen features (no head) | {frozen['dim']} |" in report
    assert "| PCA of the training features | 32 |" in report
    assert "**--quick**" in report and "the intervals not informative" in report
    assert {(r["loss"], r["batch"]) for r in results} == {
        (l, b) for l in ("APLoss", "MultiSimilarity") for b in (16, 32)}
    for r in results:
        # the budget rule: base 2 for APLoss (lr + bins), 5 for multi-similarity (lr + 4)
        assert r["trials"] == {"APLoss": 2, "MultiSimilarity": 5}[r["loss"]]
        assert r["seeds"] == [0, 1] and r["interval"] == "seeds"
        assert all(0.0 <= t <= 100.0 for t in r["per_seed"])
        assert all(len(c) >= 2 for c in r["curves"])  # the validation curve
        assert r["vs_frozen"][0] == pytest.approx(r["test_map@r"] - frozen["test_map@r"])
    rows = (out / "ledger.jsonl").read_text().splitlines()
    assert len(rows) == 2 * ((2 + 2) + (5 + 2))
    (out / "report.md").unlink()
    assert main(args) == 0  # resumed: every run from the ledger
    assert (out / "ledger.jsonl").read_text().splitlines() == rows
    assert (out / "report.md").read_text() == report
    # A changed setup (the head) starts new cells: APLoss at B=16 anew, 2 trials + 2 seeds
    capsys.readouterr()
    assert main(args[:-1] + ["--head", "linear", "--losses", "APLoss",
                             "--batch-sizes", "16"]) == 0
    assert "what changed: head: 'residual' -> 'linear'" in capsys.readouterr().out
    grown = (out / "ledger.jsonl").read_text().splitlines()
    assert grown[:len(rows)] == rows and len(grown) == len(rows) + 4
    relinear = json.loads((out / "results.json").read_text())
    assert relinear["baselines"] == baselines  # the same features, the same baselines
    capsys.readouterr()
    with pytest.raises(SystemExit, match="not multiples of m=8"):
        main(args + ["--batch-sizes", "20"])
    with pytest.raises(SystemExit, match=r"batch sizes \[64\] need more than the 5 "
                                         r"training classes with >= m=8"):
        main(args + ["--batch-sizes", "16,64"])
    # The feature tier trains a head of its own: no note on the config's chunk_size
    with pytest.raises(SystemExit, match="need more than the 5"):
        main(args + ["--batch-sizes", "16,64", "--set", "training.chunk_size=64"])
    assert "chunk_size" not in capsys.readouterr().err
    # Repeats by validation folds: a grid's 2 trials once, then 2 repeats x 2 seeds
    before = len((out / "ledger.jsonl").read_text().splitlines())
    assert main(args + ["--losses", "APLoss", "--batch-sizes", "16", "--grid", "2",
                        "--grid-knob-points", "1", "--tuning-repeats", "2",
                        "--repeat-by", "folds"]) == 0
    folded = (out / "ledger.jsonl").read_text().splitlines()
    assert len(folded) == before + 2 + 2 * 2
    assert all(len(json.loads(r)["val_folds"]) == 2 for r in folded[before:])
    assert "each picking on its own class-disjoint fold" in (out / "report.md").read_text()
    images = [a for a in args if a != "--features"]
    capsys.readouterr()
    with pytest.raises(SystemExit, match="2 class-disjoint folds of the validation"):
        main(images + ["--tuning-repeats", "2", "--repeat-by", "folds"])
    # The image tier's notes are read at compare's largest batch (32), not the config's
    # own (96), and shown before a refusal as one "note:" line, as every command does:
    # demo_digits' chunk_size 32 splits no batch of 32.
    assert "note: training.chunk_size=32 >= data.batch_size=32" in capsys.readouterr().err


@pytest.mark.long
def test_compare_images_shows_one_line_per_run_and_precise_bn_curves(digit_splits, tmp_path,
                                                                     capsys):
    """The image tier: each run's `tfaploss train` output in its log, one console line
    per run, and a curve measured after precise BN (its last point is the model the
    run ends with, re-estimated on the same images)."""
    from tfaploss.cli import main

    root = digit_splits
    out = tmp_path / "images"
    args = ["compare", "--config", "configs/demo_digits.yaml", "--quick",
            "--set", f"data.train={root / 'records' / 'train'}",
            "--set", f"data.test={root / 'records' / 'test'}",
            "--set", "model.freeze_bn=false", "--set", "model.bn_calibration_images=0",
            "--val", str(root / "records" / "val"), "--out", str(out), "--losses", "SupCon",
            "--batch-sizes", "32", "--trials", "1", "--seeds", "0", "--m", "8"]
    capsys.readouterr()
    assert main(args) == 0
    printed = capsys.readouterr().out
    runs = [line for line in printed.splitlines() if line.startswith("[")]
    assert [line[:5] for line in runs] == ["[1/2]", "[2/2]"], printed
    assert "--restart" not in printed and "tfaploss train:" not in printed
    logs = sorted((out / "runs").glob("*.train.log"))
    assert len(logs) == 2 and all("tfaploss train: compare: SupCon B=32" in log.read_text()
                                  for log in logs)
    [result] = json.loads((out / "results.json").read_text())["results"]
    [curve] = result["curves"]
    assert len(curve) == 2 and all(0.0 <= point[1] <= 100.0 for point in curve)
    rows = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    [evaluated] = [r for r in rows if r["test"]]
    assert curve[-1][1] == pytest.approx(evaluated["val_map@r"], abs=1e-3)


def test_compare_without_optuna_stops_before_any_run(tmp_path, monkeypatch, capsys):
    import sys
    from pathlib import Path

    from tfaploss.cli import main

    monkeypatch.setitem(sys.modules, "optuna", None)  # as if not installed
    recipe = Path(__file__).resolve().parents[2] / "configs" / "demo_digits.yaml"
    assert main(["compare", "--config", str(recipe), "--val", "nowhere",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: tfaploss compare's tuning (Optuna TPE; --settings-from "
                          "needs no tuning) needs Optuna, which is not installed: "
                          'pip install "tfaploss[compare]"')
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_the_seconds_budget_gives_each_loss_the_same_time_and_resumes(tmp_path):
    assert P.updates_for("seconds", 128, 1, 1, 1, seconds=60, step_seconds=0.7) == 85
    assert P.updates_for("seconds", 128, 1, 1, 1, seconds=1, step_seconds=5.0) == 1
    with pytest.raises(ValueError, match="seconds per update"):
        P.updates_for("seconds", 128, 1, 1, 1, seconds=60, step_seconds=None)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        P.Protocol(("APLoss",), (32,), budgets=("seconds",), seconds=0)
    protocol = P.Protocol(("APLoss", "Triplet"), (32, 64), budgets=("seconds",),
                          seconds=8.0, trials=2, seeds=(0,))
    calls, timed = [], []
    runner = _synthetic(calls)
    per_update = {"APLoss": 0.5, "Triplet": 0.25}  # seconds at B=32, twice at 64

    def timer(loss, batch):
        timed.append((loss, batch))
        return per_update[loss] * batch / 32

    runner.step_seconds = timer
    path = tmp_path / "ledger.jsonl"
    results = P.run(protocol, P.Ledger(path, "features"), runner)
    assert sorted(timed) == [("APLoss", 32), ("APLoss", 64), ("Triplet", 32), ("Triplet", 64)]
    updates = {(r["loss"], r["batch"]): r["updates"] for r in results}
    assert updates == {("APLoss", 32): 16, ("Triplet", 32): 32,
                       ("APLoss", 64): 8, ("Triplet", 64): 16}
    assert {c.updates for c in calls if c.loss == "APLoss" and c.batch == 32} == {16}
    assert all(r["budget_seconds"] == 8.0 for r in results)
    ledger = P.Ledger(path, "features")
    # the timings are kept beside the runs, not counted as runs
    assert len(ledger.runs()) == len(calls) == protocol.total_runs()
    assert len(ledger.rows) == len(calls) + 4

    def refuse(spec):
        raise AssertionError(f"ran {spec} again")

    refuse.step_seconds = lambda loss, batch: pytest.fail("timed again")
    again = P.run(protocol, ledger, refuse)
    assert [r["updates"] for r in again] == [r["updates"] for r in results]
    # a runner that cannot time its updates is refused before any run
    with pytest.raises(ValueError, match="--features"):
        P.run(protocol, P.Ledger(tmp_path / "other.jsonl", "images"), _synthetic([]))
