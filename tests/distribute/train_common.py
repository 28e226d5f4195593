"""What the multi-process ``tfaploss train`` tests share (test_train_torch.py,
test_train_jax.py): tiny data, the configs, one-process references, launches of
ranks on 127.0.0.1 (tests/distribute/train_ranks.py) and what the runs left.

The data: 8 training classes of 8 generated 16x16 images, written by the folder job.
The configs: small_cnn with frozen BatchNorm (batch statistics would be per rank),
SmoothAPLoss, a global batch of 8 (m=2: whole classes, so it splits over 1, 2 and 4
ranks), SGD, 3 steps: ``plain`` (one pass), ``multistage`` (chunks of 2 rows, fewer
than a rank's share), ``long`` (2 epochs of 3 steps, for the preemption and restart
tests).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "distribute" / "train_ranks.py"
STEPS = 3
TIMEOUT_S = 60  # training.distribute.timeout_s of the runs: a failing test ends soon


def stop_point(result: dict, epoch: int, signalled: int) -> tuple[int, dict]:
    """The step of ``epoch`` (1-based) after which the ranks of a preempted run
    stopped, from rank 0's checkpoint indexes (train_ranks.py), and that checkpoint's
    index: ``(step, index)``.

    A rank that signals itself after step ``signalled`` of ``epoch`` is heard at the
    ranks' next agreement (:class:`tfaploss.run.processes.StopAgreement`): after the
    next step while an all-reduce is cheap against a step, after a few more when it is
    not (a loaded machine: seen in ``make test-long`` beside other work), and at the
    latest at the epoch's end, where the epoch checkpoint stands for the step one."""
    step = result["step"]
    if step is None:
        index = result["epoch"]
        assert index is not None and index["epoch"] == epoch, result
        return STEPS, index
    assert step["epoch"] == epoch and signalled < step["step"] <= STEPS, result
    return step["step"], step


def write_workspace(root: Path) -> dict[str, Path]:
    """The tiny training split under ``root`` and the configs; returns
    ``{name: config path}``."""
    from PIL import Image

    from tfaploss.pipelines import folder

    rng = np.random.default_rng(0)
    pngs = root / "pngs"
    for k in range(9):
        (pngs / f"c{k}").mkdir(parents=True)
        y, x = divmod(k, 3)
        for i in range(8):
            img = rng.integers(0, 60, (16, 16, 3), dtype=np.uint8)
            img[4 * y + 1:4 * y + 8, 4 * x + 1:4 * x + 8] = 230
            Image.fromarray(img).save(pngs / f"c{k}" / f"{i}.png")
    folder.run(["--input_dir", str(pngs), "--output_dir", str(root / "records"),
                "--test_classes", "c8", "--direct_running_mode", "in_memory",
                "--direct_num_workers", "1"])
    base = {
        "data": {"train": str(root / "records" / "train"), "sampler": "m_per_class",
                 "batch_size": 8, "m": 2, "image_size": 16},
        "model": {"backbone": "small_cnn", "pooling": "gem", "embedding_dim": 8,
                  "weights": None, "freeze_bn": True, "bn_calibration_images": 8},
        # smooth in the similarities: APLoss's histogram has kinks at its bin centres,
        # where float rounding (a sum in another order) can flip a gradient, which
        # SGD at lr 0.5 then carries into a few weights (4 ranks: 4e-5 in 57 of 36,864)
        "loss": {"name": "SmoothAPLoss"},
        "optimizer": {"name": "sgd", "lr": 0.5},
        "training": {"epochs": 1, "steps_per_epoch": STEPS,
                     "distribute": {"timeout_s": TIMEOUT_S}},
        "evaluation": {"at_end": False, "every_n_epochs": 0},
    }
    configs = {
        "plain": base,
        "multistage": {**base, "training": {**base["training"], "chunk_size": 2}},
        "long": {**base, "training": {**base["training"], "epochs": 2}},
    }
    paths = {}
    for name, raw in configs.items():
        paths[name] = root / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump({"run_dir": str(root / name), **raw}))
    return paths


