"""FastAP (Cakir, He, Xia, Kulis, Sclaroff, "Deep Metric Learning to Rank", CVPR 2019).

FastAP bins ``d = 2 - 2 s`` on [0, 4] with ``num_bins + 1`` triangular kernels, then
(Eq. 14) ``FastAP_i = sum_l h+_l H+_l / H_l / |P_i|`` (``H``: cumulative counts from
distance 0 up). Those are the histogram-AP bins of :mod:`tfaploss.ops.histogram` with
``num_bins + 1`` centres on [-1, 1]: O(Q·N) time and memory.
"""

from __future__ import annotations

from tfaploss.ops.histogram import check_num_bins, histogram_ap


def fastap(scores, positives, candidates=None, num_bins=10):
    """FastAP per query from a (Q, N) cosine score matrix, shape (Q,); 0 without
    positives. Scores outside [-1, 1] saturate in the edge bin (the originals let them
    fade out). Cost: O(Q·N) time and memory."""
    return histogram_ap(scores, positives, candidates, num_bins=check_num_bins(num_bins, 1) + 1,
                        score_range=(-1.0, 1.0))
