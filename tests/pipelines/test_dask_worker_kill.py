"""The folder job on a Dask cluster whose worker is killed (SIGKILL) in the middle of the
image work: the job completes through Dask's retries (a retried task rewrites its own
part file), or fails with one message; it never publishes half an output, and the rerun
writes what the DirectRunner writes, byte for byte.

The cluster is a ``dask scheduler`` and two ``dask worker --no-nanny`` processes on
127.0.0.1 (without a nanny, a killed worker stays dead). The kill comes from here, as
soon as the job has written a part file (the image work has begun) and the scheduler
shows a worker processing a task: that worker gets SIGKILL.

Skipped when ``apache-beam[dask]`` is not installed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.pipelines.test_runners import (
    DASK_RUNNER,
    FOLDER_ARGS,
    RUN_TIMEOUT_S,
    _deadline,
    _outputs,
    needs_dask,
)
from tests.support import miniature as mini
from tfaploss.pipelines import folder
from tfaploss.pipelines import runner as R


@contextlib.contextmanager
def _cluster(folder_: str):
    """A scheduler and two worker processes; yields ``(client, {address: pid},
    {pid: process})``."""
    from dask.distributed import Client

    scheduler_file = os.path.join(folder_, "scheduler.json")
    dask = [sys.executable, "-m", "dask"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}

    def start(args, log):
        return subprocess.Popen([*dask, *args], env=env, stdout=subprocess.DEVNULL,
                                stderr=open(os.path.join(folder_, log), "w"))

    procs = [start(["scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                    "--scheduler-file", scheduler_file], "scheduler.log")]
    client = None
    try:
        deadline = time.time() + 60
        while not os.path.exists(scheduler_file):
            assert procs[0].poll() is None and time.time() < deadline, "no scheduler"
            time.sleep(0.1)
        procs += [start(["worker", "--scheduler-file", scheduler_file, "--nthreads", "1",
                         "--no-nanny", "--no-dashboard", "--host", "127.0.0.1", "--name",
                         f"w{i}"], f"worker{i}.log") for i in range(2)]
        client = Client(scheduler_file=scheduler_file, timeout=60)
        client.wait_for_workers(2, timeout=60)
        pids = client.run(os.getpid)
        yield client, pids, {p.pid: p for p in procs[1:]}
    finally:
        if client is not None:
            client.close()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def _kill_a_busy_worker(client, pids, out, killed, stop):
    """SIGKILL the first worker seen processing a task once a part file exists."""
    while not stop.is_set():
        parts = glob.glob(os.path.join(out, R.STAGING, "**", "*.part"), recursive=True)
        busy = sorted(a for a, tasks in client.processing().items() if tasks)
        if parts and busy:
            os.kill(pids[busy[0]], signal.SIGKILL)
            killed.append((pids[busy[0]], time.time()))
            return
        time.sleep(0.01)


def _job(tree, out, extra=()):
    with _deadline(RUN_TIMEOUT_S):
        return folder.run(["--input_dir", tree, "--output_dir", out, *FOLDER_ARGS, *extra])


@needs_dask
@pytest.mark.slow
def test_a_worker_killed_mid_job_never_publishes_half_and_the_rerun_matches(tmp_path):
    tree, out = str(tmp_path / "tree"), str(tmp_path / "out")
    # 90 images in 45 batches: the image work spans both workers for a while.
    mini.make_folder(tree, num_classes=3, per_class=30)
    _job(tree, str(tmp_path / "direct"))  # before any Dask client exists in this process
    want = _outputs(str(tmp_path / "direct"))
    with _cluster(str(tmp_path)) as (client, pids, workers):
        dask = ["--runner", DASK_RUNNER, "--dask_client_address", client.scheduler.address,
                "--dask_npartitions", "2"]
        killed, stop = [], threading.Event()
        killer = threading.Thread(target=_kill_a_busy_worker,
                                  args=(client, pids, out, killed, stop), daemon=True)
        killer.start()
        try:
            _job(tree, out, dask)
            failure = None
        except Exception as err:  # noqa: BLE001 - either outcome is allowed; see below
            failure = err
        finished = time.time()
        stop.set()
        killer.join(timeout=10)
        assert killed and killed[0][1] < finished, "no worker was killed during the job"
        assert workers[killed[0][0]].wait(timeout=30) == -signal.SIGKILL
        if failure is None:  # completed through Dask's retries: all of it, as Direct's
            assert _outputs(out) == want
        else:  # one message, nothing published
            assert "\n" not in str(failure).strip(), failure
            assert not {"train", "test"} & set(os.listdir(out)), os.listdir(out)
        # The rerun, on the worker left: the DirectRunner's files, byte for byte.
        _job(tree, out, dask)
        assert _outputs(out) == want
