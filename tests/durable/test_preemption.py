"""tfaploss.durable.preemption and the step checkpoints of RunBackup: a signal becomes a
flag (never work inside the handler), a step checkpoint is found only after the epoch
checkpoint it follows, and what no kill leaves is refused. The end-to-end runs (a real
SIGTERM and Ctrl-C, resumed to equal weights) are in tests/run/test_preemption.py."""

from __future__ import annotations

import os
import signal
import time

import keras
import numpy as np
import pytest

from tfaploss.durable.checkpoints import DamagedRunError, RunBackup
from tfaploss.durable.preemption import Preempted, SignalFlag, exit_status


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32), verbose=0)
    return model


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_only_raises_the_flag_and_the_handlers_come_back(signum, status):
    before = signal.getsignal(signum)
    with SignalFlag() as flag:
        os.kill(os.getpid(), signum)
        assert flag.signum == signum and flag.seconds_since() >= 0
    assert signal.getsignal(signum) is before
    assert exit_status(signum) == status
    err = Preempted(signum, 1, 3, "backup/x.weights.h5", 0.2)
    assert err.status == status and "after step 3 of epoch 2" in str(err)
    assert "Run the same command again" in str(err)


def _wait_for(condition, seconds=10.0):
    # Another thread may take the signal; Python runs its handler at the main thread's
    # next check, so two quick kills can otherwise arrive as one.
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_second_ctrl_c_is_not_held_back():
    # A job started in the background (`cmd &`) inherits SIGINT ignored: give this test
    # the handler an interactive Python has, whatever started it.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with SignalFlag() as flag:
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for(lambda: flag.signum is not None)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                _wait_for(lambda: False, seconds=5.0)
    finally:
        signal.signal(signal.SIGINT, before)
    assert flag.signum == signal.SIGINT


def test_step_checkpoint_follows_its_epoch_and_an_epoch_supersedes_it(tmp_path):
    model = _model()
    backup = RunBackup(tmp_path / "backup")
    backup.save(model, 1)
    path = backup.save_step(model, 2, 3, extra={"updates": 7})
    assert backup.find() == (1, backup.checkpoint_path(1))
    assert backup.find_step(1) == (3, path)
    later = backup.save_step(model, 2, 5)  # a second preemption in the same epoch
    assert not path.exists() and backup.find_step(1) == (5, later)
    backup.save(model, 2)  # the epoch completes: its step checkpoint goes
    assert sorted(p.name for p in backup.directory.iterdir()) == [
        "checkpoint.json", "epoch-0002.weights.h5"]
    assert backup.find_step(2) == (0, None)


def test_a_step_checkpoint_a_kill_left_behind_an_epoch_is_removed(tmp_path):
    """A kill after the epoch checkpoint, before the step checkpoint was deleted."""
    model = _model()
    notes = []
    backup = RunBackup(tmp_path / "backup", log=notes.append)
    backup.save_step(model, 2, 1)
    backup.save(model, 1)
    stale = backup.save_step(model, 2, 2)
    (backup.directory / "epoch-0002.weights.h5").write_bytes(
        backup.checkpoint_path(1).read_bytes())  # as if epoch 2 had been saved
    assert backup.find_step(2) == (0, None)
    assert not stale.exists() and "supersedes" in notes[-1]


def test_a_damaged_or_orphaned_step_checkpoint_is_refused(tmp_path):
    model = _model()
    backup = RunBackup(tmp_path / "backup")
    backup.save(model, 1)
    path = backup.save_step(model, 2, 3)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DamagedRunError, match="cut short") as err:
        backup.find_step(1)
    assert "resume from the start of epoch 2" in str(err.value)
    path.write_bytes(data)
    os.replace(path, backup.step_path(4, 3))  # no checkpoint of epochs 2-3
    with pytest.raises(DamagedRunError, match="later epoch"):
        backup.find_step(1)
