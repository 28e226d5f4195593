"""Training: multi-staged backpropagation for very large batches, cross-batch memory,
the BatchNorm freezing that makes both exact, batch-health metrics with a callback
that warns when a run has collapsed or stalled, and the lone-query metric with its
callback (:mod:`tfaploss.training.lone_queries`)."""

# Re-exported from their homes (models.batch_norm, tfaploss.losses.xbm): the names
# users train with, importable from the package that trains.
from tfaploss.losses.xbm import CrossBatchMemory
from tfaploss.models.batch_norm import (
    FrozenBatchNormalization,
    freeze_batch_norm,
    has_training_batch_norm,
)
from tfaploss.training.checks import (
    NondeterministicModelWarning,
    check_deterministic,
    find_nondeterministic_layers,
)
from tfaploss.training.health import (
    BatchHealthMetric,
    TrainingHealthMonitor,
    TrainingHealthWarning,
    batch_health,
    health_metrics,
)
from tfaploss.training.lone_queries import LoneQueryMonitor, LoneQueryShare
from tfaploss.training.multistage import MultiStageModel

__all__ = [
    "BatchHealthMetric",
    "CrossBatchMemory",
    "FrozenBatchNormalization",
    "LoneQueryMonitor",
    "LoneQueryShare",
    "MultiStageModel",
    "NondeterministicModelWarning",
    "TrainingHealthMonitor",
    "TrainingHealthWarning",
    "batch_health",
    "check_deterministic",
    "find_nondeterministic_layers",
    "freeze_batch_norm",
    "has_training_batch_norm",
    "health_metrics",
]
