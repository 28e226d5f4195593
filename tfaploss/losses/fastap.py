"""``FastAPLoss``: Cakir et al., "Deep Metric Learning to Rank", CVPR 2019."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses.base import RetrievalLoss
from tfaploss.ops.histogram import check_num_bins, fastap


@keras.saving.register_keras_serializable(package="tfaploss")
class FastAPLoss(RetrievalLoss):
    """FastAP loss (Cakir, He, Xia, Kulis, Sclaroff, "Deep Metric Learning to Rank",
    CVPR 2019, Eq. 14). Squared distances ``d = 2 - 2 s`` of the L2-normalised
    embeddings are binned on [0, 4] by ``num_bins + 1`` triangular kernels; per query
    ``FastAP_i = sum_l h+_l H+_l / H_l / |P_i|`` (cumulative counts from distance 0 up)
    and ``L = 1 - mean_i FastAP_i`` over the queries with a positive (the query itself
    excluded, as in the originals).

    Matches Kun He's original and pytorch-metric-learning's ``FastAPLoss`` in value
    and true gradient (the original's backward returns ``N_valid / 2`` times it).
    ``d = 2 - 2 s`` assumes unit-norm embeddings.

    Cost: O(B²·D) for the scores plus O(B²) time and memory.

    Args:
        num_bins: number of distance intervals (``num_bins + 1`` bin centres).
{shared_args}
    """

    def __init__(self, num_bins=10, *, name="fastap_loss", **kwargs):
        super().__init__(name=name, **kwargs)
        self.num_bins = check_num_bins(num_bins, 1)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        ap = fastap(scores, positives, candidates, self.num_bins)
        weights = ops.cast(ops.any(positives, axis=-1), ap.dtype)
        return 1.0 - ap, weights
