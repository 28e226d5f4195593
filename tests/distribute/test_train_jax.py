"""``tfaploss train --coordinator``: 2 JAX processes on 127.0.0.1 train as one process.

One launch of 2 processes (tests/distribute/train_ranks.py, one CPU device each,
``keras.distribution.DataParallel`` over both) runs several ``tfaploss train`` commands;
the one-process references train in this process. Compared: the loss of every step
(rank 0's epochs.jsonl) and the weights of model.keras, which rank 0 alone writes
(tests/distribute/train_common.py), for a plain and a multi-stage run (chunks of 2 of
each process's 4 rows), and for a run that a SIGTERM to process 1 stopped on both
(exit 143, one step checkpoint) and the same command resumed. 4 processes: in the
PyTorch test only (test_train_torch.py), 4 JAX processes' compilations on the 2 cores
of CI being several minutes.

JAX backend only; marked ``long``: ``make test-long`` runs it, ``make test`` does not.
"""

from __future__ import annotations

import json
import time

import keras
import pytest

if keras.backend.backend() != "jax":
    pytest.skip("jax.distributed: KERAS_BACKEND=jax only", allow_module_level=True)

from tests.distribute.train_common import (
    assert_same_run,
    jax_processes,
    reference,
    results,
    stop_point,
    wait,
    write_plan,
    write_workspace,
)

pytestmark = [pytest.mark.slow, pytest.mark.long]
LAUNCH_TIMEOUT_S = 900
# Under several JAX processes the step must be compiled (tfaploss.run.devices).
JIT = ["training.jit_compile=true"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("jax_ranks")
    return root, write_workspace(root)


@pytest.fixture(scope="module")
def references(workspace):
    root, configs = workspace
    return {name: reference(path, root / f"ref-{name}", JIT)
            for name, path in configs.items()}


@pytest.fixture(scope="module")
def two_processes(workspace, references):
    root, configs = workspace

    def train(config, run_dir, faults=None):
        return {"args": ["--quiet", "train", "--config", str(configs[config]),
                         "--run-dir", str(root / run_dir), "--set", JIT[0]],
                "faults": faults or {}}

    out = root / "launch2"
    plan = write_plan(out, [
        train("plain", "plain2"),
        train("multistage", "multistage2"),
        train("long", "preempted2", {"1": "sigterm:1:1"}),
        train("long", "preempted2"),
    ])
    started = time.monotonic()
    statuses = wait(jax_processes(plan, out, 2), out, LAUNCH_TIMEOUT_S)
    print(f"2 JAX processes, 4 runs: {time.monotonic() - started:.0f} s")
    found = results(out, 2)
    assert statuses == [0, 0]
    return found


@pytest.mark.parametrize("name", ["plain", "multistage"])
def test_two_processes_train_as_one(name, workspace, references, two_processes):
    root, _ = workspace
    run = ["plain", "multistage"].index(name)
    assert [ranks[run]["status"] for ranks in two_processes] == [0, 0]
    summary = json.loads((root / f"{name}2" / "summary.json").read_text())
    assert summary["processes"]["processes"] == 2
    assert summary["distribute"]["devices"] == 2  # DataParallel over both processes
    diff = assert_same_run(root / f"{name}2", references[name])
    print(f"max weight difference to one process: {diff:.2e}")


def test_sigterm_to_one_process_stops_both_then_resumes(workspace, references,
                                                        two_processes):
    root, _ = workspace
    assert [ranks[2]["status"] for ranks in two_processes] == [143, 143]
    # process 1 signalled itself after step 1 of epoch 1; both stopped at one agreement
    _, index = stop_point(two_processes[0][2], 1, 1)
    assert index["processes"] == 2
    assert [ranks[3]["status"] for ranks in two_processes] == [0, 0]
    summary = json.loads((root / "preempted2" / "summary.json").read_text())
    assert summary["resumed"] and summary["updates"] == 6
    diff = assert_same_run(root / "preempted2", references["long"], interrupted=True)
    print(f"max weight difference to one process: {diff:.2e}")
