"""What the batch-health check saw at each step, as ``tfaploss train`` logs it
(``health_steps`` in each row of ``epochs.jsonl``), and :func:`replay`, which runs a
monitor with other thresholds over such a log (an example: ``docs/health.md``)."""

from __future__ import annotations

import math
import types
import warnings

from tfaploss.training.health.metrics import BatchHealthMetric
from tfaploss.training.health.monitor import (
    _ASSUMED_BATCH,
    TrainingHealthMonitor,
    TrainingHealthWarning,
)

__all__ = ["TRACE_COLUMNS", "replay", "trace_columns"]

# Columns of a step in ``TrainingHealthMonitor.trace`` and in epochs.jsonl's
# ``health_steps`` (what ``tfaploss train`` logs), in that order.
TRACE_COLUMNS = ("images", "emb_cos", "chance_ap", "loss")


def trace_columns(steps) -> dict:
    """Steps of :attr:`TrainingHealthMonitor.trace` as columns (``TRACE_COLUMNS``):
    ``{"images": [...], "emb_cos": [...], ...}``, one entry per step, values rounded
    to 6 decimals (None where the step had none)."""
    def cell(value):
        return value if value is None or isinstance(value, int) else round(value, 6)

    return {k: [cell(step[k]) for step in steps] for k in TRACE_COLUMNS}


def replay(epochs, *, total_epochs=None, steps_per_epoch=None,
           **kwargs) -> TrainingHealthMonitor:
    """Run a :class:`TrainingHealthMonitor` over a logged run, step by step as
    ``model.fit`` would have called it, and return it (``records``, ``stopped``,
    ``trace``): what a monitor with other arguments would have said about a real run.

    ``epochs``: one item per epoch, a row of a run's ``epochs.jsonl`` or its
    ``health_steps`` columns (``emb_cos`` required; ``images``, ``chance_ap``, ``loss``
    optional). ``total_epochs`` and ``steps_per_epoch``: the run's plan (default: the
    epochs given, and the longest of them). ``kwargs`` go to
    :class:`TrainingHealthMonitor`. Replay stops where the monitor stops training;
    warnings are in ``records``, not raised. Cost: O(steps) Python work.
    """
    columns = []
    for number, row in enumerate(epochs, 1):
        if not isinstance(row, dict):
            raise TypeError(f"replay: epochs[{number - 1}] must be a dict (an "
                            f"epochs.jsonl row, or its health_steps columns); received "
                            f"{type(row).__name__}")
        steps = row.get("health_steps", row)
        if not isinstance(steps, dict) or not isinstance(steps.get("emb_cos"), list):
            raise ValueError(f"replay: epochs[{number - 1}] has no per-step emb_cos list "
                             f"(rows written before tfaploss logged health_steps have "
                             f"none); received {row!r:.200}")
        columns.append(steps)
    cosine, chance = BatchHealthMetric("emb_cos"), BatchHealthMetric("chance_ap")
    has_chance = any(any(v is not None for v in c.get("chance_ap") or []) for c in columns)
    model = types.SimpleNamespace(metrics=[cosine, chance] if has_chance else [cosine],
                                  stop_training=False)
    monitor = TrainingHealthMonitor(**kwargs)
    monitor.set_model(model)
    monitor.set_params({"epochs": total_epochs or len(columns), "verbose": 0,
                        "steps": steps_per_epoch or max(len(c["emb_cos"]) for c in columns)})
    default_images = kwargs.get("batch_size") or _ASSUMED_BATCH

    def value(x):
        return math.nan if x is None else float(x)

    monitor.on_train_begin()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainingHealthWarning)
        for epoch, c in enumerate(columns):
            monitor.on_epoch_begin(epoch)
            n = len(c["emb_cos"])
            images = c.get("images") or [default_images] * n
            chances = c.get("chance_ap") or [None] * n
            losses = c.get("loss") or []
            if len(losses) != n or any(x is None for x in losses):
                losses = None
            total = 0.0
            for k in range(n):
                cosine.last.assign(value(c["emb_cos"][k]))
                cosine.images.assign(images[k])
                if has_chance:
                    chance.last.assign(value(chances[k]))
                    chance.images.assign(images[k])
                logs = {}
                if losses is not None:
                    total += losses[k]
                    logs["loss"] = total / (k + 1)
                monitor.on_train_batch_end(k, logs)
                if model.stop_training:
                    return monitor
    return monitor
