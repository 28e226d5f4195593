"""SupRank's Recall@k and NDCG surrogates (Ramzi et al., "Optimization of Rank Losses
for Image Retrieval", IEEE TPAMI 2025, arXiv:2309.08250).

Both rank every relevant item ``k`` of a query ``i`` with SupRank's step-rank upper
bound (the one of :class:`~tfaploss.losses.SupAPLoss`): items at least as relevant as
``k`` enter through the true step ``[s_ij >= s_ik]`` (no gradient), less relevant ones
through :class:`~tfaploss.ops.smooth_rank.SupAPUpperStep`,

    rank(i,k) = 1 + sum_{j != k, rel_j >= rel_k} [s_ij - s_ik >= 0]
                  + sum_{j, rel_j < rel_k} H-(s_ij - s_ik),

computed by :func:`tfaploss.ops.smooth_rank.positive_rank_terms` (only the relevant
pairs, in blocks, with a hand-written gradient: O(B·m·B) time, never a B×B×B tensor).

Provenance: github.com/elias-ramzi/SupRank at commit
d3d0e3cbceee3e8f295fd411daecbe33c1b881bb: ``suprank/losses/ranking_loss.py``
(``SupRecallLoss``, ``SupNDCGLoss``, ``compute_recall_loss``, ``compute_ndcg_loss``),
``suprank/losses/tools/differentiable_rank.py`` (``SupRank``, ``step_rank``,
``tau_sigmoid``, ``DifferentiableRank.quick_forward``) and the loss configs
``suprank/config/loss/{suprecall,suprecall_at_10,suprecall_inat,supndcg,supndcg_inat,
ROADRatk_SOP,roadndcg_sop}.yaml``. Goldens: ``tests/goldens/suprank.json``.
"""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses._checks import positive_ints, positive_number
from tfaploss.losses.base import RetrievalLoss
from tfaploss.losses.smooth_ap import UpperStepArgs
from tfaploss.ops.backend import dim
from tfaploss.ops.smooth_rank import (
    HeavisideStep,
    positive_rank_terms,
    sigmoid_tau,
)

