"""Supervised contrastive loss (Khosla et al., NeurIPS 2020)."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses._checks import positive_number
from tfaploss.losses.base import RetrievalLoss
from tfaploss.ops.masks import masked_logsumexp, masked_mean


@keras.saving.register_keras_serializable(package="tfaploss")
class SupConLoss(RetrievalLoss):
    """Supervised contrastive loss, L_out (Khosla, Teterwak, Wang, Sarna, Tian, Isola,
    Maschinot, Liu, Krishnan, "Supervised Contrastive Learning", NeurIPS 2020), as
    pytorch-metric-learning computes it. With cosine scores ``s_ij``, temperature ``t``,
    positives ``P_i`` (same label, not i) and ``A_i`` every other item of the batch::

        l_i = -1/|P_i| · sum_{p in P_i} [ s_ip / t - log sum_{a in A_i} exp(s_ia / t) ]

    averaged over the queries with a positive (pytorch-metric-learning's
    ``AvgNonZeroReducer``); a batch without a positive or a negative pair gives 0.

    Cost: O(B²·D) for the scores, O(B²) time and memory.

    Args:
        temperature: the softmax temperature (> 0; pytorch-metric-learning's and the
            paper's ImageNet runs' 0.1).
{shared_args}
    """

    unused_args = ("drop_lone_queries",)  # a query without a positive has no term

    def __init__(self, temperature=0.1, *, name="supcon_loss", **kwargs):
        super().__init__(name=name, **kwargs)
        self.temperature = positive_number(type(self).__name__, "temperature", temperature)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        others = self.without_self_pairs(candidates, self_pairs)
        pos = ops.logical_and(self.without_self_pairs(positives, self_pairs), others)
        logits = scores / self.temperature
        log_prob = logits - ops.expand_dims(masked_logsumexp(logits, others), -1)
        values = -masked_mean(log_prob, pos, axis=-1)
        # pytorch-metric-learning: no term at all in a batch without a negative pair
        negatives = ops.any(ops.logical_and(others, ops.logical_not(positives)))
        return values, ops.cast(ops.logical_and(ops.any(pos, axis=-1), negatives),
                                values.dtype)
