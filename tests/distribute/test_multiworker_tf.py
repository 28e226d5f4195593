"""Ranking losses under ``tf.distribute.MultiWorkerMirroredStrategy``: two worker
processes on 127.0.0.1 (``TF_CONFIG``, ports from the OS, one CPU replica each) rank
the GLOBAL batch, giving the loss and the weights of one device, step by step.

The batch (32 items, 16 classes) is laid out so that each replica's shard holds one
item of every class: ranking a shard on its own gives loss 0 and no update. The
workers (tests/distribute/multiworker_worker.py) train a plain Keras model and MultiStageModel
with ``APLoss`` for 3 SGD steps in one launch, each replica fed its own shard
explicitly (``experimental_distribute_values_from_function``, no auto-sharding), in a
custom ``strategy.run`` loop: Keras 3's ``fit`` does not run under this strategy
(keras-team/keras#20585), which the last test checks so that it notices a Keras that
does. The one-device reference is a plain ``fit`` in this process, on the global batch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.distribute import multiworker_worker as worker
from tfaploss.losses import APLoss

pytestmark = pytest.mark.long

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 240  # both workers, from their launch; a lost peer hangs its collectives


def _free_ports(count):
    """``count`` distinct ports the OS has just handed out on 127.0.0.1."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _log_tail(path, chars=3000):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-chars:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(results of each worker, one-device losses and weights, initial weights)``.

    The workers run while this process computes the one-device reference; they are
    killed on the way out, whatever happened.
    """
    out = tmp_path_factory.mktemp("multiworker")
    cluster = {"worker": [f"127.0.0.1:{port}" for port in _free_ports(worker.WORKERS)]}
    env = {**os.environ, "PYTHONPATH": REPO, "KERAS_BACKEND": "tensorflow",
           "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "-1"}
    procs, logs = [], []
    try:
        for index in range(worker.WORKERS):
            logs.append(out / f"worker{index}.log")
            config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            with open(logs[-1], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.distribute.multiworker_worker", str(out)], cwd=REPO,
                    env={**env, "TF_CONFIG": json.dumps(config)}, stdout=log,
                    stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT_S
        initial = worker.model().get_weights()
        net, trainer = worker.compiled("plain")
        x, y = worker.data()
        history = trainer.fit(x, y, batch_size=worker.BATCH, epochs=worker.STEPS,
                              shuffle=False, verbose=0)
        expected = np.array(history.history["loss"]), net.get_weights()
        for index, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {index} still running after {TIMEOUT_S} s:\n"
                            f"{_log_tail(logs[index])}")
            if code != 0:
                pytest.fail(f"worker {index} exited with {code}:\n{_log_tail(logs[index])}")
        results = [dict(np.load(out / f"worker{i}.npz")) for i in range(worker.WORKERS)]
        return results, expected, initial
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _weights(result, prefix):
    count = len([k for k in result if k.startswith(f"{prefix}_w")])
    return [result[f"{prefix}_w{i}"] for i in range(count)]


def _assert_one_device_steps(losses, weights, expected, initial):
    expected_losses, expected_weights = expected
    assert np.all(expected_losses > 0.05)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert max(np.abs(e - i).max() for e, i in zip(expected_weights, initial)) > 1e-3
    assert len(weights) == len(expected_weights)
    # The workers' weights move as one device's do, up to float32's summation order: a
    # gathered batch sums its rows in another order, and APLoss's histogram moves a
    # similarity that rounds across a bin edge into the next bin (on one CPU 2 of 96
    # weights of the multi-stage model differed by 1.9e-6 after 3 steps). Ranking each
    # worker's shard alone moves them by a sizeable part of the update instead.
    update = max(np.abs(e - i).max() for e, i in zip(expected_weights, initial))
    for w, e in zip(weights, expected_weights):
        np.testing.assert_allclose(w, e, rtol=1e-5, atol=max(1e-6, 1e-3 * update))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the shards' "no positive pair"
def test_no_replica_shard_holds_a_positive_pair():
    x, y = worker.data()
    embeddings = worker.model()(x)
    shards = [float(APLoss()(y[r * worker.CLASSES:(r + 1) * worker.CLASSES],
                             embeddings[r * worker.CLASSES:(r + 1) * worker.CLASSES]))
              for r in range(worker.WORKERS)]
    assert shards == [0.0] * worker.WORKERS  # what per-replica ranking would give
    assert float(APLoss()(y, embeddings)) > 0.1


@pytest.mark.parametrize("scenario", worker.SCENARIOS)
def test_workers_give_the_steps_of_one_device(scenario, runs):
    results, expected, initial = runs
    for result in results:
        _assert_one_device_steps(result[f"{scenario}_losses"], _weights(result, scenario),
                                 expected, initial)


def test_keras_fit_fails_before_its_first_step_or_gives_the_one_device_steps(runs):
    """Keras 3.15's ``fit`` under this strategy reduces its peeked first batch, a tuple
    of per-replica values, which ``strategy.reduce`` refuses (keras-team/keras#20585).
    A Keras that runs it must give the one-device steps; then document ``fit``."""
    results, expected, initial = runs
    for result in results:
        if "fit_error" in result:
            message = str(result["fit_error"])
            assert "PerReplica" in message and "to a Tensor" in message, message
        else:
            _assert_one_device_steps(result["fit_losses"], _weights(result, "fit"),
                                     expected, initial)
