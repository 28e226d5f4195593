"""A run's batches, epoch by epoch, and ``fit`` that a preemption stops at a step.

Each epoch's batches depend on ``(data.seed, epoch)`` only (:func:`epoch_batches`), so
a run resumed at step S of epoch E skips S batches and ends with an uninterrupted
run's weights (docs/reliability.md, "Preemption").
"""

from __future__ import annotations

import logging

from tfaploss.config.schema import Config
from tfaploss.durable.preemption import Preempted, SignalFlag
from tfaploss.run import build as B
from tfaploss.run import processes

__all__ = ["epoch_batches", "fit"]

LOG = logging.getLogger(__name__)


def epoch_batches(cfg: Config, steps: int, first: int, last: int, skip: int = 0):
    """The batches of epochs ``first``..``last - 1`` (0-based), ``steps`` each, the
    first ``skip`` of epoch ``first`` left out; epoch e reads
    :func:`~tfaploss.run.build.build_train_dataset` with ``seed_offset=e`` (this rank's
    share), each epoch's pipeline starting when the previous one ends."""
    import tensorflow as tf

    ds = None
    shard = processes.current().shard()
    for epoch in range(first, last):
        part = B.build_train_dataset(cfg, seed_offset=epoch, **shard)
        part = part.skip(skip).take(steps - skip) if epoch == first else part.take(steps)
        ds = part if ds is None else ds.concatenate(part)
    return ds.prefetch(tf.data.AUTOTUNE) if ds is not None else None


def _stream(ds):
    """What ``model.fit`` reads: ``ds`` on TensorFlow; on JAX and PyTorch one iterator
    over it, since their ``fit`` takes a first batch from an iterator of its own, then
    starts another, and every new iterator reshuffles (a resumed run would train on
    other batches than an uninterrupted one)."""
    import keras

    if keras.backend.backend() == "tensorflow":
        return ds
    return (batch for batch in ds.as_numpy_iterator())


def fit(model, cfg: Config, *, steps: int, start_epoch: int, start_step: int, backup,
        callbacks: list, verbose) -> None:
    """``model.fit`` from epoch ``start_epoch`` (0-based), ``start_step`` batches of it
    done, to ``cfg.training.epochs``. A SIGTERM or SIGINT is handled at the end of its
    batch (every rank's same batch): a step checkpoint, then
    :class:`~tfaploss.durable.preemption.Preempted`. The rest of a partly trained epoch
    is one ``fit`` (Keras has no partial first epoch), the following epochs a second.
    """
    from tfaploss.training.preemption import PreemptionCheckpoint

    epochs = cfg.training.epochs
    with SignalFlag() as local:
        flag, agreement = processes.agreed_stop(local)
        guard = PreemptionCheckpoint(flag, backup, steps, step_offset=start_step)
        callbacks = [*callbacks, *agreement, guard]
        if start_step:
            LOG.info("resuming epoch %d at step %d of %d (the batches before it are "
                     "skipped)", start_epoch + 1, start_step + 1, steps)
            model.fit(_stream(epoch_batches(cfg, steps, start_epoch, start_epoch + 1,
                                            start_step)),
                      epochs=start_epoch + 1, initial_epoch=start_epoch,
                      steps_per_epoch=steps - start_step, callbacks=callbacks,
                      verbose=verbose, shuffle=False)
            start_epoch += 1
            guard.step_offset = 0
        if start_epoch < epochs and not model.stop_training:
            model.fit(_stream(epoch_batches(cfg, steps, start_epoch, epochs)), epochs=epochs,
                      initial_epoch=start_epoch, steps_per_epoch=steps,
                      callbacks=callbacks, verbose=verbose, shuffle=False)
    if flag.signum is not None:  # between the last batch end and the end of fit
        raise Preempted(flag.signum, epochs, 0, None, flag.seconds_since())
