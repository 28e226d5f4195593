"""The Keras callbacks of a training run, besides the batch-health check.

- :class:`RetrievalEvaluation`: retrieval metrics on a held-out split every few epochs,
  as ``val_*`` logs.
- :class:`EpochLogger`: one JSON line per finished epoch (``epochs.jsonl``), with what
  the batch-health check reported.
- :class:`EpochCheckpoint`: a crash-safe checkpoint after every epoch whose loss and
  weights are finite (:class:`~tfaploss.durable.checkpoints.RunBackup`).
- :class:`FaultPoints`: the per-batch fault points of the crash tests
  (:mod:`tfaploss.durable.faults`).

``tfaploss train`` (:mod:`tfaploss.run.trainer`) puts them in this order:
non-finite guard, faults, evaluation, health check, epoch log, TensorBoard, checkpoint
(last: it saves what every other callback has seen).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import keras

from tfaploss.durable import faults
from tfaploss.durable.atomic import DiskFullError, free_bytes, is_disk_full
from tfaploss.training.health import trace_columns

__all__ = ["EpochCheckpoint", "EpochLogger", "FaultPoints", "RetrievalEvaluation",
           "finite", "stop_summary"]


def finite(value):
    """``value`` with every non-finite float replaced by None (JSON null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def stop_summary(record: dict) -> dict:
    """What summary.json and epochs.jsonl say about a stop of the batch-health check
    (``record``: the check's record of the stop)."""
    return {"by": "batch_health", "reason": record["kind"],
            **{k: record[k] for k in ("epoch", "epoch_step", "step", "images",
                                      "share_of_run", "run_images", "message")}}


class RetrievalEvaluation(keras.callbacks.Callback):
    """Evaluate retrieval every ``every_n_epochs`` epochs; adds ``val_<metric>`` logs.

    The logs are shown by the progress bar and written by the callbacks after this one
    (TensorBoard, :class:`EpochLogger`).

    Args:
      embedding_model: the model that embeds images (not the trainer around it).
      evaluate_fn: ``evaluate_fn(embedding_model) -> {metric: value}``, e.g. a
        :func:`tfaploss.run.evaluate_split` with its config and split bound.
      every_n_epochs: evaluate after every this many epochs (0: never).

    Example::

        RetrievalEvaluation(embedding_model,
                            lambda m: evaluate_split(m, cfg, cfg.data.test), 5)
    """

    def __init__(self, embedding_model, evaluate_fn: Callable[[object], dict],
                 every_n_epochs: int = 1):
        super().__init__()
        self.embedding_model = embedding_model
        self.evaluate_fn = evaluate_fn
        self.every_n_epochs = every_n_epochs

    def on_epoch_end(self, epoch, logs=None):
        every = self.every_n_epochs
        if every and (epoch + 1) % every == 0 and logs is not None:
            metrics = self.evaluate_fn(self.embedding_model)
            logs.update({f"val_{k}": v for k, v in metrics.items()})


class EpochLogger(keras.callbacks.Callback):
    """Append each finished epoch's logs and learning rate to a JSON-lines file.

    A row is ``{"epoch": E, "learning_rate": ..., <every numeric log>}`` and, with a
    ``health_monitor``, what it reported during the epoch (``health``,
    ``stopped_early`` on the row of the epoch it stopped) and, per step, what it saw
    (``health_steps``: :func:`tfaploss.training.health.trace_columns`, what a replay of
    the run reads). Non-finite values are written as null: the file is strict JSON, and
    a NaN in it is damage to :mod:`tfaploss.durable.run_dir`. Each row is flushed and
    fsynced, so a kill loses at most the row being written.

    Args:
      path: the JSON-lines file (appended to).
      health_monitor: the run's :class:`~tfaploss.training.TrainingHealthMonitor`, or
        None.
    """

    def __init__(self, path: str | os.PathLike, health_monitor=None):
        super().__init__()
        self.path = Path(path)
        self.health_monitor = health_monitor
        self._reported = 0
        self._traced = 0

    def on_epoch_end(self, epoch, logs=None):
        row = {"epoch": epoch + 1}
        opt = self.model.optimizer
        try:
            row["learning_rate"] = float(keras.ops.convert_to_numpy(opt.learning_rate))
        except (TypeError, ValueError, AttributeError):
            pass  # a wrapped optimizer without a scalar learning rate
        row.update({k: float(v) for k, v in (logs or {}).items()
                    if isinstance(v, (int, float)) or hasattr(v, "__float__")})
        row = finite(row)
        monitor = self.health_monitor
        if monitor is not None:
            records = monitor.records[self._reported:]
            self._reported = len(monitor.records)
            if records:
                row["health"] = records
            if any(r["stop"] for r in records):
                row["stopped_early"] = stop_summary(monitor.stopped)
            row["health_steps"] = finite(trace_columns(monitor.trace[self._traced:]))
            self._traced = len(monitor.trace)
        line = json.dumps(row, allow_nan=False) + "\n"
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                faults.no_space("epochs_enospc", epoch + 1)
                os.fsync(f.fileno())
        except OSError as err:  # a full disk: a cut line is dropped when the run resumes
            if is_disk_full(err):
                raise DiskFullError(self.path, len(line.encode()),
                                    free_bytes(self.path.parent)) from None
            raise


class EpochCheckpoint(keras.callbacks.Callback):
    """Checkpoint model and optimizer after every epoch, once the epoch's loss and every
    weight are checked finite (nothing non-finite is ever checkpointed).

    Raises :class:`~tfaploss.training.guards.NonFiniteTrainingError` instead of saving
    a non-finite state. Each checkpoint records the optimizer's update count
    (``updates``).

    Args:
      backup: where the checkpoints go, a
        :class:`~tfaploss.durable.checkpoints.RunBackup`.
    """

    def __init__(self, backup):
        super().__init__()
        self.backup = backup

    def on_epoch_end(self, epoch, logs=None):
        from tfaploss.training.guards import NonFiniteTrainingError, check_finite_weights

        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            raise NonFiniteTrainingError(
                f"training stopped: the mean loss of epoch {epoch + 1} is {loss}; "
                "its checkpoint was not written.")
        check_finite_weights(self.model, f"the checkpoint of epoch {epoch + 1}")
        faults.point("epoch_end", epoch + 1)
        self.backup.save(self.model, epoch + 1, extra={
            "updates": int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))})


class FaultPoints(keras.callbacks.Callback):
    """The fault points of a batch (:mod:`tfaploss.durable.faults`), for the crash
    tests: ``batch:E:B`` exits as if killed after batch B of epoch E, and
    ``nan_weights:E:B`` puts a NaN in the first trainable weight there. Add it only
    when :func:`~tfaploss.durable.faults.active`."""

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1

    def on_train_batch_end(self, batch, logs=None):
        if faults.requested("nan_weights", self._epoch, batch + 1):
            v = self.model.trainable_weights[0]
            v.assign(keras.ops.full(v.shape, float("nan"), v.dtype))
        faults.point("batch", self._epoch, batch + 1)
