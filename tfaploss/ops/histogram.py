"""Histogram-binned AP ("mAP_Q"), its tie-aware variant ("mAP_T") and FastAP (the same
bins on distances).

Revaud, Almazán, Rezende, de Souza, "Learning with Average Precision: Training Image
Retrieval with a Listwise Loss", ICCV 2019 (Eq. 5-13).

Scores are quantised into M bins with centres ``b_m = hi - m * delta`` (top bin
first), ``delta = (hi - lo) / (M - 1)``, by the triangular kernel
``delta(s, m) = max(0, 1 - |s - b_m| / delta)`` (the edge bins saturate outside the
range). Each score feeds at most two adjacent bins, so a weighted bincount replaces the
original's dense (Q, M, N) tensor: O(Q·N) time and memory, O(Q·M) for the AP itself.
"""

from __future__ import annotations

from keras import ops

from tfaploss.ops.backend import two_bin_counts
from tfaploss.ops.masks import ranked_masks


def check_num_bins(num_bins, least=2):
    """``num_bins`` as an int, refused unless a whole number >= ``least``."""
    if int(num_bins) != num_bins or num_bins < least:
        raise ValueError(f"num_bins must be an integer >= {least}; received "
                         f"num_bins={num_bins!r}.")
    return int(num_bins)


def check_bins(num_bins, score_range):
    """``(num_bins, low, high)`` of a histogram, checked."""
    num_bins = check_num_bins(num_bins)
    try:
        lo, hi = (float(v) for v in score_range)
    except (TypeError, ValueError):
        raise ValueError(
            f"score_range must be a pair (low, high); received score_range={score_range!r}."
        ) from None
    if not lo < hi:
        raise ValueError(f"score_range must have low < high; received score_range={score_range!r}.")
    return num_bins, lo, hi


def two_bin_assignment(scores, num_bins=20, score_range=(-1.0, 1.0)):
    """Soft assignment of each score to its two adjacent bins (the triangular kernel).

    Returns ``(index, frac)``: bin ``index`` (int32, in [0, M-2]) receives
    ``1 - frac`` and bin ``index + 1`` receives ``frac``, with ``u = clip((hi - s) /
    delta, 0, M - 1)``, ``index = min(floor(u), M - 2)``. Cost: O(size of scores).
    """
    num_bins, lo, hi = check_bins(num_bins, score_range)
    scores = ops.convert_to_tensor(scores)
    delta = (hi - lo) / (num_bins - 1)
    u = ops.clip((hi - scores) / delta, 0.0, float(num_bins - 1))
    index = ops.stop_gradient(ops.minimum(ops.floor(u), float(num_bins - 2)))
    return ops.cast(index, "int32"), u - index


def soft_bins_dense(scores, num_bins=20, score_range=(-1.0, 1.0)):
    """The dense (..., M) soft assignment (for tests and small inputs only)."""
    index, frac = two_bin_assignment(scores, num_bins, score_range)
    return (ops.one_hot(index, num_bins, dtype=frac.dtype) * ops.expand_dims(1.0 - frac, -1)
            + ops.one_hot(index + 1, num_bins, dtype=frac.dtype) * ops.expand_dims(frac, -1))


def soft_histograms(scores, positives, candidates=None, num_bins=20, score_range=(-1.0, 1.0)):
    """Soft counts per bin of all candidates and of the positives, each (Q, M):
    ``counts[i, m] = sum_j delta(s_ij, m) [j candidate]``. O(Q·N) time and memory."""
    scores = ops.convert_to_tensor(scores)
    dtype = scores.dtype
    num_bins = int(num_bins)
    positives, candidates = ranked_masks(positives, candidates)
    index, frac = two_bin_assignment(scores, num_bins, score_range)
    upper, lower = 1.0 - frac, frac
    cand = ops.cast(candidates, dtype)
    pos = ops.cast(positives, dtype)
    counts = two_bin_counts(index, upper * cand, lower * cand, num_bins)
    pos_counts = two_bin_counts(index, upper * pos, lower * pos, num_bins)
    return counts, pos_counts


def _shift_right(x):
    return ops.pad(x[:, :-1], [[0, 0], [1, 0]])


def _positive_counts(positives, candidates, dtype):
    return ops.sum(ops.cast(ranked_masks(positives, candidates)[0], dtype), axis=-1)


