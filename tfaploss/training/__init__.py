"""Training: multi-staged backpropagation for very large batches."""

from tfaploss.training.batch_norm import FrozenBatchNormalization, freeze_batch_norm

__all__ = ["FrozenBatchNormalization", "freeze_batch_norm"]
