"""An image worker process killed mid-job (SIGKILL, as the OOM killer does): the job
ends with one message naming the worker, the split, shard and image, and what to rerun;
no BrokenProcessPool traceback (Beam's own report included); each split stays complete
(its previous version) or absent, never half-written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.support import miniature as mini
from tfaploss.durable import faults, locks
from tfaploss.pipelines import folder
from tfaploss.pipelines import image_workers as W

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 29 images in 8 shards of about 4, batches of 2, two image processes: a worker's
# third image is in the middle of the job.
ARGS = ["--max_failure_fraction", "0.5", "--records_per_shard", "4",
        "--images_per_batch", "2", "--image_processes", "2",
        "--direct_running_mode", "in_memory"]


@pytest.mark.slow
def test_a_killed_worker_ends_the_job_cleanly_naming_the_shard(tmp_path):
    """The job as a user runs it: one error line, exit 1, nothing written."""
    tree = mini.make_folder(str(tmp_path / "tree"))
    out = str(tmp_path / "out")
    job = subprocess.run(
        [sys.executable, "-m", "tfaploss.pipelines.folder", "--input_dir", tree.root, "--output_dir",
         out, *ARGS], cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": REPO, faults.ENV: "worker_kill:3"})
    assert job.returncode == 1, job.stderr
    assert f"{faults.ENV}=worker_kill:3: simulated SIGKILL" in job.stderr
    for word in ("Traceback", "BrokenProcessPool", "terminated abruptly", "[while running"):
        assert word not in job.stdout + job.stderr, job.stderr
    errors = [line for line in job.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, job.stderr
    error = errors[0]
    assert re.search(r"image worker process \d+ was killed by SIGKILL \(what the kernel's "
                     r"OOM killer sends", error), error
    assert re.search(r"while processing image '[^']+' of split 'train', shard \d of 8", error)
    assert "Rerun the same command" in error and "published nothing" in error
    assert f"{os.path.join(out, 'train')} was not created" in error
    # Absent, not half-written: no split, no staging folder, no lock; no worker left.
    assert os.listdir(out) == []
    assert mini.processes_running_with(out) == []


@pytest.mark.long
def test_a_killed_worker_keeps_the_previous_dataset(tmp_path):
    """In this process (the workers are forked from it, with the fault armed): the
    previous version of the split stays, byte for byte."""
    tree = mini.make_folder(str(tmp_path / "tree"))
    out = str(tmp_path / "out")
    argv = ["--input_dir", tree.root, "--output_dir", out, *ARGS]
    folder.run(argv)
    before = mini.snapshot(out)
    with faults.armed("worker_kill:2"), pytest.raises(W.WorkerDiedError) as err:
        folder.run([*argv, "--max_side", "16"])
    message = str(err.value)
    assert "was killed by SIGKILL" in message and "of split 'train', shard " in message
    assert f"{os.path.join(out, 'train')} kept its previous version" in message
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert mini.snapshot(out) == before
    assert sorted(os.listdir(out)) == ["train"]  # no .incoming, no lock file
    assert not os.path.exists(os.path.join(out, locks.LOCK_NAME))
    # The same command, with nothing armed, completes.
    assert folder.run([*argv, "--max_side", "16"])["train"]["options"]["max_side"] == 16


def test_what_a_dead_worker_was_doing_is_told():
    deaths = [{"pid": 7, "exitcode": -9, "signal": "SIGKILL", "doing": {
        "doing": "write", "split": "test", "shard": 2, "num_shards": 3,
        "file": "images-00002-of-00003.tfrecord"}},
        {"pid": 8, "exitcode": 1, "signal": None, "doing": {"doing": "idle"}}]
    text = W.describe_deaths(deaths)
    assert ("image worker process 7 was killed by SIGKILL (what the kernel's OOM killer "
            "sends when memory runs out) while writing split 'test', shard 2 of 3 "
            "(images-00002-of-00003.tfrecord)") in text
    assert "image worker process 8 exited with status 1 between tasks" in text


def test_a_long_id_still_fits_the_board(tmp_path):
    """The board slot is fixed: an id of any length is shortened, never overflows."""
    board = bytearray(W._SLOT)
    W._WORKER = {"board": board, "at": 0, "images": 0, "kill_at": 0}
    try:
        W._starting({"split": "train", "shard": 1, "num_shards": 2},
                    {"id": "\u00e9" * 5000, "path": "p" * 5000})
    finally:
        W._WORKER = None
    note = bytes(board).rstrip(b"\0")
    assert len(board) == W._SLOT and note.startswith(b'{"pid": ')
    assert json.loads(note)["shard"] == 1