# Defaults of the authors' shipped SOP configs (suprank/config/loss/suprecall.yaml and
# supndcg.yaml); their classes default to offset=None and SupRecallLoss has no default at_k.
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
    arXiv:2309.08250; code github.com/elias-ramzi/SupRank, commit d3d0e3cb).

    For query i with positives P_i (the query itself included by default) and the
    SupRank rank of each positive (module docstring),

        R@k_i = sum_{p in P_i} sigmoid(clip((k - rank(i,p)) / recall_temperature,
                                            -50, 50)) / min(|P_i|, k)
        L = 1 - mean_i mean_{k in at_k} R@k_i

    as the authors' ``compute_recall_loss``: each k counts the positives whose smooth
    rank is below k with a sigmoid of temperature ``temp`` (1.0) and divides by
    ``min(|P_i|, k)``; the ks are averaged with equal weights. A perfect ranking does
    not reach L = 0 (a positive at rank k counts only 1/2 for R@k): a query with 3
    positives ranked first, far above the negatives, gives L = 0.102.

    Defaults and where they come from (SupRank at commit
    d3d0e3cbceee3e8f295fd411daecbe33c1b881bb):

    - ``temperature=0.01`` (``tau``), ``rho=100``, ``delta=0.05``, ``start=0.5``,
      ``offset=1.44``, ``at_k=(1, 2, 4, 8, 16)``, ``recall_temperature=1.0`` (``temp``):
      ``suprank/config/loss/suprecall.yaml`` and ``ROADRatk_SOP.yaml`` (SOP). The class
      (``SupRecallLoss`` in ``suprank/losses/ranking_loss.py`` with ``SupRank`` in
      ``suprank/losses/tools/differentiable_rank.py``) defaults to ``offset=None`` (the
      continuous ``start + sigmoid(delta / tau)``) and has no default ``at_k``; the
      configs are what the paper ran, so they are ours.
    - iNaturalist (``suprecall_inat.yaml``): ``start=0.0, offset=1.0``;
      ``suprecall_at_10.yaml``: ``at_k=(10,)``.

    Differences from the original: its class reshapes the positives' ranks to
    (B, -1), which needs the same number of positives for every query (its m-per-class
    sampler); here classes may have any size, singletons included (a lone query's only
    positive is itself). Scores are cosines of the L2-normalised embeddings (the
    authors' network normalises its output). Every query counts (``include_self=True``
    makes each its own positive), as their mean over the batch.

    Cost: O(B·m·B) time (m = largest class in the batch) and O(pairs_per_block·B + B²)
    memory, forward and backward; never a B×B×B tensor. Measured (B=4096, D=512,
    64 per class, float32, forward + backward, TensorFlow backend, 2 CPU cores of a
    busy machine): ~9 s under ``tf.function``, ~6-7 s with ``jit_compile=True``;
    peak RSS ~2.4 GB (SupAPLoss on the same inputs: ~8-9 s, 1.9 GB).

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
    arXiv:2309.08250; code github.com/elias-ramzi/SupRank, commit d3d0e3cb).

    For query i with relevances rel_ij (1 for the positives, the query itself included
    by default, 0 otherwise) and the SupRank rank of every relevant item (module
    docstring),

        DCG_i  = sum_{j: rel_ij > 0} (2^rel_ij - 1) / log2(1 + rank(i,j))
        IDCG_i = sum_{j: rel_ij > 0} (2^rel_ij - 1) / log2(1 + ideal rank of j)
        L = 1 - mean_i DCG_i / IDCG_i

    (the ideal ranks sort the relevances in decreasing order), as the authors'
    ``DifferentiableRank.quick_forward`` with ``rank_type='NDCG'`` and
    ``compute_ndcg_loss``. With integer class labels every positive has gain 1 and
    ``IDCG_i = sum_{r=1}^{|P_i|} 1 / log2(1 + r)``.

    Graded relevance: the authors' SupNDCG runs with ``hierarchy_level: MULTI``, where
    rel_ij is the number of hierarchy levels whose labels i and j share (e.g. product
    and super-class on SOP: 0, 1 or 2); items of lower relevance than k enter k's rank
    through the upper bound, the others through the true step. This class takes one
    label level; the relevance is computed by the internal hook ``_relevance``, which
    returns the (Q, N) relevances and their distinct positive levels, so a graded
    variant only overrides it (the rank is then computed once per level).

    Defaults and where they come from (SupRank at commit
    d3d0e3cbceee3e8f295fd411daecbe33c1b881bb): ``temperature=0.01`` (``tau``),
    ``rho=100``, ``delta=0.05``, ``start=0.5``, ``offset=1.44`` from
    ``suprank/config/loss/supndcg.yaml`` and ``roadndcg_sop.yaml`` (SOP); the class
    (``SupNDCGLoss`` in ``suprank/losses/ranking_loss.py``, ranker ``SupRank``) defaults
    to ``offset=None``; iNaturalist (``supndcg_inat.yaml``): ``start=0.0, offset=1.0``.
    The original computes IDCG in float32 whatever the input dtype (its ideal ranks
    pass through ``.float()``); here it is in the loss's dtype, ~1e-8 apart in float64.

    Cost: O(B·m·B) time (m = largest class in the batch; times the number of
    relevance levels) and O(pairs_per_block·B + B²) memory, forward and backward;
    never a B×B×B tensor. Measured (B=4096, D=512, 64 per class, float32,
    forward + backward, TensorFlow backend, 2 CPU cores of a busy machine): ~11-15 s
    under ``tf.function``, ~7-8 s with ``jit_compile=True``; peak RSS ~2.0 GB.

    Args:
{shared_args}
    """

    def __init__(self, *args, name="sup_ndcg_loss", **kwargs):
        super().__init__(*args, name=name, **kwargs)

    def _relevance(self, positives, candidates, dtype):
        """(Q, N) relevances (0 = not relevant) and their distinct positive levels
        (a static tuple). Single label level: 1 for the positives."""
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
