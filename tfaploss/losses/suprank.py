"""SupRank's Recall@k and NDCG surrogates (Ramzi et al., "Optimization of Rank Losses
for Image Retrieval", IEEE TPAMI 2025, arXiv:2309.08250).

Both rank every relevant item ``k`` of a query ``i`` with SupRank's step-rank upper
bound (the one of :class:`~tfaploss.losses.SupAPLoss`): items at least as relevant as
``k`` enter through the true step ``[s_ij >= s_ik]`` (no gradient), less relevant ones
through :class:`~tfaploss.ops.smooth_rank.SupAPUpperStep`,

    rank(i,k) = 1 + sum_{j != k, rel_j >= rel_k} [s_ij - s_ik >= 0]
                  + sum_{j, rel_j < rel_k} H-(s_ij - s_ik),

computed by :func:`tfaploss.ops.smooth_rank.positive_rank_terms`.

Provenance: github.com/elias-ramzi/SupRank at commit
d3d0e3cbceee3e8f295fd411daecbe33c1b881bb: ``suprank/losses/ranking_loss.py``,
``suprank/losses/tools/differentiable_rank.py`` and ``suprank/config/loss/*.yaml``.
Their classes default to ``offset=None`` and SupRecallLoss has no default ``at_k``; our
defaults are their shipped SOP configs (``suprecall.yaml``, ``supndcg.yaml``, the ones
the paper ran); iNaturalist (``*_inat.yaml``): ``start=0.0, offset=1.0``. Goldens:
``tests/goldens/suprank.json``.
"""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses._checks import positive_ints, positive_number
from tfaploss.losses.base import RetrievalLoss
from tfaploss.losses.smooth_ap import UpperStepArgs
from tfaploss.ops.backend import dim
from tfaploss.ops.smooth_rank import HeavisideStep, positive_rank_terms, sigmoid_tau

# The authors' SOP configs (module docstring).
_TAU, _RHO, _DELTA, _START, _OFFSET = 0.01, 100.0, 0.05, 0.5, 1.44
_AT_K = (1, 2, 4, 8, 16)


class _SupRankLoss(UpperStepArgs, RetrievalLoss):
    """Constructor and ranks common to the SupRank surrogates."""

    def __init__(self, temperature=_TAU, rho=_RHO, delta=_DELTA, start=_START,
                 offset=_OFFSET, include_self=True, pairs_per_block=None, **kwargs):
        super().__init__(include_self=include_self, **kwargs)
        self._upper = self._keep_upper_step(temperature, rho, delta, start, offset,
                                            pairs_per_block)

    def _ranks(self, scores, relevant, candidates):
        """SupRank's rank of every relevant pair (Q, N); 1 off the relevant pairs."""
        pos_above, neg_above = positive_rank_terms(scores, relevant, candidates,
                                                   HeavisideStep(), self._upper,
                                                   self.pairs_per_block)
        return 1.0 + pos_above + neg_above


@keras.saving.register_keras_serializable(package="tfaploss")
class SupRecallLoss(_SupRankLoss):
    """SupRank's surrogate of Recall@k, "SupRecall" (Ramzi, Audebert, Rambour, Araujo,
    Bitot, Thome, "Optimization of Rank Losses for Image Retrieval", IEEE TPAMI 2025,
    arXiv:2309.08250). For query i with positives P_i (the query itself included by default) and the
    SupRank rank of each positive (module docstring),

        R@k_i = sum_{p in P_i} sigmoid(clip((k - rank(i,p)) / recall_temperature,
                                            -50, 50)) / min(|P_i|, k)
        L = 1 - mean_i mean_{k in at_k} R@k_i

    as the authors' ``compute_recall_loss`` (``temp`` = ``recall_temperature``). A
    perfect ranking does not reach L = 0 (a positive at rank k counts 1/2 for R@k): 3
    positives ranked first, far above the negatives, give L = 0.102. Defaults: the
    authors' ``suprecall.yaml`` (module docstring); ``suprecall_at_10.yaml`` uses
    ``at_k=(10,)``. Unlike the original (which reshapes the positives' ranks to
    (B, -1)), classes may have any size, singletons included.

    Cost: O(B·m·B) time (m = largest class in the batch) and O(pairs_per_block·B + B²)
    memory, forward and backward (measurements: ``docs/losses.md``).

    Args:
        at_k: the ks of Recall@k, positive ints (a list or tuple).
        recall_temperature: temperature of the sigmoid of ``k - rank`` (``temp``).
{shared_args}
    """

    def __init__(self, at_k=_AT_K, recall_temperature=1.0, *args, name="sup_recall_loss",
                 **kwargs):
        super().__init__(*args, name=name, **kwargs)
        self.at_k = positive_ints("SupRecallLoss", "at_k", at_k)
        self.recall_temperature = positive_number("SupRecallLoss", "recall_temperature",
                                                  recall_temperature)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        positives = ops.logical_and(positives, candidates)
        counts = ops.sum(ops.cast(positives, "int32"), axis=1)
        rank = self._ranks(scores, positives, candidates)
        num_pos = ops.cast(counts, scores.dtype)
        zeros = ops.zeros_like(rank)
        recall = ops.zeros_like(num_pos)
        for k in self.at_k:  # a handful of static ks, not a loop over the batch
            hits = ops.where(positives, sigmoid_tau(k - rank, self.recall_temperature), zeros)
            recall = recall + ops.sum(hits, axis=1) / ops.maximum(
                ops.minimum(num_pos, float(k)), 1.0)
        recall = recall / float(len(self.at_k))
        return 1.0 - recall, ops.cast(counts > 0, recall.dtype)


