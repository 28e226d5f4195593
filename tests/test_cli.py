"""The ``tfaploss`` command in subprocesses, on tiny generated data.

One module-scoped run covers train -> (killed after epoch 1) -> resume -> evaluate ->
export, because every subprocess pays TensorFlow's import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
EPOCHS, STEPS = 2, 3


def tfaploss(*args, env=None, timeout=240):
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
                **(env or {})}
    return subprocess.run([sys.executable, "-m", "tfaploss.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env=full_env,
                          timeout=timeout)


def _write_tree(root: Path, classes: int, per_class: int, seed: int) -> None:
    """Class k: a bright square at a class-specific place, plus noise (16x16 PNGs)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for k in range(classes):
        (root / f"c{k}").mkdir(parents=True)
        y, x = divmod(k, 3)
        for i in range(per_class):
            img = rng.integers(0, 60, (16, 16, 3), dtype=np.uint8)
            img[4 * y + 1:4 * y + 8, 4 * x + 1:4 * x + 8] = 230
            Image.fromarray(img).save(root / f"c{k}" / f"{i}.png")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from pipelines import folder

    root = tmp_path_factory.mktemp("cli")
    _write_tree(root / "pngs", classes=7, per_class=8, seed=0)
    folder.run(["--input_dir", str(root / "pngs"), "--output_dir", str(root / "records"),
                "--test_classes", "c4,c5,c6", "--direct_running_mode", "in_memory",
                "--direct_num_workers", "1"])
    config = {
        "description": "CLI smoke test",
        "run_dir": str(root / "run"),
        "data": {"train": str(root / "records" / "train"),
                 "test": str(root / "records" / "test"),
                 "sampler": "m_per_class", "batch_size": 8, "m": 2, "image_size": 16},
        "model": {"backbone": "small_cnn", "pooling": "gem", "embedding_dim": 8,
                  "weights": None, "bn_calibration_images": 8},
        "loss": {"name": "APLoss"},
        "optimizer": {"name": "adam", "lr": 1e-3, "schedule": {"name": "linear",
                                                               "end_lr": 0.0}},
        "training": {"epochs": EPOCHS, "steps_per_epoch": STEPS, "chunk_size": 3},
        "evaluation": {"every_n_epochs": 1, "ks": [1, 2], "backend": "exact"},
    }
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return root, path


def test_help_is_there_for_every_command():
    for args in ([], ["train"], ["evaluate"], ["export"], ["demo"]):
        result = tfaploss(*args, "--help", timeout=60)
        assert result.returncode == 0, result.stderr
        assert "usage: tfaploss" in result.stdout
    assert "--set" in tfaploss("train", "--help").stdout


def test_unknown_config_key_fails_naming_the_key(tmp_path, workspace, capsys):
    _, good = workspace
    raw = yaml.safe_load(good.read_text())
    raw["training"]["epocs"] = 3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    result = tfaploss("train", "--config", bad)
    assert result.returncode == 2
    assert "training.epocs" in result.stderr and "Did you mean 'epochs'" in result.stderr
    assert "Traceback" not in result.stderr
    # A bad --set value, through the same entry point in-process.
    from tfaploss.cli import main

    assert main(["train", "--config", str(good), "--set", "model.pooling=mean"]) == 2
    assert "'model.pooling'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained_run(workspace):
    """Train 2 epochs, killed right after epoch 1, then resumed by the same command."""
    root, config = workspace
    run_dir = root / "run"
    killed = tfaploss("train", "--config", config, "--quiet",
                      env={"TFAPLOSS_EXIT_AFTER_EPOCH": "1"})
    return run_dir, killed, tfaploss("train", "--config", config, "--quiet")


def test_train_killed_after_epoch_one_resumes_and_finishes(trained_run):
    run_dir, killed, resumed = trained_run
    assert killed.returncode == 75, killed.stdout + killed.stderr
    assert "Epoch 1/2" in killed.stdout and "Epoch 2/2" not in killed.stdout
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from its last checkpoint" in resumed.stdout
    # The second process ran only the missing epoch.
    assert "Epoch 2/2" in resumed.stdout and "Epoch 1/2" not in resumed.stdout

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed"] and summary["multistage"] and summary["chunk_size"] == 3
    assert summary["epochs_completed"] == EPOCHS
    assert [row["epoch"] for row in summary["history"]] == [1, 2]
    # The optimizer state came back: updates count both processes' batches.
    assert summary["updates"] == EPOCHS * STEPS
    # Linear decay to 0 over all 6 updates: lr after update 3 is half, after 6 it is 0.
    lrs = [row["learning_rate"] for row in summary["history"]]
    assert lrs == pytest.approx([5e-4, 0.0], abs=1e-9)
    assert all(0.0 <= row["val_recall@1"] <= 1.0 for row in summary["history"])
    assert set(summary["final_metrics"]) >= {"recall@1", "map@r", "map"}
    assert (run_dir / "model.keras").is_file() and (run_dir / "logs").is_dir()
    assert not (run_dir / "backup").exists()  # removed once training finished


# evaluate and export run through the CLI's entry point in this process: each extra
# subprocess would pay TensorFlow's import again (the test budget is tight).


def test_evaluate_prints_the_table_and_writes_json(trained_run, workspace, tmp_path, capsys):
    from tfaploss.cli import main

    root, _ = workspace
    run_dir, _, _ = trained_run
    out = tmp_path / "eval"
    assert main(["evaluate", "--model", str(run_dir / "model.keras"),
                 "--data", str(root / "records" / "test"), "--ks", "1,2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "recall@1" in printed and "map@r" in printed
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    summary = json.loads((run_dir / "summary.json").read_text())
    # Same model, same test split, same exact search: the numbers train reported.
    for key in ("recall@1", "map@r", "map"):
        assert metrics[key] == pytest.approx(summary["final_metrics"][key], abs=1e-6)


def test_export_writes_a_servable_savedmodel(trained_run, workspace, tmp_path):
    import keras
    import tensorflow as tf

    from tfaploss.cli import main
    from tfaploss.data import center_crop

    root, _ = workspace
    run_dir, _, _ = trained_run
    out = tmp_path / "serving"
    assert main(["export", "--model", str(run_dir / "model.keras"), "--out", str(out)]) == 0
    assert (out / "1" / "saved_model.pb").is_file()
    served = tf.saved_model.load(str(out / "1"))
    png = (root / "pngs" / "c4" / "0.png").read_bytes()
    embedding = served.signatures["serving_default"](
        image_bytes=tf.constant([png, png]))["embedding"].numpy()
    assert embedding.shape == (2, 8)
    model = keras.saving.load_model(run_dir / "model.keras", compile=False)
    expected = np.asarray(model(center_crop(tf.constant(png), 16)[None], training=False))
    np.testing.assert_allclose(embedding, np.repeat(expected, 2, axis=0), atol=1e-5)
    # The evaluate command reads the export too.
    assert main(["evaluate", "--model", str(out), "--data", str(root / "records" / "test"),
                 "--ks", "1", "--out", str(tmp_path / "eval_served")]) == 0


def test_readme_keras_example_runs_as_written():
    import re

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    example = next(b for b in blocks if "model.compile" in b and "APLoss()" in b)
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)
    losses = namespace["history"].history["loss"]
    assert losses[-1] < 0.5 * losses[0]
