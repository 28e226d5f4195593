"""Training: multi-staged backpropagation for very large batches, cross-batch memory,
and the BatchNorm freezing that makes both exact."""

from tfaploss.training.batch_norm import (
    FrozenBatchNormalization,
    freeze_batch_norm,
    has_training_batch_norm,
)
from tfaploss.training.checks import (
    NondeterministicModelWarning,
    check_deterministic,
    find_nondeterministic_layers,
)
from tfaploss.training.multistage import MultiStageModel
from tfaploss.training.xbm import CrossBatchMemory

__all__ = [
    "CrossBatchMemory",
    "FrozenBatchNormalization",
    "MultiStageModel",
    "NondeterministicModelWarning",
    "check_deterministic",
    "find_nondeterministic_layers",
    "freeze_batch_norm",
    "has_training_batch_norm",
]
