"""The learning-rate schedules a run config names (``optimizer.schedule``)."""

from __future__ import annotations

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfaploss")
class RecipeSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up, then ``constant``, ``linear``, ``cosine`` or ``step`` decay.

    Steps are optimizer updates (batches; ``MultiStageModel`` counts one per batch,
    whatever the number of chunks). With ``w = warmup_steps`` and ``T = total_steps``:

    * warm-up, ``step < w``: ``lr * (step + 1) / w``;
    * ``constant``: ``lr``;
    * ``linear``: ``lr + (end_lr - lr) * t`` with ``t = (step - w) / (T - w)`` clipped to
      [0, 1] (Revaud et al.: 1e-4 to 0 over the run);
    * ``cosine``: ``end_lr + (lr - end_lr) * (1 + cos(pi t)) / 2``;
    * ``step``: ``lr * gamma ** (number of boundaries <= step)`` (PyTorch's MultiStepLR,
      boundaries in updates).
    """

    KINDS = ("constant", "linear", "cosine", "step")

    def __init__(self, kind, lr, total_steps, end_lr=0.0, warmup_steps=0, boundaries=(),
                 gamma=0.1):
        if kind not in self.KINDS:
            raise ValueError(f"RecipeSchedule: kind must be one of {self.KINDS}; received "
                             f"kind={kind!r}")
        if total_steps < 1:
            raise ValueError(f"RecipeSchedule: total_steps must be >= 1; received "
                             f"{total_steps}")
        self.kind = kind
        self.lr = float(lr)
        self.total_steps = int(total_steps)
        self.end_lr = float(end_lr)
        self.warmup_steps = int(warmup_steps)
        self.boundaries = tuple(int(b) for b in boundaries)
        self.gamma = float(gamma)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        lr = ops.convert_to_tensor(self.lr, "float32")
        span = float(max(self.total_steps - self.warmup_steps, 1))
        t = ops.clip((step - self.warmup_steps) / span, 0.0, 1.0)
        if self.kind == "constant":
            value = lr
        elif self.kind == "linear":
            value = lr + (self.end_lr - lr) * t
        elif self.kind == "cosine":
            value = self.end_lr + (lr - self.end_lr) * 0.5 * (1.0 + ops.cos(3.141592653589793 * t))
        else:
            passed = sum(ops.cast(step >= b, "float32") for b in self.boundaries) \
                if self.boundaries else 0.0
            value = lr * ops.power(self.gamma, passed)
        if self.warmup_steps > 0:
            warm = lr * (step + 1.0) / float(self.warmup_steps)
            value = ops.where(step < self.warmup_steps, warm, value)
        return value

    def get_config(self):
        return dict(kind=self.kind, lr=self.lr, total_steps=self.total_steps,
                    end_lr=self.end_lr, warmup_steps=self.warmup_steps,
                    boundaries=list(self.boundaries), gamma=self.gamma)