def reference(config: Path, run_dir: Path, overrides=()) -> Path:
    """The one-process run of ``config`` (with ``--set`` ``overrides``) into
    ``run_dir``, in this process."""
    from tfaploss.config import load_config
    from tfaploss.run.trainer import train

    train(load_config(str(config), list(overrides)), run_dir=str(run_dir), verbose=0)
    return run_dir


def _rows(run_dir: Path) -> list[dict]:
    """epochs.jsonl, one row per epoch (a re-run epoch's row replaces the first)."""
    rows = {}
    for line in (run_dir / "epochs.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["epoch"]] = row
    return [rows[e] for e in sorted(rows)]


def step_losses(run_dir: Path) -> np.ndarray:
    """The loss of every step, from epochs.jsonl (rank 0's; the health check's trace)."""
    return np.array([loss for row in _rows(run_dir) for loss in row["health_steps"]["loss"]])


def weights(run_dir: Path) -> list[np.ndarray]:
    import keras

    # registers the custom objects
    import tfaploss.losses
    import tfaploss.models
    import tfaploss.training  # noqa: F401

    model = keras.saving.load_model(str(run_dir / "model.keras"), compile=False)
    return [np.asarray(w) for w in model.get_weights()]


def assert_same_run(run_dir: Path, ref_dir: Path, interrupted: bool = False) -> float:
    """The run's losses and final weights equal the reference's, which trains; returns
    the largest weight difference. The losses: of every step; of an ``interrupted``
    run, the last epoch's mean (its earlier epochs' rows hold only the steps of the
    process that finished them)."""
    if interrupted:
        loss, expected = _rows(run_dir)[-1]["loss"], _rows(ref_dir)[-1]["loss"]
        assert len(_rows(run_dir)) == len(_rows(ref_dir)) and expected > 0.01
        np.testing.assert_allclose(loss, expected, rtol=1e-5)
    else:
        losses, expected = step_losses(run_dir), step_losses(ref_dir)
        assert len(losses) == len(expected) == STEPS * len(_rows(ref_dir))
        assert np.all(expected > 0.01)
        np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=2e-6)
    got, want = weights(run_dir), weights(ref_dir)
    assert len(got) == len(want) > 10
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(backend: str) -> dict:
    """The ranks' environment: this backend, no GPU, XLA without forced host devices
    (one CPU device per process)."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if "host_platform_device_count" not in f)
    return {**os.environ, "KERAS_BACKEND": backend, "CUDA_VISIBLE_DEVICES": "",
            "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1", "XLA_FLAGS": flags,
            "OMP_NUM_THREADS": "1"}


def write_plan(out: Path, runs: list[dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "plan.json"
    path.write_text(json.dumps(runs))
    return path


def torchrun(plan: Path, out: Path, ranks: int, max_restarts: int = 0) -> subprocess.Popen:
    """``python -m torch.distributed.run`` of the worker on ``ranks`` local processes."""
    log = open(out / "launcher.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
         # c10d rendezvous on a free local port: each restart is a fresh round (the
         # static one keeps the first round's keys, and a restarted rank read rank
         # 0's old gloo address: "Connection refused")
         "--standalone", "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
         str(WORKER), str(plan), str(out)],
        cwd=REPO, env=env("torch"), stdout=log, stderr=subprocess.STDOUT)


def jax_processes(plan: Path, out: Path, ranks: int) -> list[subprocess.Popen]:
    """The worker as ``ranks`` JAX processes sharing one coordinator."""
    port = free_port()
    procs = []
    for rank in range(ranks):
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(plan), str(out), "--coordinator",
             f"127.0.0.1:{port}", "--num-processes", str(ranks), "--process-id",
             str(rank)], cwd=REPO, env=env("jax"), stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait(procs, out: Path, timeout: float) -> list[int]:
    """Every process's exit status; all are killed after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return [proc.returncode for proc in procs]


def results(out: Path, ranks: int) -> list[list[dict]]:
    """Each rank's per-run results (train_ranks.py), failing with the logs if absent."""
    found = []
    for rank in range(ranks):
        path = out / f"rank{rank}.json"
        if not path.exists():
            logs = "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("*.log")))
            raise AssertionError(f"rank {rank} left no results; logs:\n{logs}")
        found.append(json.loads(path.read_text()))
    return found
