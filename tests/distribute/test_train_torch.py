"""``tfaploss train`` under torchrun: 2 and 4 gloo ranks on 127.0.0.1 train as one process.

Each launch is ``python -m torch.distributed.run`` of tests/distribute/train_ranks.py,
which runs several ``tfaploss train`` commands in each rank (the imports are paid once
per launch); the one-process references train in this process. Compared: the loss of
every step (rank 0's epochs.jsonl) and the weights of model.keras, which rank 0 alone
writes (tests/distribute/train_common.py):

* 2 ranks, plain and multi-stage (chunks of 2 of each rank's 4 rows); 4 ranks, plain
  (once: 4 processes on the 2 cores of CI take a minute);
* SIGTERM to rank 1 after step 1: both ranks stop after one step, at their next
  agreement (step 2, or later on a loaded machine, at the latest at the epoch's end),
  rank 0 writes one step checkpoint, both exit 143, and the same command resumes to
  the uninterrupted weights;
* SIGKILL of rank 1 under ``--max-restarts 1``: torchrun restarts the group, which
  resumes from the last checkpoint and ends with the uninterrupted weights;
* a run directory holding a 2-rank checkpoint is refused to 1 process, and to another
  global batch, naming both.

PyTorch backend only; marked ``long``: ``make test-long`` runs it, ``make test`` does not.
"""

from __future__ import annotations

import json
import os
import signal
import time

import keras
import numpy as np
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("torchrun: KERAS_BACKEND=torch only", allow_module_level=True)

from tests.distribute.train_common import (
    STEPS,
    assert_same_run,
    reference,
    results,
    stop_point,
    torchrun,
    wait,
    weights,
    write_plan,
    write_workspace,
)

pytestmark = [pytest.mark.slow, pytest.mark.long]
LAUNCH_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    return root, write_workspace(root)


@pytest.fixture(scope="module")
def references(workspace):
    root, configs = workspace
    return {name: reference(path, root / f"ref-{name}") for name, path in configs.items()}


def _train(workspace, config: str, run_dir: str, faults=None) -> dict:
    root, configs = workspace
    return {"args": ["--quiet", "train", "--config", str(configs[config]),
                     "--run-dir", str(root / run_dir)], "faults": faults or {}}


@pytest.fixture(scope="module")
def two_ranks(workspace, references):
    """One launch of 2 ranks: plain, multi-stage, preempted by a SIGTERM to rank 1 and
    resumed, and preempted by a SIGTERM to rank 0 (left so, for the refusals)."""
    root, _ = workspace
    out = root / "launch2"
    plan = write_plan(out, [
        _train(workspace, "plain", "plain2"),
        _train(workspace, "multistage", "multistage2"),
        _train(workspace, "long", "preempted2", {"1": "sigterm:1:1"}),
        _train(workspace, "long", "preempted2"),
        _train(workspace, "long", "refused2", {"0": "sigterm:2:1"}),
    ])
    started = time.monotonic()
    status = wait([torchrun(plan, out, 2)], out, LAUNCH_TIMEOUT_S)
    print(f"2 ranks, 5 runs: {time.monotonic() - started:.0f} s")
    assert status == [0], (out / "launcher.log").read_text()[-4000:]
    return results(out, 2)


def test_references_train(workspace, references):
    plain, long = weights(references["plain"]), weights(references["long"])
    assert max(float(np.abs(a - b).max()) for a, b in zip(plain, long)) > 1e-3


@pytest.mark.parametrize("name", ["plain", "multistage"])
def test_two_ranks_train_as_one_process(name, workspace, references, two_ranks):
    root, _ = workspace
    run = ["plain", "multistage"].index(name)
    assert [ranks[run]["status"] for ranks in two_ranks] == [0, 0]
    summary = json.loads((root / f"{name}2" / "summary.json").read_text())
    assert summary["processes"]["processes"] == 2
    assert summary["multistage"] == (name == "multistage")
    diff = assert_same_run(root / f"{name}2", references[name])
    print(f"max weight difference to one process: {diff:.2e}")


