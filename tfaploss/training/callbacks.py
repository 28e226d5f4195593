"""The Keras callbacks of a training run, besides the batch-health check (their order
in ``tfaploss train``: :func:`tfaploss.run.trainer._train`)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import keras

from tfaploss.durable import faults
from tfaploss.durable.atomic import DiskFullError, free_bytes, is_disk_full
from tfaploss.training.health import trace_columns
from tfaploss.training.lone_queries import SHARE_KEY

__all__ = ["EmbeddingProjector", "EpochCheckpoint", "EpochLogger", "FaultPoints",
           "RetrievalEvaluation", "finite", "stop_summary"]

LOG = logging.getLogger(__name__)


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
    """What summary.json and epochs.jsonl say about the batch-health check's stop."""
    return {"by": "batch_health", "reason": record["kind"],
            **{k: record[k] for k in ("epoch", "epoch_step", "step", "images",
                                      "share_of_run", "run_images", "message")}}


def _embedder(callback):
    return callback.embedding_model if callback.embedding_model is not None else callback.model


def _as_dataset(data, labels, batch_size: int):
    """A batched dataset as is, or arrays of images (and labels) cut into batches."""
    if labels is None:
        return data
    import numpy as np

    images, labels = np.asarray(data), np.asarray(labels)
    if len(images) != len(labels):
        raise ValueError(f"RetrievalEvaluation: {len(images)} images but {len(labels)} "
                         "labels; pass one label per image.")
    return [(images[i:i + batch_size], labels[i:i + batch_size])
            for i in range(0, len(images), batch_size)]


class RetrievalEvaluation(keras.callbacks.Callback):
    """Retrieval metrics on a held-out split every ``every_n_epochs`` epochs, as logs.

    Each image queries all the others (:func:`tfaploss.evaluation.retrieval_metrics`);
    the metrics join the epoch's ``logs`` as ``<prefix><metric>`` (``val_map@r``), for
    the callbacks after this one (``EarlyStopping(monitor="val_map@r", mode="max")``).
    With ``log_dir`` also as TensorBoard scalars.

    Args:
        data, labels: the split: batches of ``(images, labels)``, or an array of images
            with its ``labels``.
        embedding_model: the model whose output are the embeddings (None: the model
            being trained).
        every_n_epochs: evaluate after every this many epochs (0: never).
        ks: the cut-offs of ``recall@K`` (below the split's size).
        searcher: a backend name of :func:`tfaploss.evaluation.build_searcher`, or a
            callable ``database -> Searcher``, built anew at each evaluation.
        prefix: what the log keys start with.
        log_dir: a folder for TensorBoard scalars, or None.
        batch_size: images per batch when ``data`` is an array.
        evaluate_fn: instead of ``data``: ``evaluate_fn(embedding_model) ->
            {metric: value}`` (what ``tfaploss train`` passes).
    """

    def __init__(self, data=None, labels=None, *, embedding_model=None,
                 every_n_epochs: int = 1, ks=(1, 10, 100), searcher="exact",
                 prefix: str = "val_", log_dir=None, batch_size: int = 64,
                 evaluate_fn: Callable[[object], dict] | None = None):
        super().__init__()
        if (data is None) == (evaluate_fn is None):
            raise ValueError("RetrievalEvaluation needs the split to evaluate on (data, "
                             "and labels for an array of images) or an evaluate_fn, "
                             "not both.")
        if int(every_n_epochs) < 0:
            raise ValueError(f"every_n_epochs must be >= 0; received {every_n_epochs}.")
        self.data = _as_dataset(data, labels, batch_size) if data is not None else None
        self.embedding_model = embedding_model
        self.every_n_epochs = int(every_n_epochs)
        self.ks = tuple(int(k) for k in ks)
        self.searcher = searcher
        self.prefix = prefix
        self.log_dir = None if log_dir is None else str(log_dir)
        self.evaluate_fn = evaluate_fn
        self._writer = None

    def evaluate(self) -> dict:
        """The metrics of the split now."""
        model = _embedder(self)
        if self.evaluate_fn is not None:
            return self.evaluate_fn(model)
        from tfaploss.evaluation import retrieval_metrics
        from tfaploss.evaluation.embed import embed_dataset

        embeddings, labels, _ = embed_dataset(model, self.data, verbose=0)
        if labels is None:
            raise ValueError("RetrievalEvaluation: the split's elements hold no labels; "
                             "pass (images, labels) pairs.")
        ks = [k for k in self.ks if k < len(labels)] or [1]
        if isinstance(self.searcher, str):
            return retrieval_metrics(embeddings, labels, ks=ks, backend=self.searcher)
        return retrieval_metrics(embeddings, labels, ks=ks,
                                 searcher=self.searcher(embeddings))

    def on_epoch_end(self, epoch, logs=None):
        every = self.every_n_epochs
        if not every or (epoch + 1) % every:
            return
        metrics = {f"{self.prefix}{k}": float(v) for k, v in self.evaluate().items()}
        if logs is not None:
            logs.update(metrics)
        if self.log_dir is not None:
            self._write_scalars(metrics, epoch + 1)

    def _write_scalars(self, metrics: dict, step: int) -> None:
        try:
            import tensorflow as tf
        except ImportError:
            LOG.warning("RetrievalEvaluation: log_dir needs TensorFlow's tf.summary, "
                        "which is not installed; the metrics are in the logs only.")
            self.log_dir = None
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        with self._writer.as_default(step=step):
            for key, value in metrics.items():
                # TensorBoard's tag names take no "@".
                tf.summary.scalar(key.replace("@", "_at_"), value)
        self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class EmbeddingProjector(keras.callbacks.Callback):
    """Export a split's embeddings for TensorBoard's projector into ``log_dir`` at the
    end of training, and every ``every_n_epochs`` epochs when set. ``data``,
    ``labels``, ``batch_size``, ``embedding_model``: as for :class:`RetrievalEvaluation`;
    ``max_images``: at most this many (the projector handles ~10^5 points).

    Example: ``callbacks=[EmbeddingProjector("logs/projector", test_ds)]``.
    """

    def __init__(self, log_dir, data, labels=None, *, embedding_model=None,
                 every_n_epochs: int = 0, max_images: int | None = 10_000,
                 batch_size: int = 64):
        super().__init__()
        self.log_dir = Path(log_dir)
        self.data = _as_dataset(data, labels, batch_size)
        self.embedding_model = embedding_model
        self.every_n_epochs = int(every_n_epochs)
        self.max_images = max_images

    def export(self) -> Path:
        """Embed the split and write the projector files now; their config's path."""
        from tfaploss.evaluation.embed import embed_dataset
        from tfaploss.evaluation.projector import export_projector

        embeddings, labels, _ = embed_dataset(_embedder(self), self.data, verbose=0)
        if self.max_images:
            embeddings = embeddings[:self.max_images]
            labels = None if labels is None else labels[:self.max_images]
        return export_projector(embeddings, labels, self.log_dir)

    def on_epoch_end(self, epoch, logs=None):
        if self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0:
            self.export()

    def on_train_end(self, logs=None):
        self.export()


