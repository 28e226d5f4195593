"""The callback that turns a preemption signal into a step checkpoint and a clean stop."""

from __future__ import annotations

import logging
import os
import signal

import keras

from tfaploss.durable import faults
from tfaploss.durable.preemption import Preempted

__all__ = ["PreemptionCheckpoint"]

LOG = logging.getLogger(__name__)


class PreemptionCheckpoint(keras.callbacks.Callback):
    """At the end of each batch, when ``flag`` (a
    :class:`~tfaploss.durable.preemption.SignalFlag`) holds a signal, save a step
    checkpoint into ``backup`` (:meth:`~tfaploss.durable.checkpoints.RunBackup.save_step`)
    and raise :class:`~tfaploss.durable.preemption.Preempted`. A signal in an epoch's
    last batch or evaluation is handled at the epoch's end, whose checkpoint serves: put
    it after :class:`~tfaploss.training.callbacks.EpochCheckpoint`. ``step_offset``:
    batches of the first epoch done before this ``fit`` (the caller sets it back to 0
    for the next).
    """

    def __init__(self, flag, backup, steps_per_epoch: int, step_offset: int = 0):
        super().__init__()
        self.flag = flag
        self.backup = backup
        self.steps_per_epoch = steps_per_epoch
        self.step_offset = step_offset
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step = self.step_offset + batch + 1
        if faults.active():
            for name, signum in (("sigterm", signal.SIGTERM), ("sigint", signal.SIGINT)):
                if faults.requested(name, self._epoch + 1, step):
                    os.kill(os.getpid(), signum)
        if self.flag.signum is None or step >= self.steps_per_epoch:
            return
        from tfaploss.training.guards import check_finite_weights, sync_state

        sync_state(self.model)  # mid-epoch on JAX: the variables are empty until synced
        name = signal.Signals(self.flag.signum).name
        LOG.warning("%s received: saving a checkpoint after step %d of epoch %d", name,
                    step, self._epoch + 1)
        check_finite_weights(self.model, "the step checkpoint")  # non-finite: no save
        path = self.backup.save_step(self.model, self._epoch + 1, step, extra={
            "updates": int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))})
        raise Preempted(self.flag.signum, self._epoch, step, path,
                        self.flag.seconds_since())

    def on_epoch_end(self, epoch, logs=None):
        if self.flag.signum is not None:
            raise Preempted(self.flag.signum, epoch + 1, 0,
                            self.backup.checkpoint_path(epoch + 1),
                            self.flag.seconds_since())
