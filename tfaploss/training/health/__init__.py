"""Batch health: notice a run that has collapsed or stopped learning, and say why.

Three rooms:

* :mod:`~tfaploss.training.health.metrics`: the batch statistics (``emb_cos``,
  ``emb_cos_std``, ``chance_ap``) as Keras metrics, :func:`health_metrics`;
* :mod:`~tfaploss.training.health.monitor` and :mod:`~tfaploss.training.health.rules`:
  :class:`TrainingHealthMonitor`, the callback that judges them (and the loss) by
  rules written as data, and warns (:class:`TrainingHealthWarning`) or stops;
* :mod:`~tfaploss.training.health.trace`: what the callback saw per step, as
  ``tfaploss train`` logs it, and :func:`replay` over such a log.

The thresholds are :class:`tfaploss.config.health.HealthThresholds` (``training.health``
in a run's config); the measurements behind them are in ``docs/health.md``.

Example:

>>> model.compile(optimizer="adam", loss=SupAPLoss(), metrics=health_metrics())
>>> model.fit(dataset, epochs=10, callbacks=[TrainingHealthMonitor(stop_share=0.25)])
"""

from tfaploss.config.health import HealthThresholds
from tfaploss.training.health.metrics import (
    DEFAULT_MAX_QUERIES,
    BatchHealthMetric,
    batch_health,
    chance_ap_fraction,
    cosine_stats,
    health_metrics,
    random_ranking_ap,
)
from tfaploss.training.health.monitor import TrainingHealthMonitor, TrainingHealthWarning
from tfaploss.training.health.rules import COLLAPSE_CAUSES, FLAT_CAUSES, RULES, STALL_CAUSES
from tfaploss.training.health.trace import TRACE_COLUMNS, replay, trace_columns

__all__ = ["COLLAPSE_CAUSES", "DEFAULT_MAX_QUERIES", "FLAT_CAUSES", "RULES", "STALL_CAUSES",
           "TRACE_COLUMNS", "BatchHealthMetric", "HealthThresholds", "TrainingHealthMonitor",
           "TrainingHealthWarning", "batch_health", "chance_ap_fraction", "cosine_stats",
           "health_metrics", "random_ranking_ap", "replay", "trace_columns"]
