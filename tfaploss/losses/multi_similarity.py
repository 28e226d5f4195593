"""Multi-similarity loss (Wang et al., CVPR 2019), with its pair miner."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses._checks import number, positive_number
from tfaploss.losses.base import RetrievalLoss
from tfaploss.ops.masks import masked_logsumexp


def hard_pairs(scores, positives, negatives, epsilon):
    """The multi-similarity miner's pairs (pytorch-metric-learning's
    ``MultiSimilarityMiner``): ``(positives, negatives)`` masks, (Q, N).

    A positive p of query a is kept when ``s_ap - epsilon < max_n s_an``, a negative n
    when ``s_an + epsilon > min_p s_ap``. O(Q·N).
    """
    inf = ops.full_like(scores, float("inf"))
    hardest_negative = ops.max(ops.where(negatives, scores, -inf), axis=-1, keepdims=True)
    hardest_positive = ops.min(ops.where(positives, scores, inf), axis=-1, keepdims=True)
    keep_positive = ops.logical_and(positives, scores - epsilon < hardest_negative)
    keep_negative = ops.logical_and(negatives, scores + epsilon > hardest_positive)
    return keep_positive, keep_negative


@keras.saving.register_keras_serializable(package="tfaploss")
class MultiSimilarityLoss(RetrievalLoss):
    """Multi-similarity loss (Wang, Han, Huang, Dong, Scott, "Multi-Similarity Loss with
    General Pair Weighting for Deep Metric Learning", CVPR 2019), as
    pytorch-metric-learning computes it. With cosine scores ``s_ij``, positives ``P_i``
    (same label, not i) and negatives ``N_i`` of query i::

        l_i = 1/alpha · log(1 + sum_{p in P_i} exp(-alpha · (s_ip - base)))
            + 1/beta  · log(1 + sum_{n in N_i} exp( beta  · (s_in - base)))

    averaged over every query (pytorch-metric-learning's ``MeanReducer``), lone ones
    included with their negative term; a batch without a positive pair gives 0.
    ``epsilon`` (not None) first keeps only the pairs of the paper's miner
    (:func:`hard_pairs`); a query left with no pair counts 0.

    Cost: O(B²·D) for the scores, O(B²) time and memory.

    Args:
        alpha: scale of the positive term (> 0; pytorch-metric-learning's default 2).
        beta: scale of the negative term (> 0; default 50).
        base: the similarity margin ``lambda`` (default 0.5).
        epsilon: the miner's margin (>= 0; the authors' SOP setting and the miner's
            default: 0.1), or None (default) for every pair.
{shared_args}
    """

    def __init__(self, alpha=2.0, beta=50.0, base=0.5, epsilon=None,
                 *, name="multi_similarity_loss", **kwargs):
        super().__init__(name=name, **kwargs)
        owner = type(self).__name__
        self.alpha = positive_number(owner, "alpha", alpha)
        self.beta = positive_number(owner, "beta", beta)
        self.base = number(owner, "base", base)
        self.epsilon = number(owner, "epsilon", epsilon, low=0, optional=True)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        pos = ops.logical_and(self.without_self_pairs(positives, self_pairs), candidates)
        neg = ops.logical_and(candidates, ops.logical_not(positives))
        if self.epsilon is not None:
            pos, neg = hard_pairs(ops.stop_gradient(scores), pos, neg, self.epsilon)
        pull = masked_logsumexp(-self.alpha * (scores - self.base), pos, add_one=True)
        push = masked_logsumexp(self.beta * (scores - self.base), neg, add_one=True)
        values = pull / self.alpha + push / self.beta
        return values, ops.ones_like(values)
