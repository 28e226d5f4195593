"""A Beam job that gets SIGTERM (a cluster taking its machine back) at any moment leaves
nothing half-published: each split is its previous version or the complete new one,
no image worker outlives it, and the same command then finishes with the output of a
run that was never stopped. (SIGKILL of a worker: test_worker_kill.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import miniature as mini
from tfaploss.pipelines import folder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["--max_failure_fraction", "0.5", "--records_per_shard", "4",
        "--images_per_batch", "2", "--image_processes", "2",
        "--direct_running_mode", "in_memory"]
# The moments of the job to stop it at: the first file under the staging folder whose
# path ends so (the work list written, the first part file of the records written).
MOMENTS = ["train-batches.jsonl", ".part"]


def _records(split_dir):
    """{name: SHA-256} of a split's record files (the manifest holds timings)."""
    return {k: v for k, v in mini.snapshot(split_dir).items() if k.endswith(".tfrecord")}


def _job(argv):
    return subprocess.Popen([sys.executable, "-m", "tfaploss.pipelines.folder", *argv], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})


def _sigterm_when(proc, out, suffix, timeout=120):
    """SIGTERM ``proc`` once a file under ``out`` ends with ``suffix``; whether it was
    sent before the job ended."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        for dirpath, _, files in os.walk(out):
            if any(name.endswith(suffix) for name in files):
                proc.send_signal(signal.SIGTERM)
                proc.communicate(timeout=timeout)
                return True
        time.sleep(0.01)
    proc.communicate(timeout=timeout)
    return False


@pytest.mark.long
@pytest.mark.parametrize("moment", MOMENTS)
def test_sigterm_mid_job_publishes_nothing_half_and_the_rerun_finishes(tmp_path, moment):
    tree = mini.make_folder(str(tmp_path / "tree"), num_classes=6, per_class=12)
    out, reference = str(tmp_path / "out"), str(tmp_path / "reference")
    base = ["--input_dir", tree.root, *ARGS]
    folder.run([*base, "--output_dir", out])
    before = _records(os.path.join(out, "train"))
    changed = [*base, "--output_dir", out, "--max_side", "16"]
    folder.run([*base, "--output_dir", reference, "--max_side", "16"])
    after = _records(os.path.join(reference, "train"))
    assert after != before

    proc = _job(changed)
    sent = _sigterm_when(proc, os.path.join(out, ".incoming"), moment)
    if moment == MOMENTS[0]:
        assert sent  # a second before the first record is written: never missed
    if sent:
        assert proc.returncode == -signal.SIGTERM
    # The previous version, or (the signal raced the publish) the complete new one.
    assert _records(os.path.join(out, "train")) in (before, after)
    assert mini.processes_running_with(out) == []  # no worker outlives the job

    folder.run(changed)  # the same command: finishes, as if never stopped
    assert _records(os.path.join(out, "train")) == after
    assert ".incoming" not in os.listdir(out)
