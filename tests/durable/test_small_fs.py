"""A checkpoint and a run's JSON files on a real full file system (a 1 MB tmpfs; the
test is skipped where it cannot be mounted): one DiskFullError naming the file, no
temporary file, the previous file intact; once space is freed the same write succeeds.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

from tests.support import small_fs
from tfaploss.durable.atomic import DiskFullError, atomic_write_json, is_temp_name
from tfaploss.durable.checkpoints import RunBackup


def _model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((256,)), keras.layers.Dense(256)])  # 257 KB


def test_a_checkpoint_and_a_summary_on_a_full_tmpfs(tmp_path):
    with small_fs.mounted(tmp_path / "small", "1m") as mnt:
        atomic_write_json(mnt / "summary.json", {"epochs": 1})
        filler = small_fs.fill(mnt, keep=128 * 1024)
        backup, model = RunBackup(mnt / "backup"), _model(0)
        # The first checkpoint: refused before h5py writes (its size estimated from
        # the weights), since HDF5 can die by a signal when the disk fills mid-save.
        with pytest.raises(DiskFullError, match="epoch-0001.weights.h5") as err:
            backup.save(model, 1)
        assert err.value.needed > 257 * 1024 and err.value.free <= 128 * 1024
        # A write the kernel stops with ENOSPC.
        with pytest.raises(DiskFullError, match="summary.json"):
            atomic_write_json(mnt / "summary.json", {"x": "y" * 300_000})
        names = [p.name for p in mnt.rglob("*")]
        assert not any(is_temp_name(n) for n in names), names
        assert "epoch-0001.weights.h5" not in names
        assert json.loads((mnt / "summary.json").read_text()) == {"epochs": 1}

        filler.unlink()  # space freed: the same writes succeed
        path = backup.save(model, 1)
        atomic_write_json(mnt / "summary.json", {"x": "y" * 300_000})
        again = _model(1)
        again.load_weights(path)
        for a, b in zip(model.weights, again.weights):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Run in a child process: before the fix, the failed write's HDF5 file killed the
# process by SIGSEGV at exit, which would take a test worker with it.
_CUT_WRITES = r"""
import json, os, sys
import keras
from tfaploss.durable import faults
from tfaploss.durable.atomic import DiskFullError, atomic_write
from tfaploss.durable.checkpoints import RunBackup

mnt, keeps = sys.argv[1], [int(k) for k in sys.argv[2].split(",")]
faults.arm("no_space_check")  # the write itself runs out of space
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256),
                          keras.layers.Dense(256)])
model.compile(optimizer="adam", loss="mse")
model.optimizer.build(model.trainable_variables)

def save(what):
    if what == "weights":
        return RunBackup(os.path.join(mnt, "backup")).save(model, 1)
    import keras.src.saving.saving_lib as saving_lib  # the save's two ways
    saving_lib.is_memory_sufficient = lambda m: what == "keras"
    return atomic_write(os.path.join(mnt, "model.keras"), model.save)

def on_mount():
    return sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                  if os.path.realpath(f"/proc/self/fd/{fd}").startswith(mnt + "/"))

for what in ("weights", "keras", "keras_disk"):
    for keep in keeps:
        stat = os.statvfs(mnt)
        with open(os.path.join(mnt, "filler"), "wb") as f:
            f.write(b"\0" * max(stat.f_bavail * stat.f_frsize - keep, 0))
        try:
            save(what)
            error = None
        except DiskFullError as err:
            error = err.path
        files = sorted(os.path.relpath(os.path.join(d, n), mnt)
                       for d, _, names in os.walk(mnt) for n in names)
        os.remove(os.path.join(mnt, "filler"))
        print(json.dumps([what, keep, error, files, on_mount()]), flush=True)
    if what != "keras_disk":  # which holds two copies: more than 2 MB
        written = save(what)  # space freed: the same write succeeds
        print(json.dumps([what, "freed", os.path.getsize(written)]), flush=True)
    for d, _, names in os.walk(mnt):
        for n in names:
            os.remove(os.path.join(d, n))
"""


def test_hdf5_and_zip_writes_cut_by_a_full_tmpfs_leave_nothing_open(tmp_path):
    import os
    import subprocess
    import sys

    keeps = [0, 16 << 10, 256 << 10, 1 << 20]  # before, in, late in the HDF5 / zip
    with small_fs.mounted(tmp_path / "small", "2m") as mnt:
        done = subprocess.run(
            [sys.executable, "-c", _CUT_WRITES, str(mnt), ",".join(map(str, keeps))],
            capture_output=True, text=True, timeout=300, check=False,
            env={**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3",
                 "CUDA_VISIBLE_DEVICES": ""})
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
        for word in ("Traceback", "Exception ignored", "RuntimeError", "errno = 28"):
            assert word not in done.stderr, done.stderr[-3000:]
        rows = [json.loads(line) for line in done.stdout.splitlines()]
        cut = [r for r in rows if r[1] != "freed"]
        assert len(cut) == 3 * len(keeps), rows
        for what, keep, error, files, still_open in cut:
            name = "epoch-0001.weights.h5" if what == "weights" else "model.keras"
            assert error is not None and error.endswith(name), (what, keep, error)
            assert files == ["filler"], (what, keep, files)  # no temporary, no leftover
            assert still_open == [], (what, keep, still_open)
        freed = {r[0]: r[2] for r in rows if r[1] == "freed"}
        assert freed["weights"] > 1.5e6 and freed["keras"] > 1.5e6, freed
