"""Batch health: notice a run that has collapsed or stopped learning, and say why.

The batch statistics as Keras metrics (``metrics``), the callback that judges them by
rules written as data (``monitor``, ``rules``), and what it saw per step with
:func:`replay` over such a log (``trace``). The thresholds are
:class:`tfaploss.config.health.HealthThresholds`; their use and measurements,
``docs/health.md``.
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