def test_sigterm_to_one_rank_stops_every_rank_at_one_step(workspace, references,
                                                          two_ranks):
    root, _ = workspace
    stopped, resumed = 2, 3
    assert [ranks[stopped]["status"] for ranks in two_ranks] == [143, 143]
    # rank 1 signalled itself after step 1 of epoch 1; both stopped at one agreement
    step, index = stop_point(two_ranks[0][stopped], 1, 1)
    assert (index["processes"], index["global_batch"]) == (2, 8)
    if step < STEPS:
        assert two_ranks[0][stopped]["epoch"] is None  # no epoch finished
    assert [ranks[resumed]["status"] for ranks in two_ranks] == [0, 0]
    summary = json.loads((root / "preempted2" / "summary.json").read_text())
    assert summary["resumed"] and summary["updates"] == 6
    diff = assert_same_run(root / "preempted2", references["long"], interrupted=True)
    print(f"max weight difference to one process: {diff:.2e}")


def test_a_checkpoint_of_two_ranks_is_refused_to_another_layout(workspace, two_ranks,
                                                                capsys):
    from tfaploss.cli import main

    root, configs = workspace
    run_dir = root / "refused2"
    assert [ranks[4]["status"] for ranks in two_ranks] == [143, 143]  # SIGTERM to rank 0
    stop_point(two_ranks[0][4], 2, 1)  # rank 0 signalled itself after step 1 of epoch 2
    before = sorted(p.name for p in (run_dir / "backup").iterdir())
    args = ["train", "--config", str(configs["long"]), "--run-dir", str(run_dir)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "a run on 2 process(es) with a global batch of 8" in err
    assert "this run has 1 process(es) with a global batch of 8" in err
    assert main([*args, "--set", "data.batch_size=16"]) == 2
    assert "this run has 1 process(es) with a global batch of 16" in capsys.readouterr().err
    assert sorted(p.name for p in (run_dir / "backup").iterdir()) == before


def test_four_ranks_train_as_one_process(workspace, references):
    root, _ = workspace
    out = root / "launch4"
    plan = write_plan(out, [_train(workspace, "plain", "plain4")])
    started = time.monotonic()
    status = wait([torchrun(plan, out, 4)], out, LAUNCH_TIMEOUT_S)
    print(f"4 ranks, 1 run: {time.monotonic() - started:.0f} s")
    assert status == [0], (out / "launcher.log").read_text()[-4000:]
    assert [ranks[0]["status"] for ranks in results(out, 4)] == [0] * 4
    diff = assert_same_run(root / "plain4", references["plain"])
    print(f"max weight difference to one process: {diff:.2e}")


def test_a_killed_rank_restarts_the_group_which_resumes(workspace, references):
    root, _ = workspace
    out = root / "launch-killed"
    run_dir = root / "killed2"
    plan = write_plan(out, [_train(workspace, "long", "killed2")])
    proc = torchrun(plan, out, 2, max_restarts=1)
    checkpoint = run_dir / "backup" / "checkpoint.json"
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert checkpoint.exists(), (out / "launcher.log").read_text()[-4000:]
    os.kill(int((out / "pid-rank1-attempt0").read_text()), signal.SIGKILL)  # in epoch 2
    started = time.monotonic()
    status = wait([proc], out, LAUNCH_TIMEOUT_S)
    print(f"kill to finished run: {time.monotonic() - started:.0f} s")
    assert status == [0], (out / "launcher.log").read_text()[-4000:]
    assert (out / "pid-rank0-attempt1").exists()  # the group was started again
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed"] and summary["resumed_after_epoch"] == 1
    assert summary["updates"] == 6
    diff = assert_same_run(run_dir, references["long"], interrupted=True)
    print(f"max weight difference to one process: {diff:.2e}")
