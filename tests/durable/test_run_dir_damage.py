"""Resuming a damaged run directory, and one run per run directory.

A tiny run is stopped in its third epoch (in-process: a NaN weight, which stops it the
way a kill does, after the checkpoint of epoch 2); each test copies that run directory
and damages one file the way no kill does. Every variant must stop `tfaploss train`
with exit status 2 and a message naming the file, with no traceback, leaving every file
as it was; `--restart` moves the files aside and trains; what a kill leaves (a torn last
line of the epoch log, a torn index) still resumes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support import miniature as mini

REPO = Path(__file__).resolve().parents[2]
EPOCHS = 3


def _raw(tmp: Path) -> dict:
    return {
        "run_dir": str(tmp / "run"),
        "data": {"train": str(tmp / "train"), "batch_size": 8, "m": 2, "image_size": 16},
        "model": {"backbone": "small_cnn", "embedding_dim": 8, "weights": None,
                  "bn_calibration_images": 0, "precise_bn_images": 0},
        "loss": {"name": "APLoss"},
        "optimizer": {"name": "adam", "lr": 1e-3},
        "training": {"epochs": EPOCHS, "steps_per_epoch": 2, "chunk_size": 8,
                     "health": {"enabled": False}},
        "evaluation": {"at_end": False, "every_n_epochs": 0},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(config file, unfinished run dir, finished run dir)``: the unfinished one
    stopped in epoch 3 after the checkpoint of epoch 2 (rows 1, 2; backup epoch 2)."""
    from tfaploss.config import config_from_dict
    from tfaploss.durable import faults
    from tfaploss.run.trainer import train
    from tfaploss.training.guards import NonFiniteTrainingError

    tmp = tmp_path_factory.mktemp("damage")
    mini.write_split_records(str(tmp / "train"), {k: 4 for k in range(4)})
    raw = _raw(tmp)
    config = tmp / "tiny.yaml"
    config.write_text(yaml.safe_dump(raw))
    cfg = config_from_dict(raw, warn=False)
    with faults.armed("nan_weights:3:1"), pytest.raises(NonFiniteTrainingError):
        train(cfg, verbose=0)
    unfinished = tmp / "run"
    assert [json.loads(x)["epoch"] for x in (unfinished / "epochs.jsonl").read_text()
            .splitlines()] == [1, 2]
    assert (unfinished / "backup" / "epoch-0002.weights.h5").is_file()
    finished = tmp / "finished"
    shutil.copytree(unfinished, finished)
    summary = train(cfg, run_dir=str(finished), verbose=0)  # a moved run dir resumes
    assert summary["resumed_after_epoch"] == 2 and summary["epochs_completed"] == EPOCHS
    return config, unfinished, finished


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = ("<dir>" if path.is_dir() else
                    hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def _copy(source: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "copy"
    shutil.copytree(source, run_dir)
    return run_dir


def _train_cli(config: Path, run_dir: Path, *extra: str):
    """``tfaploss train`` in this process: (exit status, stdout, stderr)."""
    import contextlib
    import io

    from tfaploss.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["train", "--config", str(config), "--set", f"run_dir={run_dir}", *extra])
    return rc, out.getvalue(), err.getvalue()


def _rows(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n"
                    for r in rows)


R1, R2 = {"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.4}


def _log(data: bytes):
    return lambda d: (d / "epochs.jsonl").write_bytes(data)


def _set_config(data: bytes):
    return lambda d: (d / "config.yaml").write_bytes(data)


def _make_dir(name: str):
    def damage(d):
        path = d / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        path.mkdir()
        (path / "x").write_text("x")
    return damage


def _checkpoint(d: Path) -> Path:
    return d / "backup" / "epoch-0002.weights.h5"


def _truncate(d):
    data = _checkpoint(d).read_bytes()
    _checkpoint(d).write_bytes(data[: len(data) // 2])


def _garbage(d):
    size = _checkpoint(d).stat().st_size
    _checkpoint(d).write_bytes(os.urandom(size))


def _garbage_no_index(d):
    _garbage(d)
    (d / "backup" / "checkpoint.json").unlink()


def _truncate_no_index(d):
    _truncate(d)
    (d / "backup" / "checkpoint.json").unlink()


def _remove(*names):
    def damage(d):
        for name in names:
            path = d / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return damage


def _backup_file(d):
    shutil.rmtree(d / "backup")
    (d / "backup").write_text("not a folder")


def _summary_garbage(d):
    (d / "summary.json").write_bytes(b"\x00\x01garbage")


# (variant, damage, the file the message must name, words it must hold)
UNFINISHED = [
    ("log: invalid UTF-8", _log(_rows(b'{"epoch": 1, "loss": "\xff\xfe"}', R2)),
     "epochs.jsonl", "line 1: is not UTF-8"),
    ("log: Infinity", _log(_rows(b'{"epoch": 1, "loss": Infinity}', R2)), "epochs.jsonl",
     "Infinity"),
    ("log: -Infinity", _log(_rows(R1, b'{"epoch": 2, "loss": -Infinity}')), "epochs.jsonl",
     "line 2"),
    ("log: NaN", _log(_rows(b'{"epoch": 1, "loss": NaN}', R2)), "epochs.jsonl", "NaN"),
    ("log: 1e308", _log(_rows({"epoch": 1, "loss": 1e308}, R2)), "epochs.jsonl",
     "float32"),
    ("log: 1e400", _log(_rows(b'{"epoch": 1, "loss": 1e400}', R2)), "epochs.jsonl",
     "inf"),
    ("log: nested 1e308", _log(_rows(R1, {"epoch": 2, "health": [{"emb_cos": -1e300}]})),
     "epochs.jsonl", "health[0].emb_cos"),
    ("log: huge integer", _log(_rows(R1, {"epoch": 2, "updates": 10**40})), "epochs.jsonl",
     "updates"),
    ("log: negative epoch", _log(_rows({"epoch": -1}, R2)), "epochs.jsonl",
     "epoch -1 is outside 1..3"),
    ("log: epoch 0", _log(_rows({"epoch": 0}, R1, R2)), "epochs.jsonl", "epoch 0"),
    ("log: epoch 10**30", _log(_rows(R1, {"epoch": 10**30})), "epochs.jsonl",
     "outside 1..3"),
    ("log: beyond training.epochs", _log(_rows(R1, R2, {"epoch": 4})), "epochs.jsonl",
     "epoch 4 is outside 1..3"),
    ("log: out of order", _log(_rows(R2, R1)), "epochs.jsonl", "missing"),
    ("log: going back", _log(_rows(R1, R2, R1)), "epochs.jsonl", "out of order"),
    ("log: gap", _log(_rows(R1, {"epoch": 3})), "epochs.jsonl", "epoch 2 is missing"),
    ("log: float epoch", _log(_rows({"epoch": 1.5}, R2)), "epochs.jsonl",
     "not a whole number"),
    ("log: 2.0 epoch", _log(_rows(R1, {"epoch": 2.0})), "epochs.jsonl",
     "not a whole number"),
    ("log: string epoch", _log(_rows({"epoch": "1"}, R2)), "epochs.jsonl",
     "not a whole number"),
    ("log: boolean epoch", _log(_rows({"epoch": True}, R2)), "epochs.jsonl",
     "not a whole number"),
    ("log: no epoch", _log(_rows({"loss": 0.5}, R2)), "epochs.jsonl", "not a whole number"),
    ("log: a list row", _log(_rows([1, 2], R2)), "epochs.jsonl", "not an epoch row"),
    ("log: a string row", _log(_rows('"epoch"', R2)), "epochs.jsonl", "not an epoch row"),
    ("log: a null row", _log(_rows(None, R1, R2)), "epochs.jsonl", "not an epoch row"),
    ("log: not JSON", _log(_rows(b"{epoch: 1}", R2)), "epochs.jsonl", "is not JSON"),
    ("log: blank line", _log(_rows(R1, b"", R2)), "epochs.jsonl", "line 2: is not JSON"),
    ("log: deep nesting", _log(_rows(b"[" * 100_000 + b"]" * 100_000, R1, R2)),
     "epochs.jsonl", "nests too deeply"),
    ("log: garbage tail", _log(_rows(R1, R2) + b"\x89PNG\r\n\x1a garbage"), "epochs.jsonl",
     "do not start an epoch row"),
    ("log: emptied", _log(b""), "epochs.jsonl", "rows are missing"),
    ("log: removed", _remove("epochs.jsonl"), "epochs.jsonl", "is missing"),
    ("log: a folder", _make_dir("epochs.jsonl"), "epochs.jsonl", "is a folder"),
    ("config: not UTF-8", _set_config(b"run_dir: \xff\xfe\n"), "config.yaml",
     "is not UTF-8"),
    ("config: not YAML", _set_config(b"data: [unclosed\n  loss: {"), "config.yaml",
     "is not YAML"),
    ("config: a list", _set_config(b"- a\n- b\n"), "config.yaml", "a list, not a mapping"),
    ("config: a string", _set_config(b"just words\n"), "config.yaml", "not a mapping"),
    ("config: empty", _set_config(b""), "config.yaml", "holds nothing"),
    ("config: a folder", _make_dir("config.yaml"), "config.yaml", "is a folder"),
    ("config: 2 MiB", _set_config(b"# " + b"x" * (2 << 20)), "config.yaml", "a few KB"),
    ("config: 5000 digits", _set_config(b"training: {epochs: " + b"9" * 5000 + b"}\n"),
     "config.yaml", "no run config holds"),
    ("config: deep nesting", _set_config(b"a: " + b"[" * 50_000 + b"]" * 50_000),
     "config.yaml", "nests too deeply"),
    ("config: python tag", _set_config(b"run_dir: !!python/object/apply:os.system [ls]\n"),
     "config.yaml", "is not YAML"),
    ("weights: cut short", _truncate, "epoch-0002.weights.h5", "cut short"),
    ("weights: zero bytes", lambda d: _checkpoint(d).write_bytes(b""),
     "epoch-0002.weights.h5", "emptied"),
    ("weights: garbage", _garbage, "epoch-0002.weights.h5", "SHA-256"),
    ("weights: garbage, no index", _garbage_no_index, "epoch-0002.weights.h5",
     "not a readable checkpoint"),
    ("weights: cut short, no index", _truncate_no_index, "epoch-0002.weights.h5",
     "not a readable checkpoint"),
    ("weights: zero bytes, no index",
     lambda d: (_checkpoint(d).write_bytes(b""), (d / "backup/checkpoint.json").unlink()),
     "epoch-0002.weights.h5", "is empty"),
    ("weights: a folder", _make_dir("backup/epoch-0002.weights.h5"),
     "epoch-0002.weights.h5", "is a folder"),
    ("weights: removed", _remove("backup/epoch-0002.weights.h5"), "checkpoint.json",
     "which is not in"),
    ("index: a folder", _make_dir("backup/checkpoint.json"), "checkpoint.json",
     "is a folder"),
    ("backup: a file", _backup_file, "backup", "is a file"),
    ("backup: removed", _remove("backup"), "epochs.jsonl", "no checkpoint"),
    ("model.keras: a folder", _make_dir("model.keras"), "model.keras", "is a folder"),
    ("summary.json: garbage", _summary_garbage, "summary.json", "is not"),
    ("logs: a file", lambda d: (shutil.rmtree(d / "logs", ignore_errors=True),
                                (d / "logs").write_text("x")), "logs", "is a file"),
]

FINISHED = [
    ("finished: summary garbage", _summary_garbage, "summary.json", "is not"),
    ("finished: summary a list", lambda d: (d / "summary.json").write_text("[1]"),
     "summary.json", "not a run summary"),
    ("finished: summary removed", _remove("summary.json"), "summary.json", "is missing"),
    ("finished: model cut short", lambda d: (d / "model.keras").write_bytes(
        (d / "model.keras").read_bytes()[:1000]), "model.keras", "not a Keras model"),
    ("finished: model zero bytes", lambda d: (d / "model.keras").write_bytes(b""),
     "model.keras", "0 bytes"),
    ("finished: model removed", _remove("model.keras"), "model.keras", "is missing"),
    ("finished: epochs short",
     lambda d: (d / "summary.json").write_text(json.dumps(
         {**json.loads((d / "summary.json").read_text()), "epochs_completed": 1})),
     "summary.json", "1 of 3 epochs"),
]


@pytest.mark.slow
@pytest.mark.parametrize("variant, damage, name, words",
                         UNFINISHED + FINISHED, ids=[v[0] for v in UNFINISHED + FINISHED])
def test_a_damaged_run_dir_stops_with_exit_2_naming_the_file(runs, tmp_path, variant,
                                                              damage, name, words):
    config, unfinished, finished = runs
    run_dir = _copy(finished if variant.startswith("finished") else unfinished, tmp_path)
    damage(run_dir)
    before = _snapshot(run_dir)
    started = time.perf_counter()
    rc, out, err = _train_cli(config, run_dir)
    seconds = time.perf_counter() - started
    assert rc == 2, (variant, out, err)
    assert "Traceback" not in out + err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    first = errors[0]
    assert first.startswith("error: damaged run directory: "), err
    assert name in first and words in first, (variant, err)
    assert "--restart" in first and "Either " in first  # the two ways out
    assert _snapshot(run_dir) == before  # nothing changed, nothing deleted
    assert seconds < 10, seconds  # refused before any model is built


def test_a_model_weights_file_that_is_a_folder_or_cut_short_is_a_clear_error(runs,
                                                                           tmp_path):
    """``model.weights`` (the backbone's starting weights, outside the run dir): a
    folder, or a file cut short, gives a message naming it, no traceback."""
    config, _, _ = runs
    (tmp_path / "weights").mkdir()
    rc, _, err = _train_cli(config, tmp_path / "a", "--set",
                            f"model.weights={tmp_path / 'weights'}")
    assert rc == 1 and "a folder, not a weights file" in err and "Traceback" not in err
    truncated = tmp_path / "cut.weights.h5"
    truncated.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(40))
    rc, _, err = _train_cli(config, tmp_path / "b", "--set", f"model.weights={truncated}")
    assert rc == 2 and "Traceback" not in err, err
    assert f"config key 'model.weights': {str(truncated)!r} does not load" in err


def test_the_python_api_raises_damaged_run_error(runs, tmp_path):
    from tfaploss.config import load_config
    from tfaploss.run.trainer import DamagedRunError, train

    config, unfinished, _ = runs
    run_dir = _copy(unfinished, tmp_path)
    _truncate(run_dir)
    with pytest.raises(DamagedRunError) as err:
        train(load_config(config, [f"run_dir={run_dir}"], warn=False), verbose=0)
    assert err.value.path == _checkpoint(run_dir) and "cut short" in err.value.problem


@pytest.mark.long
def test_restart_moves_the_damaged_files_aside_and_trains(runs, tmp_path):
    config, unfinished, _ = runs
    run_dir = _copy(unfinished, tmp_path)
    _truncate(run_dir)
    (run_dir / "epochs.jsonl").write_bytes(b'{"epoch": 1, "loss": NaN}\n')
    before = _snapshot(run_dir)
    rc, out, err = _train_cli(config, run_dir, "--restart")
    assert rc == 0, out + err
    assert "--restart: moved the previous run's files" in err and "damaged" in err
    aside = [p for p in run_dir.iterdir() if p.name.startswith("damaged-")]
    assert len(aside) == 1
    # Every old file is there, byte for byte, under damaged-<time>/.
    assert {k: v for k, v in _snapshot(aside[0]).items()} == before
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_after_epoch"] == 0 and summary["epochs_completed"] == EPOCHS
    assert [r["epoch"] for r in summary["history"]] == [1, 2, 3]
    # A healthy finished run restarted: moved into previous-<time>/.
    rc, out, err = _train_cli(config, run_dir, "--restart")
    assert rc == 0, out + err
    assert len([p for p in run_dir.iterdir() if p.name.startswith("previous-")]) == 1


@pytest.mark.long
def test_what_a_kill_leaves_still_resumes(runs, tmp_path):
    """A last line cut short by a kill (with NUL bytes after it, as a crash without
    ordered writes can leave), an epoch re-run after a kill, a torn index and a killed
    write's temporary files: all normal, the run resumes after epoch 2."""
    config, unfinished, _ = runs
    run_dir = _copy(unfinished, tmp_path)
    rows = (run_dir / "epochs.jsonl").read_bytes()
    lines = rows.splitlines(keepends=True)
    # Epoch 2 logged twice (a kill after its row, before its checkpoint; re-run), then
    # epoch 3's row torn.
    (run_dir / "epochs.jsonl").write_bytes(rows + lines[1] + b'{"epoch": 3, "lo')
    (run_dir / "backup" / "checkpoint.json").write_bytes(b'{"format": 1, "lat')
    (run_dir / ".summary.tmp-99999.json").write_bytes(b"{")
    (run_dir / "backup" / ".epoch-0003.tmp-99999.weights.h5").write_bytes(b"\x89HDF")
    rc, out, err = _train_cli(config, run_dir)
    assert rc == 0, out + err
    assert "resuming from its last checkpoint: epoch 2 done" in out
    assert "checkpoint.json is unreadable" in out + err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_after_epoch"] == 2 and summary["updates"] == EPOCHS * 2
    assert [r["epoch"] for r in summary["history"]] == [1, 2, 3]
    lines = (run_dir / "epochs.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [1, 2, 2, 3]

    # NUL bytes where the last line should be: what a power cut can leave.
    run_dir = _copy(unfinished, tmp_path / "nul")
    with open(run_dir / "epochs.jsonl", "ab") as f:
        f.write(b"\0" * 300)
    from tfaploss.config import load_config
    from tfaploss.run import resume as R

    cfg = load_config(config, [f"run_dir={run_dir}"], warn=False)
    state = R.inspect(run_dir, cfg)
    assert state.resuming and state.checkpoint[0] == 2
    assert [r["epoch"] for r in state.rows] == [1, 2]


def test_the_epoch_log_never_holds_nan(runs):
    """The writer's side: non-finite values are written as null (strict JSON)."""
    _, _, finished = runs
    for line in (finished / "epochs.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(name))


def test_another_config_in_a_finished_run_dir_is_refused(runs, tmp_path):
    """Before: trained again over the finished run, mixing both runs' epoch rows."""
    config, _, finished = runs
    run_dir = _copy(finished, tmp_path)
    before = _snapshot(run_dir)
    rc, _, err = _train_cli(config, run_dir, "--set", "optimizer.lr=0.01")
    assert rc == 2 and "finished run made with a different config" in err
    assert "optimizer.lr" in err and "--restart" in err
    assert _snapshot(run_dir) == before


# ------------------------------------------------------------------ one run per run dir


HOLD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("locks", sys.argv[1])
locks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(locks)  # alone: not the tfaploss package (it imports Keras)
locks.acquire(sys.argv[2], **({"name": sys.argv[3]} if len(sys.argv) > 3 else {}))
print("held", flush=True)
time.sleep(600)
"""


def hold_lock(folder: Path, *name: str) -> subprocess.Popen:
    """A process holding ``folder``'s lock until killed (prints "held" once it does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD,
                             str(REPO / "tfaploss" / "durable" / "locks.py"), str(folder),
                             *name], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
def test_a_second_train_on_a_held_run_dir_is_refused_naming_the_holder(runs, tmp_path):
    config, unfinished, _ = runs
    run_dir = _copy(unfinished, tmp_path)
    holder = hold_lock(run_dir)
    try:
        before = _snapshot(run_dir)
        rc, out, err = _train_cli(config, run_dir)
        assert rc == 2, out + err
        assert f"PID {holder.pid}" in err and "is in use by another process" in err
        assert "since " in err and "command: " in err and "Traceback" not in err
        assert _snapshot(run_dir) == before
    finally:
        holder.kill()
        holder.wait()
    # Killed with SIGKILL: its lock stays behind, stale; the next run takes it over.
    assert (run_dir / ".tfaploss.lock").exists()
    rc, out, err = _train_cli(config, run_dir)
    assert rc == 0, out + err
    assert "took over the lock" in err and f"process {holder.pid} is no longer running" in err
    assert not (run_dir / ".tfaploss.lock").exists()  # released at the end


def test_the_lock_is_released_when_training_fails(runs, tmp_path):
    from tfaploss.config import load_config
    from tfaploss.run.trainer import DamagedRunError, train

    config, unfinished, _ = runs
    run_dir = _copy(unfinished, tmp_path)
    _truncate(run_dir)
    with pytest.raises(DamagedRunError):
        train(load_config(config, [f"run_dir={run_dir}"], warn=False), verbose=0)
    assert not (run_dir / ".tfaploss.lock").exists()


@pytest.mark.long
def test_two_tfaploss_train_at_once_the_second_is_refused(runs, tmp_path):
    """A real `tfaploss train` in a subprocess, and the same command started while it
    trains: refused, naming its PID; the first one finishes untouched."""
    config, _, _ = runs
    run_dir = tmp_path / "one_run_dir"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "tfaploss.cli", "train", "--config", str(config), "--set",
         f"run_dir={run_dir}", "--set", "training.epochs=3", "--set",
         "training.steps_per_epoch=30"], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in first.stdout:
            lines.append(line)
            if line.startswith("Epoch 1/"):
                break
        rc, out, err = _train_cli(config, run_dir, "--set", "training.steps_per_epoch=30")
        assert rc == 2, out + err
        assert f"PID {first.pid}" in err and "tfaploss.cli train" in err
        lines.append(first.communicate(timeout=600)[0])
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGKILL)
            first.wait()
    assert first.returncode == 0, "".join(lines)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs_completed"] == 3 and summary["updates"] == 90
    assert not (run_dir / ".tfaploss.lock").exists()