@keras.saving.register_keras_serializable(package="tfaploss")
class SupNDCGLoss(_SupRankLoss):
    """SupRank's surrogate of NDCG, "SupNDCG" (Ramzi, Audebert, Rambour, Araujo, Bitot,
    Thome, "Optimization of Rank Losses for Image Retrieval", IEEE TPAMI 2025,
    arXiv:2309.08250). For query i with relevances rel_ij (1 for the positives, the
    query itself included by default, 0 otherwise) and the SupRank rank of every
    relevant item (module docstring),

        DCG_i  = sum_{j: rel_ij > 0} (2^rel_ij - 1) / log2(1 + rank(i,j))
        IDCG_i = sum_{j: rel_ij > 0} (2^rel_ij - 1) / log2(1 + ideal rank of j)
        L = 1 - mean_i DCG_i / IDCG_i

    (ideal ranks: relevances in decreasing order), as the authors'
    ``compute_ndcg_loss``. With class labels every positive has gain 1. This class
    takes one label level; the authors' graded ``hierarchy_level: MULTI`` variant
    (rel_ij = levels shared) only needs another ``_relevance`` hook (the rank is then
    computed once per level). Defaults: the authors' ``supndcg.yaml`` (module
    docstring). The original computes IDCG in float32; here it is in the loss's dtype.

    Cost: O(B·m·B) time (m = largest class; times the relevance levels) and
    O(pairs_per_block·B + B²) memory, forward and backward (measurements:
    ``docs/losses.md``).

    Args:
{shared_args}
    """

    def __init__(self, *args, name="sup_ndcg_loss", **kwargs):
        super().__init__(*args, name=name, **kwargs)

    def _relevance(self, positives, candidates, dtype):
        """(Q, N) relevances (0: not relevant) and their distinct positive levels."""
        relevant = ops.logical_and(positives, candidates)
        return ops.cast(relevant, dtype), (1.0,)

    @staticmethod
    def _discount_sums(num_items, dtype):
        """``T[n] = sum_{r=1}^{n} 1 / log2(1 + r)`` for n = 0..N, shape (N + 1,)."""
        positions = ops.arange(1, num_items + 1, dtype=dtype)
        discounts = 1.0 / ops.log2(1.0 + positions)
        return ops.concatenate([ops.zeros((1,), dtype), ops.cumsum(discounts)])

    def per_query(self, scores, positives, candidates, self_pairs=None):
        dtype = scores.dtype
        relevance, levels = self._relevance(positives, candidates, dtype)
        candidates = ops.cast(candidates, "bool")
        table = self._discount_sums(dim(scores, 1), dtype)
        zeros = ops.zeros_like(scores)
        dcg = idcg = ops.zeros_like(scores[:, 0])
        for level in sorted(levels, reverse=True):  # few static levels
            gain = 2.0 ** level - 1.0
            at_level = ops.logical_and(relevance == level, candidates)
            at_least = ops.logical_and(relevance >= level, candidates)
            rank = self._ranks(scores, at_least, candidates)
            dcg = dcg + ops.sum(ops.where(at_level, gain / ops.log2(1.0 + rank), zeros),
                                axis=1)
            # Ideal order: this level's items right after all more relevant ones.
            above = ops.sum(ops.cast(relevance > level, "int32"), axis=1)
            here = ops.sum(ops.cast(at_level, "int32"), axis=1)
            idcg = idcg + gain * (ops.take(table, above + here) - ops.take(table, above))
        valid = idcg > 0
        ndcg = dcg / ops.where(valid, idcg, ops.ones_like(idcg))
        return 1.0 - ndcg, ops.cast(valid, dtype)
