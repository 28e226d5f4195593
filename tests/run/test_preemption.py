"""Preemption: `tfaploss train` stopped by SIGTERM or Ctrl-C (SIGINT) mid-epoch saves a
step checkpoint, exits 143 / 130 saying so on stderr, and the same command continues
from that step with the same batches: the final weights equal an uninterrupted run's.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from tests.support import miniature as mini
from tfaploss.durable import faults

REPO = Path(__file__).resolve().parents[2]
EPOCHS, STEPS = 3, 4
GRACE_S = 30  # what a cluster gives between SIGTERM and SIGKILL


def _env(extra=None):
    return {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3",
            "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", **(extra or {})}


def _train(config, extra_env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "tfaploss.cli", "train", "--config",
                           str(config)], cwd=REPO, capture_output=True, text=True,
                          env=_env(extra_env), timeout=timeout, check=False)


def _train_signalled_at(config, line_start: str, signum, timeout=300):
    """Run `tfaploss train` and send ``signum`` once it prints a line starting so;
    returns the completed process and the seconds from the signal to its exit."""
    proc = subprocess.Popen([sys.executable, "-m", "tfaploss.cli", "train", "--config",
                             str(config)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env())
    lines, sent = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if sent is None and line.startswith(line_start):
                proc.send_signal(signum)
                sent = time.monotonic()
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - sent if sent is not None else None
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines), ""), took


def _config(root: Path, name: str, data: Path) -> Path:
    config = {
        "run_dir": str(root / name),
        "data": {"train": str(data), "sampler": "m_per_class", "batch_size": 8, "m": 2,
                 "image_size": 16},
        "model": {"backbone": "small_cnn", "pooling": "gem", "embedding_dim": 8,
                  "weights": None, "bn_calibration_images": 8},
        "loss": {"name": "APLoss"},
        "optimizer": {"name": "adam", "lr": 1e-2},
        "training": {"epochs": EPOCHS, "steps_per_epoch": STEPS},
        "evaluation": {"every_n_epochs": 0, "at_end": False},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _weights(run_dir: Path) -> dict[str, np.ndarray]:
    """Every array of model.keras's weights file."""
    with zipfile.ZipFile(run_dir / "model.keras") as z:
        data = z.read("model.weights.h5")
    out = {}
    with h5py.File(io.BytesIO(data), "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def _noise(label, size):
    from PIL import Image

    rng = np.random.default_rng(label)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    mini.write_split_records(str(root / "train"), {k: 6 for k in range(6)},
                             image_fn=_noise)
    reference = _train(_config(root, "uninterrupted", root / "train"))
    assert reference.returncode == 0, reference.stdout + reference.stderr
    return root, _weights(root / "uninterrupted")


def _assert_same_weights(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.long
def test_sigterm_mid_epoch_saves_a_step_and_the_rerun_ends_equal(workspace):
    root, reference = workspace
    config = _config(root, "sigterm", root / "train")
    # A real SIGTERM, through the real handler, after step 2 of epoch 2.
    stopped = _train(config, {faults.ENV: "sigterm:2:2"})
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr
    assert "stopped by SIGTERM: checkpoint saved after step 2 of epoch 2" in stopped.stderr
    assert "Traceback" not in stopped.stdout + stopped.stderr
    backup = root / "sigterm" / "backup"
    assert sorted(p.name for p in backup.iterdir()) == [
        "checkpoint.json", "epoch-0001.weights.h5",
        "partial-epoch-0002-step-000002.weights.h5", "step.json"]
    resumed = _train(config)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming epoch 2 at step 3 of 4" in resumed.stdout + resumed.stderr
    _assert_same_weights(_weights(root / "sigterm"), reference)
    assert not backup.exists()
    assert [p.name for p in (root / "sigterm").iterdir() if p.name.startswith(".")] == []


@pytest.mark.long
def test_ctrl_c_at_any_moment_of_an_epoch_stops_within_the_grace_and_resumes_equal(
        workspace):
    root, reference = workspace
    config = _config(root, "sigint", root / "train")
    stopped, took = _train_signalled_at(config, f"Epoch 2/{EPOCHS}", signal.SIGINT)
    assert stopped.returncode == 130, stopped.stdout
    assert "stopped by SIGINT: checkpoint saved after " in stopped.stdout
    assert "Traceback" not in stopped.stdout
    assert took is not None and took < GRACE_S
    resumed = _train(config)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    _assert_same_weights(_weights(root / "sigint"), reference)
