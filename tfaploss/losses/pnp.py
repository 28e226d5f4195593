"""PNP loss (Li et al., AAAI 2022)."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses._checks import one_of, positive_number
from tfaploss.losses.base import RetrievalLoss
from tfaploss.ops.smooth_rank import PNP_VARIANTS, pnp_per_query


@keras.saving.register_keras_serializable(package="tfaploss")
class PNPLoss(RetrievalLoss):
    """PNP: penalise only the negatives ranked above each positive (Li et al.,
    "Rethinking the Optimization of Average Precision: Only Penalizing Negative
    Instances before Positive Ones is Enough", AAAI 2022). For query i and each positive
    k (the query's own term k = i included by default, as in the authors' code):

        R_ik = sum_{j in N_i} sigmoid(clip((s_ij - s_ik) / temperature, -50, 50))
        L = mean_{i with another positive} mean_{k in P_i} f(R_ik)

    with ``f`` per ``variant``: ``"O"`` R; ``"Iu"`` (1+R)·ln(1+R);
    ``"Ib"`` (bR - ln(1+bR))/b²; ``"Ds"`` ln(1+R); ``"Dq"`` 1 - (1+R)^-alpha (the
    paper's best). Lone queries are left out by default, as the original does.

    Cost: O(B·m·B) time (m = largest class), O(pairs_per_block·B + B²) memory; never a
    B×B×B tensor.

    Args:
        variant: one of ``"O", "Iu", "Ib", "Ds", "Dq"``.
        b: slope of the ``"Ib"`` penalty.
        alpha: exponent of the ``"Dq"`` penalty.
        temperature: sigmoid temperature.
{shared_args}
    """

    def __init__(self, variant="Dq", b=2.0, alpha=4.0, temperature=0.01, include_self=True,
                 pairs_per_block=None, *, name="pnp_loss", drop_lone_queries=True, **kwargs):
        super().__init__(include_self=include_self, name=name,
                         drop_lone_queries=drop_lone_queries, **kwargs)
        self.variant = one_of("PNPLoss", "variant", variant, PNP_VARIANTS)
        self.b, self.alpha, self.temperature = (
            positive_number("PNPLoss", arg, value)
            for arg, value in (("b", b), ("alpha", alpha), ("temperature", temperature)))
        self.pairs_per_block = pairs_per_block

    def per_query(self, scores, positives, candidates, self_pairs=None):
        values, counts = pnp_per_query(scores, positives, candidates, self.variant, self.b,
                                       self.alpha, self.temperature, self.pairs_per_block)
        return values, ops.cast(counts > 0, values.dtype)
