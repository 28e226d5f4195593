"""The ``tfaploss`` command in subprocesses, on tiny generated data.

One module-scoped run covers train -> (killed five times, at five different points:
inside the checkpoint write, inside the index write, a real SIGKILL mid-epoch, inside
the model.keras write, during the backup deletion) -> resumed each time -> evaluate ->
export, because every subprocess pays TensorFlow's import.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.support.miniature import write_square_classes

REPO = Path(__file__).resolve().parents[1]
EPOCHS, STEPS = 4, 2
ESCAPES = ("\x1b", "\r", "\x08")  # what a progress bar writes into a log


def _env(env=None):
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
            **(env or {})}


def tfaploss(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "tfaploss.cli", *map(str, args)],
                          check=False, capture_output=True, text=True, cwd=REPO, env=_env(env),
                          timeout=timeout)


def tfaploss_killed_at(line_start: str, *args, timeout=240):
    """Run the command and SIGKILL it as soon as it prints a line starting so."""
    proc = subprocess.Popen([sys.executable, "-m", "tfaploss.cli", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=_env({"PYTHONUNBUFFERED": "1"}))
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(line_start):
                proc.send_signal(signal.SIGKILL)
                break
        lines.append(proc.communicate(timeout=timeout)[0])
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines), "")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tfaploss.pipelines import folder

    root = tmp_path_factory.mktemp("cli")
    write_square_classes(root / "pngs", classes=7, per_class=8, seed=0)
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
        "training": {"epochs": EPOCHS, "steps_per_epoch": STEPS, "chunk_size": 4},
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


def _resumed_after(stdout: str) -> int:
    """Epochs a process found done in the checkpoint it resumed from (0: fresh start)."""
    match = re.search(r"resuming from its last checkpoint: epoch (\d+) done", stdout)
    return int(match.group(1)) if match else 0


def _epochs_begun(stdout: str) -> list[int]:
    return [int(k) for k in re.findall(rf"^Epoch (\d+)/{EPOCHS}$", stdout, re.MULTILINE)]


# (fault, what a kill there should cost): the kill points of the resume test.
KILLS = [
    ("checkpoint_write:1", 1),  # epoch 1 trained, its checkpoint half-written
    ("metadata_write:2", 0),    # checkpoint 2 complete, its index half-written
    ("SIGKILL at 'Epoch 3/4'", None),  # a real signal, mid-epoch 3: 0 or 1
    ("model_write", 0),         # all epochs done, model.keras half-written
    ("backup_delete", 0),       # summary written, backup renamed aside, not deleted
]


@pytest.fixture(scope="module")
def trained_run(workspace):
    """Train EPOCHS epochs, killed at each point of KILLS and resumed by the same command
    each time; then the same command once more, in this process, on the finished run."""
    from tfaploss.durable import faults

    root, config = workspace
    run_dir = root / "run"
    runs = []
    for fault, _ in KILLS:
        if fault.startswith("SIGKILL"):
            runs.append(tfaploss_killed_at(f"Epoch 3/{EPOCHS}", "train", "--config", config))
        else:
            runs.append(tfaploss("train", "--config", config, env={faults.ENV: fault}))
        if fault.startswith("metadata_write"):
            # As a crash on a file system without ordered writes can leave it: empty.
            (run_dir / "backup" / "checkpoint.json").write_bytes(b"")
    # The same command once more (in this process: the finished run trains nothing).
    import contextlib
    import io

    from tfaploss.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["train", "--config", str(config)])
    runs.append(subprocess.CompletedProcess("in-process", rc, out.getvalue(), err.getvalue()))
    return run_dir, runs


@pytest.fixture(scope="module")
def finished_run(workspace):
    """The workspace's config trained once, uninterrupted, in this process: the finished
    run that evaluate, export and the output options are tried on (the killed-and-resumed
    run of ``trained_run`` takes five processes, so it runs in `make test-long`)."""
    from tfaploss.cli import main

    root, good = workspace
    raw = yaml.safe_load(good.read_text())
    raw["run_dir"] = str(root / "finished")
    config = root / "finished.yaml"
    config.write_text(yaml.safe_dump(raw))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["train", "--config", str(config)]) == 0
    return root / "finished", config


@pytest.mark.long
def test_train_killed_anywhere_resumes_and_loses_at_most_one_epoch(trained_run):
    run_dir, runs = trained_run
    outputs = [r.stdout + r.stderr for r in runs]
    for (fault, _), run, out in zip(KILLS, runs, outputs):
        expected = -signal.SIGKILL if fault.startswith("SIGKILL") else 75
        assert run.returncode == expected, f"{fault}:\n{out}"
        if not fault.startswith("SIGKILL"):
            assert f"TFAPLOSS_FAULT={fault}: simulated kill" in out
    assert runs[-1].returncode == 0, outputs[-1]

    # Epochs redone after each kill: epochs the killed process began that the next one
    # had to begin again. At most one per kill, exactly what each kill point allows.
    starts = [_resumed_after(out) for out in outputs]
    redone = [sum(1 for k in _epochs_begun(outputs[i]) if k > starts[i + 1])
              for i in range(len(KILLS))]
    for (fault, cost), lost in zip(KILLS, redone):
        assert lost <= 1, (fault, redone)
        if cost is not None:
            assert lost == cost, (fault, redone)
    assert starts[:3] == [0, 0, 2] and starts[4] == EPOCHS
    began = sum(len(_epochs_begun(out)) for out in outputs)
    assert began == EPOCHS + sum(redone)
    # What each resume found and said.
    assert "removed 1 unfinished file(s)" in outputs[1]          # the torn checkpoint
    assert "checkpoint.json is unreadable (0 bytes" in outputs[2]  # the emptied index
    assert "unfinished file(s) a killed run left: .model.tmp-" in outputs[4]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed"] and summary["multistage"] and summary["chunk_size"] == 4
    assert summary["epochs_completed"] == EPOCHS
    assert [row["epoch"] for row in summary["history"]] == list(range(1, EPOCHS + 1))
    # What an uninterrupted run gives: every update done once, the optimizer state and
    # the learning-rate schedule carried over every kill.
    assert summary["updates"] == EPOCHS * STEPS
    lrs = [row["learning_rate"] for row in summary["history"]]
    assert lrs == pytest.approx([1e-3 * (1 - e / EPOCHS) for e in range(1, EPOCHS + 1)],
                                abs=1e-9)
    assert all(0.0 <= row["val_recall@1"] <= 1.0 for row in summary["history"])
    assert set(summary["final_metrics"]) >= {"recall@1", "map@r", "map"}
    assert (run_dir / "model.keras").is_file() and (run_dir / "logs").is_dir()
    assert not (run_dir / "backup").exists()  # removed once training finished
    leftovers = [p.name for p in run_dir.iterdir() if p.name.startswith(".")]
    assert leftovers == []  # no temporary file, no half-deleted backup

    # The last command found the run finished: it trained nothing.
    assert "already holds this finished run" in outputs[-1]
    assert _epochs_begun(outputs[-1]) == []


@pytest.mark.long
def test_train_log_holds_no_terminal_escape_codes(trained_run):
    """stdout is a pipe here, as when redirected to a log: one line per epoch."""
    _, runs = trained_run
    for run in runs:
        for code in ESCAPES:
            assert code not in run.stdout + run.stderr, repr(code)
    assert re.search(rf"^{STEPS}/{STEPS} - .*loss: ", runs[1].stdout, re.MULTILINE)


# evaluate and export run through the CLI's entry point in this process: each extra
# subprocess would pay TensorFlow's import again (the test budget is tight).


@pytest.mark.slow
def test_quiet_and_verbose_set_what_a_command_shows(finished_run, capsys):
    """On the finished run (`train` only says there is nothing to do): the line is
    there by default, gone with --quiet (before or after the command name), and
    carries its time, logger and level with --verbose."""
    import logging

    from tfaploss.cli import main

    run_dir, config = finished_run
    said = "already holds this finished run"
    assert main(["train", "--config", str(config)]) == 0
    default = capsys.readouterr()
    assert said in default.out and said not in default.err
    assert default.out.startswith(str(run_dir)), default.out  # the plain message
    for argv in (["--quiet", "train", "--config", str(config)],
                 ["train", "--config", str(config), "-q"]):
        assert main(argv) == 0
        assert said not in "".join(capsys.readouterr())
    for argv in (["--verbose", "train", "--config", str(config)],
                 ["train", "-v", "--config", str(config)]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert re.search(r"^\d{4}-\d\d-\d\d [\d:,]+ tfaploss\.run\.trainer INFO: .*" + said,
                         out, re.MULTILINE), out
        for code in ESCAPES:
            assert code not in out
    with pytest.raises(SystemExit):
        main(["--quiet", "train", "--config", str(config), "--verbose"])
    # A command run in-process leaves the loggers as it found them.
    assert logging.getLogger("tfaploss").level == logging.NOTSET
    assert all(isinstance(h, logging.NullHandler)
               for h in logging.getLogger("tfaploss").handlers)


@pytest.mark.slow
def test_evaluate_prints_the_table_and_writes_json(finished_run, workspace, tmp_path, capsys):
    from tfaploss.cli import main

    root, _ = workspace
    run_dir, _ = finished_run
    out = tmp_path / "eval"
    assert main(["evaluate", "--model", str(run_dir / "model.keras"),
                 "--data", str(root / "records" / "test"), "--ks", "1,2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "recall@1" in printed and "map@r" in printed
    # The header says what is done to the images: 16 px crops of an 18 px resize.
    assert ("preprocessing  shorter side resized to 18 px, then the centre 16x16 px kept"
            in printed)
    assert "test (24 images)" in printed
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    summary = json.loads((run_dir / "summary.json").read_text())
    # Same model, same test split, same exact search: the numbers train reported.
    for key in ("recall@1", "map@r", "map"):
        assert metrics[key] == pytest.approx(summary["final_metrics"][key], abs=1e-6)


@pytest.mark.slow
def test_export_writes_a_servable_savedmodel(finished_run, workspace, tmp_path):
    import keras
    import tensorflow as tf

    from tfaploss.cli import main
    from tfaploss.data import center_crop

    root, _ = workspace
    run_dir, _ = finished_run
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
    limited = tmp_path / "limited"
    assert main(["export", "--model", str(run_dir / "model.keras"), "--out", str(limited),
                 "--max-request-pixels", "50000000"]) == 0
    meta = json.loads((limited / "1" / "assets.extra" / "tfaploss_export.json").read_text())
    assert meta["max_request_pixels"] == 50_000_000
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


def test_evaluate_progress_bar_knows_its_total_and_quiet_silences_it(
        finished_run, workspace, tmp_path, capsys, monkeypatch):
    from tfaploss import cli
    from tfaploss.cli import evaluate as evaluate_command

    root, _ = workspace
    run_dir, _ = finished_run
    args = ["evaluate", "--model", str(run_dir / "model.keras"), "--data",
            str(root / "records" / "test"), "--ks", "1", "--batch-size", "5"]
    monkeypatch.setattr(evaluate_command, "is_terminal", lambda: True)  # as on a terminal
    assert cli.main([*args, "--out", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert "Unknown" not in printed
    assert "5/5" in printed  # 24 test images in batches of 5: the total is known
    assert cli.main([*args, "--out", str(tmp_path / "b"), "--quiet"]) == 0
    quiet = capsys.readouterr().out
    assert "5/5" not in quiet and "━" not in quiet
    assert "recall@1" in quiet  # the table is still there


@pytest.mark.slow
def test_untrained_baseline_is_the_model_train_starts_from(workspace, tmp_path, capsys):
    """`evaluate --config` gives the metrics of the model `train` starts from: a run
    whose updates are too small to change a float32 weight ends where it started."""
    from tfaploss.cli import main

    _, config = workspace
    run_dir = tmp_path / "still"
    frozen = ["--set", f"run_dir={run_dir}", "--set", "optimizer.name=sgd",
              "--set", "optimizer.lr=1e-30", "--set", "optimizer.schedule.name=constant",
              "--set", "optimizer.schedule.end_lr=null", "--set", "training.epochs=1",
              "--set", "training.steps_per_epoch=1", "--set", "evaluation.every_n_epochs=0"]
    assert main(["train", "--config", str(config), *frozen]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    capsys.readouterr()

    assert main(["evaluate", "--config", str(config), "--set", f"run_dir={run_dir}"]) == 0
    printed = capsys.readouterr().out
    assert "untrained model" in printed and "map@r" in printed
    out = run_dir / "eval_untrained_test"
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    assert set(metrics) >= {"recall@1", "recall@2", "map@r"}  # the config's ks: [1, 2]
    for key in ("recall@1", "recall@2", "map@r", "map"):
        assert metrics[key] == pytest.approx(summary["final_metrics"][key], abs=1e-6)


@pytest.mark.slow
def test_diverging_learning_rate_stops_training_and_saves_nothing(workspace, tmp_path,
                                                                   capsys):
    from tfaploss.cli import main

    _, config = workspace
    run_dir = tmp_path / "diverged"
    rc = main(["train", "--config", str(config), "--set", f"run_dir={run_dir}",
               "--set", "loss.name=ContrastiveLoss", "--set", "optimizer.name=sgd",
               "--set", "optimizer.lr=100", "--set", "optimizer.schedule.name=constant",
               "--set", "optimizer.schedule.end_lr=null"])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "training stopped" in err and "epoch 1" in err and "learning rate" in err
    assert "optimizer.lr=100" in err
    assert not (run_dir / "model.keras").exists()
    assert not (run_dir / "summary.json").exists()
    assert not list(run_dir.glob("backup/*.weights.h5"))


@pytest.mark.slow
def test_nan_in_epoch_two_stops_before_its_checkpoint(workspace, tmp_path, capsys):
    from tfaploss.cli import main
    from tfaploss.durable import faults

    _, config = workspace
    run_dir = tmp_path / "nan"
    with faults.armed("nan_weights:2:1"):
        rc = main(["train", "--config", str(config), "--set", f"run_dir={run_dir}",
                   "--set", "evaluation.every_n_epochs=0"])
    err = capsys.readouterr().err
    assert rc == 3, err
    # Batch 1 of epoch 2 ends with a NaN weight; batch 2 is where training stops.
    assert f"update {STEPS + 2} (epoch 2, batch 2 of {STEPS})" in err
    assert [p.name for p in run_dir.glob("backup/*.weights.h5")] == ["epoch-0001.weights.h5"]
    assert not (run_dir / "model.keras").exists()


def test_class_chunks_smaller_than_m_are_refused_up_front(tmp_path, workspace):
    """Before: a warning, then an input pipeline waiting forever for its first batch.
    Checked on the config (check_data is what `train` runs first), so that a regression
    fails here instead of hanging."""
    from tests.support.miniature import write_split_records
    from tfaploss.config import ConfigError, load_config
    from tfaploss.run import build as B

    _, config = workspace
    sizes = {k: 6 for k in range(4)}
    for chunk, m, expected in ((2, 4, "class_chunk_size=2"), (5, 4, "class_chunk_size=5")):
        split = tmp_path / f"chunks{chunk}"
        write_split_records(str(split), sizes, chunk_size=chunk)
        cfg = load_config(config, [f"data.train={split}", f"data.m={m}"])
        with pytest.raises(ConfigError) as err:
            B.check_data(cfg)
        # Both values named: the split's chunk size and the sampler's m.
        assert expected in str(err.value) and f"m={m}" in str(err.value)
        assert "wait forever" in str(err.value)
    # Chunks of 5 hold 3 images each for a class of 6: enough for m=2, so it is accepted.
    B.check_data(load_config(config, [f"data.train={tmp_path / 'chunks5'}"]))
    # Enough images per record, too few classes: the hierarchical sampler, like
    # m_per_class, needs batch_size / m of them (it was once counted as needing one).
    for sampler in ("m_per_class", "hierarchical"):
        cfg = load_config(config, [f"data.train={tmp_path / 'chunks5'}", "data.m=2",
                                   "data.batch_size=16", f"data.sampler={sampler}"])
        with pytest.raises(ConfigError, match=f"the {sampler} sampler needs 8"):
            B.check_data(cfg)


# --- optional parts: checked at start-up, one line each; a quiet start -------------------

# What TensorFlow's C++ side prints as it loads (absl-style "E0000 00:00:..." lines, the
# older "2024-01-01 ...: E tensorflow/..." ones, cuInit on a machine without GPU, oneDNN).
TF_NOISE = re.compile(r"^[IWEF]\d{4} |^\d{4}-\d\d-\d\d [\d:.]+: [IWEF] |cuInit|oneDNN|"
                      r"absl::InitializeLog", re.MULTILINE)


def _blocking(tmp_path: Path, *modules: str) -> dict:
    """Environment of a subprocess in which ``modules`` cannot be imported, as if not
    installed (a sitecustomize sets ``sys.modules[name] = None``)."""
    site = tmp_path / "blocked_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    path = os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH"))
                           if p)
    return {"PYTHONPATH": path}


def _without_tf_log_level() -> dict:
    env = _env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    return env


def test_missing_extra_stops_train_before_training_in_one_line(workspace, tmp_path,
                                                               monkeypatch, capsys):
    from tfaploss.cli import main

    monkeypatch.setitem(sys.modules, "scann", None)  # as if not installed
    _, config = workspace
    run_dir = tmp_path / "never"
    assert main(["train", "--config", str(config), "--set", "evaluation.backend=scann",
                 "--set", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert ('error: evaluation.backend: scann needs ScaNN, which is not installed: '
            'pip install "tfaploss[scann]" (Linux only)\n') in err
    assert "Traceback" not in err
    assert not run_dir.exists()  # nothing trained, nothing written


def test_evaluate_without_matplotlib_writes_metrics_and_skips_figures(workspace, tmp_path,
                                                                     monkeypatch, capsys):
    from tfaploss.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    _, config = workspace
    out = tmp_path / "eval"
    assert main(["evaluate", "--config", str(config), "--set", "evaluation.backend=auto",
                 "--ks", "1,2", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "exact search (auto)" in printed.out
    assert ('warning: drawing the figures needs matplotlib, which is not installed: '
            'pip install "tfaploss[viz]"; skipping them') in printed.err
    saved = json.loads((out / "metrics.json").read_text())
    assert "recall@1" in saved["metrics"] and saved["figures"] == []
    assert not list(out.glob("*.png"))


def test_help_starts_quietly_and_loads_no_tensorflow():
    result = subprocess.run([sys.executable, "-m", "tfaploss.cli", "--help"], check=False,
                            capture_output=True, text=True, cwd=REPO, timeout=60,
                            env=_without_tf_log_level())
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage: tfaploss")
    # The log level can only be set before TensorFlow loads: nothing before main() may.
    probe = ("import sys, tfaploss.cli as c; c.build_parser(); "
             "print(sorted(m for m in ('tensorflow', 'keras', 'jax', 'torch') "
             "if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                            text=True, cwd=REPO, timeout=60, env=_env())
    assert loaded.stdout.strip() == "[]"


def test_a_beam_job_without_beam_says_how_to_install_it(tmp_path):
    env = _env(_blocking(tmp_path, "apache_beam"))
    for job in ("folder", "tfds_source"):
        result = subprocess.run([sys.executable, "-m", f"tfaploss.pipelines.{job}", "--help"],
                                check=False, capture_output=True, text=True, cwd=REPO,
                                timeout=60, env=env)
        assert result.returncode == 2, result.stderr
        assert result.stderr == (f"error: python -m tfaploss.pipelines.{job} needs Apache Beam, "
                                 'which is not installed: pip install "tfaploss[beam]"\n')
    # The package itself stays importable without Beam.
    subprocess.run([sys.executable, "-c", "import tfaploss.pipelines"], check=True, cwd=REPO,
                   timeout=60, env=env)


@pytest.mark.long
def test_core_install_trains_the_demo_without_scann_or_matplotlib(tmp_path):
    """What a fresh core install does with the demo recipe: no ScaNN, no matplotlib, no
    faiss (blocked in the subprocess), TensorFlow's log level not set by the user. The
    run finishes with metrics from backend auto, and prints nothing before its first
    line."""
    pytest.importorskip("sklearn")
    from tfaploss.demo import run_folder_job, write_digit_pngs

    write_digit_pngs(tmp_path / "pngs")
    run_folder_job(tmp_path / "pngs", tmp_path / "records")
    env = {**_without_tf_log_level(),
           **_blocking(tmp_path, "scann", "matplotlib", "faiss")}
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "tfaploss.cli", "train", "--config",
         "configs/demo_digits.yaml", "--set", f"data.train={tmp_path / 'records' / 'train'}",
         "--set", f"data.test={tmp_path / 'records' / 'test'}", "--set", f"run_dir={run_dir}",
         "--set", "training.epochs=1", "--set", "training.steps_per_epoch=2",
         "--set", "evaluation.at_end=true"],
        check=False, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("tfaploss train: "), result.stdout[:500]
    assert not TF_NOISE.search(result.stderr), result.stderr
    assert "Traceback" not in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["final_metrics"]) >= {"recall@1", "map@r"}
    assert summary["config"]["evaluation"]["backend"] == "auto"
    assert summary["final_search"]["auto"]["chosen"] == "exact"
    assert "search backend auto: exact" in result.stdout


def test_tensorflow_log_level_is_quiet_unless_asked_for(monkeypatch):
    from tfaploss.cli import _quiet_tensorflow

    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    _quiet_tensorflow(["train", "--config", "x.yaml"])
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "3"  # 2 still shows the cuInit error
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    for verbose in (["-v", "train"], ["train", "--verbose"]):
        _quiet_tensorflow(verbose)
        assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ  # TensorFlow's own default
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    _quiet_tensorflow(["train"])
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"  # the user's choice is kept


@pytest.mark.slow
def test_an_extra_failing_at_the_final_evaluation_never_costs_the_summary(
        workspace, tmp_path, monkeypatch, capsys):
    """Installed, so the start-up check passes, but broken when the final evaluation
    imports it: the model and summary.json are written, without final metrics."""
    from tfaploss.cli import main
    from tfaploss.extras import MissingExtraError
    from tfaploss.run import trainer

    def broken(*args, **kwargs):
        raise MissingExtraError("scann", "evaluation.backend: scann",
                                "which is installed but cannot be imported (NotFoundError)")

    monkeypatch.setattr(trainer, "evaluate_split", broken)
    _, config = workspace
    run_dir = tmp_path / "run"
    assert main(["train", "--config", str(config), "--set", f"run_dir={run_dir}",
                 "--set", "training.epochs=1", "--set", "evaluation.every_n_epochs=0"]) == 0
    assert "warning: final evaluation skipped: evaluation.backend: scann needs ScaNN" in \
        capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_metrics"] is None and summary["epochs_completed"] == 1
    assert 'pip install "tfaploss[scann]"' in summary["final_search"]["skipped"]
    assert (run_dir / "model.keras").is_file() and not (run_dir / "backup").exists()
