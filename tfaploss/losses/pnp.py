"""PNP loss (Li et al., "Rethinking the Optimization of Average Precision: Only
Penalizing Negative Instances before Positive Ones is Enough", AAAI 2022)."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses.base import RetrievalLoss
from tfaploss.ops.smooth_rank import PNP_VARIANTS, pnp_per_query


@keras.saving.register_keras_serializable(package="tfaploss")
class PNPLoss(RetrievalLoss):
    """PNP: penalise only the negatives ranked above each positive.

    For query i and each positive k (the query's own term k = i included by default,
    as in the authors' code):

        R_ik = sum_{j in N_i} sigmoid(clip((s_ij - s_ik) / temperature, -50, 50))
        L = mean_{i with another positive} mean_{k in P_i} f(R_ik)

    with ``f`` per ``variant``: ``"O"`` R; ``"Iu"`` (1+R)·ln(1+R);
    ``"Ib"`` (bR - ln(1+bR))/b²; ``"Ds"`` ln(1+R); ``"Dq"`` 1 - (1+R)^-alpha (the
    paper's best, SOP 80.1 R@1). Queries whose class has no other member in the batch
    are left out by default (``drop_lone_queries=True``: the original drops them
    too); labels need not be contiguous or equally sized.

    Cost: O(B·m·B) time (m = largest class; only positive pairs are ranked),
    O(chunk·B + B²) memory with chunk = ``pairs_per_block`` (default ~4M/B pairs);
    never a B×B×B tensor, and it compiles under XLA.

    Args:
        variant: one of ``"O", "Iu", "Ib", "Ds", "Dq"``.
        b: slope of the ``"Ib"`` penalty.
        alpha: exponent of the ``"Dq"`` penalty.
        temperature: sigmoid temperature.
        include_self: include the query's own term (k = i).
        normalize, pairs_per_block: as for :class:`~tfaploss.losses.SmoothAPLoss`.
        drop_lone_queries: see ``RetrievalLoss`` (default True here, as the original).
    """

    def __init__(self, variant="Dq", b=2.0, alpha=4.0, temperature=0.01, include_self=True,
                 normalize=True, pairs_per_block=None, reduction="sum_over_batch_size",
                 name="pnp_loss", dtype=None, drop_lone_queries=True):
        super().__init__(normalize=normalize, include_self=include_self,
                         reduction=reduction, name=name, dtype=dtype,
                         drop_lone_queries=drop_lone_queries)
        if variant not in PNP_VARIANTS:
            raise ValueError(f"PNPLoss: variant must be one of {PNP_VARIANTS}; received "
                             f"{variant!r}.")
        for arg, value in (("b", b), ("alpha", alpha), ("temperature", temperature)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"PNPLoss: {arg} must be > 0; received {value!r}.")
        self.variant = variant
        self.b, self.alpha, self.temperature = float(b), float(alpha), float(temperature)
        self.pairs_per_block = pairs_per_block

    def per_query(self, scores, positives, candidates, self_pairs=None):
        values, counts = pnp_per_query(scores, positives, candidates, self.variant, self.b,
                                       self.alpha, self.temperature, self.pairs_per_block)
        return values, ops.cast(counts > 0, values.dtype)

    def get_config(self):
        config = super().get_config()
        config.update(variant=self.variant, b=self.b, alpha=self.alpha,
                      temperature=self.temperature, pairs_per_block=self.pairs_per_block)
        return config
