"""Triplet mining over the positive pairs, in blocks (:mod:`tfaploss.ops.pair_blocks`).

For every positive pair (i, k) of a (Q, N) distance matrix ``d``, with the gaps
``t_j = d_ij - d_ik`` to the query's negatives j:

* :func:`semihard_gaps`: the semi-hard gap ``min {t_j : t_j > 0}`` (the closest
  negative farther than the positive), or ``max_j t_j`` (the farthest negative) when
  no negative is farther (TF Addons' ``triplet_semihard_loss``);
* :func:`hinge_sums`: ``sum_j max(margin - t_j, 0)``, the pair's share of every
  "batch all" triplet.

Only the P positive pairs are ranked: O(P·N) time (O(B·m·B) for m images per class)
and O(pairs_per_block·N + Q·N) memory, forward and backward alike; no sort, so it is
as fast under XLA and ``jax.jit`` as eagerly. The gradient of a gap reaches the chosen
negative's distance (+1) and the positive's (-1).
"""

from __future__ import annotations

from keras import ops

from tfaploss.ops.backend import dim
from tfaploss.ops.pair_blocks import Blocks, blocked_rank_terms, pair_gaps, pair_values


def _semihard_choice(t, negatives):
    """Per pair: the chosen gap's one-hot (block, N) and whether the pair has one."""
    inf = ops.full_like(t, float("inf"))
    farther = ops.logical_and(negatives, t > 0)
    has_farther = ops.any(farther, axis=1, keepdims=True)
    pick = ops.where(has_farther, ops.where(farther, t, inf),
                     ops.where(negatives, -t, inf))  # else the farthest: max t = -min(-t)
    index = ops.argmin(pick, axis=1)
    columns = ops.arange(dim(t, 1), dtype=index.dtype)[None, :]
    return ops.cast(columns == index[:, None], t.dtype), ops.any(negatives, axis=1)


def _semihard_kernels():
    def forward(s, negative_rows, flat, valid):
        _, t, negatives = pair_gaps(s, negative_rows, flat)
        chosen, has_negative = _semihard_choice(t, negatives)
        gap = ops.sum(chosen * t, axis=1)
        zero = ops.zeros_like(gap)
        return zero, ops.where(ops.logical_and(valid, has_negative), gap, zero)

    def backward(s, negative_rows, flat, valid, g_first, g_gap):
        rows, t, negatives = pair_gaps(s, negative_rows, flat)
        chosen, has_negative = _semihard_choice(t, negatives)
        w = chosen * pair_values(g_gap, flat, ops.logical_and(valid, has_negative))[:, None]
        return rows, w, -ops.sum(w, axis=1)

    return forward, backward


def _hinge_kernels(margin):
    def forward(s, negative_rows, flat, valid):
        _, t, negatives = pair_gaps(s, negative_rows, flat)
        hinge = ops.where(negatives, ops.relu(margin - t), ops.zeros_like(t))
        total = ops.sum(hinge, axis=1)
        zero = ops.zeros_like(total)
        return zero, ops.where(valid, total, zero)

    def backward(s, negative_rows, flat, valid, g_first, g_sum):
        rows, t, negatives = pair_gaps(s, negative_rows, flat)
        g = pair_values(g_sum, flat, valid)[:, None]
        w = ops.where(ops.logical_and(negatives, t < margin), -g, ops.zeros_like(t))
        return rows, w, -ops.sum(w, axis=1)

    return forward, backward


def semihard_gaps(distances, positives, negatives, pairs_per_block=None):
    """(Q, N): at each positive pair, its semi-hard gap (module docstring); 0 elsewhere
    and where the query has no negative.

    Args:
        distances: (Q, N) float distances.
        positives: (Q, N) bool, the pairs (i, k) to mine for.
        negatives: (Q, N) bool, the negatives j of each query.
        pairs_per_block: positive pairs per loop step; ``None``: about ``4M / N``.
    """
    return blocked_rank_terms(distances, negatives, Blocks(positives, pairs_per_block),
                              False, ("semihard_gaps",), *_semihard_kernels())[1]


def hinge_sums(distances, positives, negatives, margin, pairs_per_block=None):
    """(Q, N): at each positive pair, ``sum_j max(margin - t_j, 0)`` over the query's
    negatives (module docstring); 0 elsewhere. Arguments as :func:`semihard_gaps`."""
    return blocked_rank_terms(distances, negatives, Blocks(positives, pairs_per_block),
                              False, ("hinge_sums", float(margin)),
                              *_hinge_kernels(margin))[1]
