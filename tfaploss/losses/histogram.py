"""Histogram-binned AP losses, ``APLoss`` ("mAP_Q") and ``TieAwareAPLoss`` ("mAP_T")
(Revaud et al., ICCV 2019)."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses.base import RetrievalLoss
from tfaploss.ops.histogram import check_bins, histogram_ap, tie_aware_histogram_ap


@keras.saving.register_keras_serializable(package="tfaploss")
class APLoss(RetrievalLoss):
    """Histogram-binned AP loss, "mAP_Q" (Revaud, Almazán, Rezende, de Souza, "Learning
    with Average Precision: Training Image Retrieval with a Listwise Loss", ICCV 2019,
    Eq. 5-12). Each query's cosine scores are quantised into ``num_bins`` triangular
    bins over ``score_range`` (centres from the top down,
    ``delta = (hi - lo) / (M - 1)``)::

        c_m  = sum_j delta(s_ij, m),   c+_m = sum_{j in P_i} delta(s_ij, m)
        AP_i = sum_m (C+_m / C_m) * c+_m / |P_i|     (C = cumulative sums from the top)
        L    = 1 - sum_i w_i AP_i / sum_i w_i

    over the queries with a positive (the original returns NaN for the others).
    ``w_i = 1``, or with ``class_balanced=True`` (paper §4.2) ``1 / n_{y_i}``, the
    size of the query's class (itself counted).

    Each score feeds only its two adjacent bins: a call costs O(B²·D) for the scores
    plus O(B²) time and memory for the binning and O(B·M) for the APs.

    Args:
        num_bins: number of bins M (paper: 20; the authors' code defaults to 25).
        score_range: ``(low, high)`` of the quantised scores (paper: ``(-1, 1)``;
            the authors' code: ``(0, 1)``).
        class_balanced: weight each query by the inverse size of its class.
{shared_args}
        The paper ranks each query against the OTHER images (``include_self=False``).
    """

    def __init__(self, num_bins=20, score_range=(-1.0, 1.0), class_balanced=False,
                 *, name="ap_loss", **kwargs):
        super().__init__(name=name, **kwargs)
        self.num_bins, lo, hi = check_bins(num_bins, score_range)
        self.score_range = (lo, hi)
        self.class_balanced = bool(class_balanced)

    def query_ap(self, scores, positives, candidates):
        """Per-query AP estimate, shape (Q,)."""
        return histogram_ap(scores, positives, candidates, self.num_bins, self.score_range)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        ap = self.query_ap(scores, positives, candidates)
        weights = ops.cast(ops.any(positives, axis=-1), ap.dtype)
        if self.class_balanced:  # the query itself counted once in its class size
            others = self.other_positive_counts(positives, self_pairs)
            weights = weights / ops.cast(others + 1, ap.dtype)
        return 1.0 - ap, weights


@keras.saving.register_keras_serializable(package="tfaploss")
class TieAwareAPLoss(APLoss):
    """Tie-aware histogram AP loss, "mAP_T" (Revaud et al., ICCV 2019, §3.2). As
    :class:`APLoss`, but the precision inside a bin accounts for the ties the
    quantisation creates. ``simplified=True`` is the paper's Eq. 13::

        AP_i = sum_m c+_m (1 + C+_{m-1} + C+_m) / (1 + C_{m-1} + C_m) / |P_i|

    ``simplified=False`` (the authors' default) is the expected AP under a random
    order inside each bin (:func:`tfaploss.ops.tie_aware_histogram_ap`).
    Cost as :class:`APLoss`: O(B²) time and memory beyond the scores.

    Args:
        num_bins, score_range, class_balanced: as for :class:`APLoss`.
        simplified: Eq. 13 (True) or the expected AP (False), as above.
{shared_args}
    """

    def __init__(self, num_bins=20, score_range=(-1.0, 1.0), simplified=False,
                 *, name="tie_aware_ap_loss", **kwargs):
        super().__init__(num_bins, score_range, name=name, **kwargs)
        self.simplified = bool(simplified)

    def query_ap(self, scores, positives, candidates):
        return tie_aware_histogram_ap(scores, positives, candidates, self.num_bins,
                                      self.score_range, simplified=self.simplified)
