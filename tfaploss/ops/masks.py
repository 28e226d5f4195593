"""Scores and relevance masks shared by every ranking loss."""

from __future__ import annotations

from keras import ops

# Below this norm an embedding is treated as zero; keeps the gradient finite.
_NORM_EPSILON = 1e-12


def safe_normalize(x):
    """L2-normalise the rows of ``x``; a zero row stays zero instead of NaN."""
    sq = ops.sum(ops.square(x), axis=-1, keepdims=True)
    return x * ops.rsqrt(ops.maximum(sq, _NORM_EPSILON**2))


def pairwise_scores(queries, database, normalize=True):
    """Cosine (or dot-product when ``normalize=False``) scores, shape (Q, N). O(Q·N·D)."""
    if normalize:
        queries = safe_normalize(queries)
        database = safe_normalize(database)
    return ops.matmul(queries, ops.transpose(database))


def masked_mean(values, mask, axis=None):
    """Mean of ``values`` where ``mask`` holds, over ``axis`` (None: all); values
    outside the mask are ignored (zero gradient), an empty mask gives 0. O(size)."""
    mask = ops.cast(mask, "bool")
    total = ops.sum(ops.where(mask, values, ops.zeros_like(values)), axis=axis)
    return total / ops.maximum(ops.sum(ops.cast(mask, values.dtype), axis=axis), 1.0)


def self_pair_mask(n):
    """The (n, n) boolean mask of each query paired with itself (the diagonal)."""
    index = ops.arange(n)
    return ops.equal(ops.expand_dims(index, 1), ops.expand_dims(index, 0))


def label_masks(query_labels, db_labels, exclude_self=False):
    """Boolean ``positives`` and ``candidates`` masks, shape (Q, N).

    ``positives[i, j]``: item j shares query i's label and is ranked; ``candidates[i,
    j]``: item j is ranked (all but the diagonal with ``exclude_self=True``). Labels
    are compared as given, so large integer ids stay exact.
    """
    same = ops.equal(ops.expand_dims(query_labels, 1), ops.expand_dims(db_labels, 0))
    if exclude_self:
        candidates = ops.logical_not(self_pair_mask(ops.shape(query_labels)[0]))
    else:
        candidates = ops.ones_like(same, dtype="bool")
    return ops.logical_and(same, candidates), candidates


def ranked_masks(positives, candidates=None):
    """``(positives, candidates)`` as bool (Q, N) masks, the positives limited to the
    candidates (every item is a candidate when ``candidates`` is None)."""
    positives = ops.cast(positives, "bool")
    candidates = (ops.ones_like(positives) if candidates is None
                  else ops.cast(candidates, "bool"))
    return ops.logical_and(positives, candidates), candidates


def masked_logsumexp(x, mask, axis=-1, add_one=False):
    """``log(sum_{mask} exp(x))`` along ``axis`` (``log(1 + sum ...)`` with ``add_one``).

    pytorch-metric-learning's ``logsumexp(keep_mask=..., add_one=...)``: an empty mask
    gives 0; entries outside the mask are ignored (zero gradient); no overflow. O(size).
    """
    mask = ops.cast(mask, "bool")
    minus_inf = ops.full_like(x, float("-inf"))
    top = ops.max(ops.where(mask, x, minus_inf), axis=axis, keepdims=True)
    if add_one:
        top = ops.maximum(top, 0.0)
    top = ops.stop_gradient(ops.where(ops.isfinite(top), top, ops.zeros_like(top)))
    total = ops.sum(ops.exp(ops.where(mask, x - top, minus_inf)), axis=axis, keepdims=True)
    if add_one:
        total = total + ops.exp(-top)
    out = ops.log(ops.where(total > 0, total, ops.ones_like(total))) + top
    out = ops.squeeze(out, axis=axis)
    if add_one:
        return out
    return ops.where(ops.any(mask, axis=axis), out, ops.zeros_like(out))
