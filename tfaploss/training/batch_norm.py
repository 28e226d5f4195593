"""Re-export of the frozen BatchNorm, which lives in ``models.batch_norm``.

Kept so that ``tfaploss.training.freeze_batch_norm`` and
``tfaploss.training.batch_norm.FrozenBatchNormalization`` keep working; the dependency
runs from training to models.
"""

from models.batch_norm import (
    FrozenBatchNormalization,
    freeze_batch_norm,
    has_training_batch_norm,
)

__all__ = ["FrozenBatchNormalization", "freeze_batch_norm", "has_training_batch_norm"]