class EpochLogger(keras.callbacks.Callback):
    """Append each finished epoch's logs to the JSON-lines file ``path``, fsynced.

    A row is ``{"epoch": E, "learning_rate": ..., <every numeric log>}``, with
    ``lone_query_share`` (null when not counted) and, with a ``health_monitor``, what
    it reported (``health``, ``stopped_early``) and saw per step (``health_steps``).
    Non-finite values are written as null: the file is strict JSON.
    """

    def __init__(self, path: str | os.PathLike, health_monitor=None):
        super().__init__()
        self.path = Path(path)
        self.health_monitor = health_monitor
        self._reported = self._traced = 0  # monitor records and trace rows written

    def on_epoch_end(self, epoch, logs=None):
        row = {"epoch": epoch + 1}
        opt = self.model.optimizer
        # a wrapped optimizer may have no scalar learning rate
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            row["learning_rate"] = float(keras.ops.convert_to_numpy(opt.learning_rate))
        row.update({k: float(v) for k, v in (logs or {}).items()
                    if isinstance(v, (int, float)) or hasattr(v, "__float__")})
        # NaN (no query counted) becomes null below; absent: no LoneQueryShare compiled.
        row.setdefault(SHARE_KEY, None)
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
    """Checkpoint model and optimizer into ``backup`` (a
    :class:`~tfaploss.durable.checkpoints.RunBackup`) after every epoch; a non-finite
    loss or weight raises :class:`~tfaploss.training.guards.NonFiniteTrainingError`."""

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
    """The fault points ``batch:E:B`` and ``nan_weights:E:B`` of the crash tests (add
    it only when :func:`~tfaploss.durable.faults.active`)."""

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1

    def on_train_batch_end(self, batch, logs=None):
        if faults.requested("nan_weights", self._epoch, batch + 1):
            v = self.model.trainable_weights[0]
            v.assign(keras.ops.full(v.shape, float("nan"), v.dtype))
        faults.point("batch", self._epoch, batch + 1)
