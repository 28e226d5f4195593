"""tfaploss.durable.atomic and .checkpoints: atomic files and a backup that survives any kill.

The states a kill can leave (torn temporary files, a stale, empty or corrupt index) are
built here by hand; tests/test_cli.py kills real `tfaploss train` runs at those points.
What no kill leaves (a damaged newest checkpoint) is refused, never worked around:
tests/durable/test_run_dir_damage.py has the whole class.
"""

from __future__ import annotations

import json
import shutil

import keras
import numpy as np
import pytest

from tfaploss.durable.atomic import (
    atomic_write,
    atomic_write_json,
    remove_temp_files,
    temp_name,
)
from tfaploss.durable.checkpoints import DamagedRunError, RunBackup


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def _train(model, steps):
    x = np.ones((4, 3), np.float32)
    model.fit(x, np.zeros((4, 2), np.float32), batch_size=4, epochs=steps, verbose=0)


def _state(model):
    return [np.asarray(w) for w in model.weights], int(model.optimizer.iterations)


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path):
    target = tmp_path / "summary.json"
    atomic_write_json(target, {"v": 1})

    def broken(tmp):
        with open(tmp, "w") as f:
            f.write('{"v": 2, "half')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, broken)
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temp left


def test_temp_names_keep_the_extension_and_are_cleaned_up(tmp_path):
    tmp = temp_name(tmp_path / "epoch-0002.weights.h5")
    assert tmp.name.startswith(".epoch-0002.tmp-") and tmp.name.endswith(".weights.h5")
    assert temp_name(tmp_path / "model.keras").suffix == ".keras"
    tmp.write_bytes(b"half")
    (tmp_path / "model.keras").write_bytes(b"keep")
    (tmp_path / ".hidden_but_mine").write_bytes(b"keep")
    assert remove_temp_files(tmp_path) == [tmp.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden_but_mine", "model.keras"]


def test_save_keeps_one_checkpoint_and_restore_brings_back_weights_and_optimizer(tmp_path):
    backup = RunBackup(tmp_path / "backup", log=lambda line: None)
    model = _model()
    _train(model, 3)
    backup.save(model, 1)
    _train(model, 2)
    backup.save(model, 2)
    assert sorted(p.name for p in backup.directory.iterdir()) == [
        "checkpoint.json", "epoch-0002.weights.h5"]
    weights, iterations = _state(model)
    assert iterations == 5

    fresh = _model(seed=1)
    assert backup.restore(fresh) == 2
    restored, restored_iterations = _state(fresh)
    assert restored_iterations == 5
    for a, b in zip(weights, restored):
        np.testing.assert_array_equal(a, b)


@pytest.fixture
def two_checkpoints(tmp_path):
    """epoch-0001 and epoch-0002 both on disk, the index naming epoch 2 (what a kill
    between recording checkpoint 2 and deleting checkpoint 1 leaves)."""
    lines = []
    backup = RunBackup(tmp_path / "backup", log=lines.append)
    model = _model()
    _train(model, 1)
    backup.save(model, 1)
    kept = tmp_path / "epoch-0001.weights.h5"
    shutil.copy(backup.checkpoint_path(1), kept)
    _train(model, 1)
    backup.save(model, 2)
    shutil.copy(kept, backup.checkpoint_path(1))
    return backup, lines


def test_a_damaged_newest_checkpoint_is_refused_naming_the_way_back(two_checkpoints):
    """Not a silent fall-back to the older checkpoint: the error names the damaged file
    and how to resume from the older one; done so, it resumes from it."""
    backup, _ = two_checkpoints
    path = backup.checkpoint_path(2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedRunError) as err:
        backup.find()
    assert err.value.path == path and "SHA-256" in str(err.value)
    assert "epoch-0001.weights.h5 (after epoch 1" in str(err.value)
    assert "--restart" in str(err.value)
    assert path.read_bytes() == bytes(data)  # nothing changed
    path.unlink()
    backup.index_path.unlink()
    assert backup.find() == (1, backup.checkpoint_path(1))


def test_a_stale_or_empty_index_trusts_the_complete_files(two_checkpoints):
    backup, lines = two_checkpoints
    # Stale: a kill after checkpoint 2 was renamed into place, before the index was.
    index = json.loads(backup.index_path.read_text())
    index["latest"].update(epoch=1, file="epoch-0001.weights.h5",
                           bytes=backup.checkpoint_path(1).stat().st_size,
                           sha256="0" * 64)
    backup.index_path.write_text(json.dumps(index))
    assert backup.find()[0] == 2
    assert any("stale" in line for line in lines)
    # Empty, as a crash on a file system without ordered writes can leave it.
    backup.index_path.write_bytes(b"")
    lines.clear()
    assert backup.find()[0] == 2
    assert any("unreadable (0 bytes" in line for line in lines)


def test_a_torn_checkpoint_no_index_names_is_refused(two_checkpoints):
    """Checkpoints are renamed into place complete: a torn one under its final name is
    damage, not a kill's leftover."""
    backup, _ = two_checkpoints
    data = backup.checkpoint_path(2).read_bytes()
    backup.checkpoint_path(3).write_bytes(data[: len(data) // 2])
    with pytest.raises(DamagedRunError, match=r"epoch-0003.weights.h5 is not a readable "
                                              r"checkpoint.*epoch-0002.weights.h5"):
        backup.find()


def test_no_usable_checkpoint_means_a_fresh_start(tmp_path):
    lines = []
    backup = RunBackup(tmp_path / "backup", log=lines.append)
    assert backup.find() == (0, None)  # no folder at all
    backup.directory.mkdir()
    (backup.directory / ".epoch-0001.tmp-99.weights.h5").write_bytes(b"\x89HDF")
    assert backup.find() == (0, None)
    assert not list(backup.directory.iterdir())
    assert any("removed 1 unfinished file" in line for line in lines)


def test_discard_renames_aside_first_and_leftovers_are_removed(tmp_path):
    backup = RunBackup(tmp_path / "backup", log=lambda line: None)
    model = _model()
    backup.save(model, 1)
    (tmp_path / ".backup-trash-123").mkdir()  # what a kill during a deletion leaves
    backup.discard()
    RunBackup.remove_trash(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_epoch_log_skips_and_repairs_a_line_cut_by_a_kill(tmp_path):
    from tfaploss.run.trainer import _epoch_rows, _repair_epoch_log

    log = tmp_path / "epochs.jsonl"
    log.write_text('{"epoch": 1, "loss": 0.5}\n{"epoch": 2, "lo')
    assert _epoch_rows(log, 3) == [{"epoch": 1, "loss": 0.5}]
    _repair_epoch_log(log)
    with open(log, "a") as f:
        f.write('{"epoch": 2, "loss": 0.4}\n')
    assert [r["epoch"] for r in _epoch_rows(log, 3)] == [1, 2]
    # A resumed run repeats the epoch a kill interrupted: the summary keeps its last row.
    with open(log, "a") as f:
        f.write('{"epoch": 2, "loss": 0.3}\n')
    assert [r["loss"] for r in _epoch_rows(log, 3)] == [0.5, 0.3]


def test_the_summary_reads_the_epoch_log_as_a_resume_does(tmp_path):
    """A damaged line is an error naming it, not a row silently left out of the summary."""
    from tfaploss.run.trainer import _epoch_rows

    log = tmp_path / "epochs.jsonl"
    log.write_text('{"epoch": 1, "loss": 0.5}\nnot json\n{"epoch": 2, "loss": 0.4}\n')
    with pytest.raises(DamagedRunError, match="line 2: is not JSON"):
        _epoch_rows(log, 3)
