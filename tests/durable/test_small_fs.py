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
