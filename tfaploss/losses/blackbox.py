"""``BlackBoxAPLoss`` (Rolínek et al., CVPR 2020)."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses._checks import number, positive_number
from tfaploss.losses.base import RetrievalLoss
from tfaploss.ops.blackbox import blackbox_ap


@keras.saving.register_keras_serializable(package="tfaploss")
class BlackBoxAPLoss(RetrievalLoss):
    """Exact AP in the forward pass, black-box ranking gradient in the backward pass
    (Rolínek, Musil, Paulus, Vlastelica, Michaelis, Martius, "Optimizing Rank-based
    Metrics with Blackbox Differentiation", CVPR 2020; as in the ROADMAP repository).
    Per query (self included by default, as the ROADMAP code)::

        AP_i = sum_{k in P_i} rank+_ik / rank_ik / (|P_i| + 1e-5),  L = 1 - mean_i AP_i

    The ranks come from ``s - margin * |N(0, 1)| * (y - 0.5)`` (a stochastic margin:
    positives pushed down, negatives up, only in training; ``margin=0`` makes the
    loss deterministic). Backward: ``dL/ds = -(r - rank(s + lambda_ * dL/dr)) /
    lambda_`` with ranks normalised by the number of candidates.

    A lone query stays in the mean, as in the original. A query without negatives has
    loss exactly 0 and zero gradient (the original: ~1e-5 and a black-box gradient).

    Cost: O(B²·D) for the scores plus two sorts per row, O(B²·log B) time and O(B²)
    memory, forward and backward; no (B, B, B) tensor.

    Args:
        lambda_: interpolation strength of the black-box gradient.
        margin: scale of the stochastic margin (0 for deterministic).
        seed: seed of the margin noise (``None``: random).
{shared_args}
    """

    def __init__(self, lambda_=4.0, margin=0.02, seed=None, include_self=True,
                 *, name="blackbox_ap_loss", **kwargs):
        super().__init__(include_self=include_self, name=name, **kwargs)
        self.lambda_ = positive_number("BlackBoxAPLoss", "lambda_", lambda_)
        self.margin = number("BlackBoxAPLoss", "margin", margin, low=0)
        self.seed = seed
        self._seed_generator = keras.random.SeedGenerator(seed) if self.margin else None

    def per_query(self, scores, positives, candidates, self_pairs=None):
        noise = None
        if self.margin:
            noise = ops.abs(keras.random.normal(ops.shape(scores), dtype=scores.dtype,
                                                seed=self._seed_generator))
        ap = blackbox_ap(scores, positives, candidates, lambda_=self.lambda_,
                         margin=self.margin, noise=noise)
        weights = ops.cast(ops.any(positives, axis=-1), ap.dtype)
        # Without a negative AP is 1 whatever the order; the black-box gradient is not 0.
        has_negative = ops.any(ops.logical_and(candidates, ops.logical_not(positives)), axis=-1)
        return ops.where(has_negative, 1.0 - ap, ops.zeros_like(ap)), weights
