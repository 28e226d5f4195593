"""H-AP's kernels (HAPPIER, Ramzi et al., ECCV 2022): multi-level label relations, the
authors' relevance, and the smoothed ranks of every relevant pair, in the blocks of
:mod:`tfaploss.ops.pair_blocks`. :class:`tfaploss.losses.HAPLoss` is the loss."""

from __future__ import annotations

from keras import ops

from tfaploss.ops.backend import dim, take
from tfaploss.ops.pair_blocks import Blocks, blocked_rank_terms, pair_gaps, pair_values

# Level code of an item that takes no part in a query's ranking (never >= a real level).
_OUT = -1


def hierarchy_levels(query_labels, db_labels):
    """``level[i, j]``: how many label columns items i and j share, shape (Q, N).

    The authors' ``create_label_matrix``: 0 (unrelated) to L (same finest class).
    """
    num_levels = query_labels.shape[-1]
    level = None
    for column in range(num_levels):  # L, the label columns: a static handful
        same = ops.cast(ops.equal(ops.expand_dims(query_labels[:, column], 1),
                                  ops.expand_dims(db_labels[:, column], 0)), "int32")
        level = same if level is None else level + same
    return level


def pop_relevance(level, candidates, num_levels, alpha=1.0, dtype="float32"):
    """The authors' default ("pop") relevance of every pair, shape (Q, N).

    ``rel(i, j) = w[l] / #{k in C_i: level(i, k) = l}`` with ``l = level(i, j)`` and
    ``w[l] = (l / (L - 1)) ** alpha`` (``get_relevances_pop`` of HAPPIER's
    ``engine/compute_relevance_on_the_fly.py``). For ``L = 1``, ``w[1] = 1`` (the
    authors' ``1 / (L - 1)`` is undefined; any constant gives plain AP).
    """
    candidates = ops.cast(candidates, "bool")
    denominator = max(num_levels - 1, 1)
    relevance = ops.zeros(ops.shape(level), dtype)
    for lvl in range(1, num_levels + 1):
        here = ops.logical_and(ops.equal(level, lvl), candidates)
        count = ops.sum(ops.cast(here, dtype), axis=1, keepdims=True)
        share = (lvl / denominator) ** alpha / ops.maximum(count, 1.0)
        relevance = ops.where(here, share, relevance)
    return relevance


def _hap_block_kernels(upper):
    """The block kernel of the relevant pairs (i, j); ``kind`` is ``(code, relevance)``
    (``code``: the level, ``_OUT`` when not ranked). Per pair:

        rank_sum  = sum_{k != j ranked} (upper(t) if code_k < code_j else [t >= 0])
        hrank_sum = sum_{k != j ranked} [t >= 0] · min(rel_k, rel_j)

    with ``t = s_ik - s_ij``; only ``rank_sum`` has a gradient (through ``upper`` on the
    less relevant items), as in the authors' code with ``with_hrank=False``.
    """

    def geometry(s, kind, flat):
        code, relevance = kind
        num_items = dim(s, 1)
        rows, t, codes = pair_gaps(s, code, flat)
        own_code = take(ops.reshape(code, [-1]), flat)[:, None]
        # The pair's own item j takes no part in its ranks (j = k in the authors' mask).
        others = ops.not_equal(ops.arange(num_items, dtype="int32")[None, :],
                               (flat % num_items)[:, None])
        ranked = ops.logical_and(codes != _OUT, others)
        lower = ops.logical_and(ranked, codes < own_code)
        return rows, t, ranked, lower, relevance

    def forward(s, kind, flat, valid):
        rows, t, ranked, lower, relevance = geometry(s, kind, flat)
        zero = ops.zeros_like(t)
        ahead = ops.cast(t >= 0, t.dtype)
        rank = ops.sum(ops.where(lower, upper.value(t), ops.where(ranked, ahead, zero)), 1)
        rel = take(relevance, rows, axis=0)
        own_rel = take(ops.reshape(relevance, [-1]), flat)[:, None]
        hrank = ops.sum(ops.where(ranked, ahead * ops.minimum(rel, own_rel), zero), 1)
        none = ops.zeros_like(rank)
        return ops.where(valid, hrank, none), ops.where(valid, rank, none)

    def backward(s, kind, flat, valid, g_hrank, g_rank):
        rows, t, _, lower, _ = geometry(s, kind, flat)
        _, slope = upper.value_and_slope(t)
        g = pair_values(g_rank, flat, valid)[:, None]
        w = ops.where(lower, g * slope, ops.zeros_like(t))
        return rows, w, -ops.sum(w, axis=1)

    return forward, backward


def hap_per_query(scores, level, relevance, candidates, upper, pairs_per_block=None):
    """H-AP of every query from its (Q, N) scores, levels, relevances and candidates.

    ``HAP_i = sum_{j: rel_ij > 0} H-rank(i, j) / rank(i, j) / sum_j rel_ij`` with

        rank(i, j)   = 1 + sum_{k != j} (upper(s_ik - s_ij) if level_ik < level_ij
                                         else [s_ik >= s_ij])
        H-rank(i, j) = rel_ij + sum_{k != j} [s_ik >= s_ij] · min(rel_ik, rel_ij)

    over the candidates k (HAPPIER's ``SmoothRankHAP.quick_forward``). Returns ``(hap,
    num_relevant)``, each (Q,). Cost: O(P·N) time with P the relevant pairs,
    O(pairs_per_block·N + Q·N) memory, forward and backward alike.
    """
    scores = ops.convert_to_tensor(scores)
    candidates = ops.cast(candidates, "bool")
    relevance = ops.where(candidates, ops.cast(relevance, scores.dtype),
                          ops.zeros_like(scores))
    relevant = ops.logical_and(relevance > 0, candidates)
    code = ops.where(candidates, ops.cast(level, "int32"), ops.full_like(level, _OUT, "int32"))
    hrank_sum, rank_sum = blocked_rank_terms(scores, (code, relevance),
                                             Blocks(relevant, pairs_per_block), True,
                                             ("hap", *upper.key), *_hap_block_kernels(upper))
    ratio = (relevance + hrank_sum) / (1.0 + rank_sum)
    total = ops.sum(ops.where(relevant, ratio, ops.zeros_like(ratio)), axis=1)
    norm = ops.sum(relevance, axis=1)
    hap = total / ops.where(norm > 0, norm, ops.ones_like(norm))
    return hap, ops.sum(ops.cast(relevant, "int32"), axis=1)