def _safe_divide(num, den):
    """num / den where den > 0, else 0, with a gradient free of 0/0."""
    ok = den > 0
    return ops.where(ok, num / ops.where(ok, den, ops.ones_like(den)), ops.zeros_like(num))


def histogram_ap(scores, positives, candidates=None, num_bins=20, score_range=(-1.0, 1.0)):
    """Histogram-binned AP per query, "AP_Q" (Revaud et al. Eq. 5-8), shape (Q,).

    ``c_m``/``c+_m`` soft counts of candidates/positives per bin (top bin first);
    ``AP = sum_m (sum_{m'<=m} c+_m' / sum_{m'<=m} c_m') * c+_m / |P|``.
    A query without positives gets 0 (the original: NaN). Cost: O(Q·N) time and memory.
    """
    scores = ops.convert_to_tensor(scores)
    counts, pos_counts = soft_histograms(scores, positives, candidates, num_bins, score_range)
    precision = _safe_divide(ops.cumsum(pos_counts, axis=-1), ops.cumsum(counts, axis=-1))
    num_pos = _positive_counts(positives, candidates, scores.dtype)
    return _safe_divide(ops.sum(precision * pos_counts, axis=-1), num_pos)


def fastap(scores, positives, candidates=None, num_bins=10):
    """FastAP (Cakir, He, Xia, Kulis, Sclaroff, "Deep Metric Learning to Rank", CVPR 2019)
    per query from a (Q, N) cosine score matrix, shape (Q,); 0 without positives.

    FastAP bins ``d = 2 - 2 s`` on [0, 4] with ``num_bins + 1`` triangular kernels, then
    (Eq. 14) ``FastAP_i = sum_l h+_l H+_l / H_l / |P_i|`` (``H``: cumulative counts from
    distance 0 up): :func:`histogram_ap` with ``num_bins + 1`` centres on [-1, 1]. Scores
    outside [-1, 1] saturate in the edge bin (the originals let them fade out). Cost:
    O(Q·N) time and memory."""
    return histogram_ap(scores, positives, candidates, num_bins=check_num_bins(num_bins, 1) + 1,
                        score_range=(-1.0, 1.0))


def tie_aware_histogram_ap(scores, positives, candidates=None, num_bins=20,
                           score_range=(-1.0, 1.0), simplified=False):
    """Tie-aware histogram AP, "AP_T" (Revaud et al. §3.2), shape (Q,).

    With inclusive cumulative counts ``C_m``, ``C+_m`` and ``C_{m-1}``, ``C+_{m-1}``
    the counts above bin m:

    * ``simplified=True`` (Eq. 13):
      ``AP = sum_m c+_m (1 + C+_{m-1} + C+_m) / (1 + C_{m-1} + C_m) / |P|``;
    * ``simplified=False`` (the authors' default): the expected AP under a random
      order inside each bin, the harmonic sum replaced by ``ln((C_m+1)/(C_{m-1}+1))``:
      ``r = [c+_m - 1]_+ / ([c_m - 1]_+ + 1e-8)``,
      ``AP = sum_m c+_m (c_m r + (C+_{m-1} + 1 - r (C_{m-1} + 1)) ln((C_m+1)/(C_{m-1}+1)))
      / (c_m + 1e-8) / |P|``.

    Queries without positives get 0. Cost: O(Q·N) time and memory.
    """
    scores = ops.convert_to_tensor(scores)
    c, cp = soft_histograms(scores, positives, candidates, num_bins, score_range)
    big_c = ops.cumsum(c, axis=-1)
    big_cp = ops.cumsum(cp, axis=-1)
    prev_c = _shift_right(big_c)  # the counts above bin m (exclusive cumsum)
    prev_cp = _shift_right(big_cp)
    if simplified:
        terms = cp * (prev_cp + big_cp + 1.0) / (prev_c + big_c + 1.0)
    else:
        eps = 1e-8
        ratio = ops.relu(cp - 1.0) / (ops.relu(c - 1.0) + eps)
        log_term = ops.log((big_c + 1.0) / (prev_c + 1.0))
        terms = cp * (c * ratio + (prev_cp + 1.0 - ratio * (prev_c + 1.0)) * log_term) / (c + eps)
    num_pos = _positive_counts(positives, candidates, scores.dtype)
    return _safe_divide(ops.sum(terms, axis=-1), num_pos)
