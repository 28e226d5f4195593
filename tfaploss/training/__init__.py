"""Training: multi-staged backpropagation for very large batches, cross-batch memory,
BatchNorm freezing, batch-health metrics and the lone-query metric, with the callbacks
that warn on them."""

# re-exported: the names users train with, from the package that trains
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
