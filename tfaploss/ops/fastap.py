"""FastAP (Cakir, He, Xia, Kulis, Sclaroff, "Deep Metric Learning to Rank", CVPR 2019).

FastAP bins the squared Euclidean distance ``d = 2 - 2 s`` of unit embeddings on
[0, 4] with ``num_bins + 1`` triangular kernels centred on ``linspace(0, 4, L)``
(``delta = 4 / num_bins``), then (Eq. 14)::

    FastAP_i = sum_l h+_l H+_l / H_l / |P_i|

with ``h+``/``h`` the soft counts of positives/all candidates per bin and ``H+``/``H``
their cumulative sums from distance 0 upwards (0/0 terms are 0). The map
``d = 2 - 2 s`` turns these bins into the histogram-AP bins of
:mod:`tfaploss.ops.histogram` with ``num_bins + 1`` centres on [-1, 1] (top first),
so FastAP is computed by the same two-adjacent-bins code: O(Q·N) time and memory.
"""

from __future__ import annotations

from tfaploss.ops.histogram import check_num_bins, histogram_ap


def fastap(scores, positives, candidates=None, num_bins=10):
    """FastAP per query from a (Q, N) cosine score matrix, shape (Q,).

    Scores outside [-1, 1] (distances outside [0, 4]) saturate in the edge bin; the
    originals let them fade out, which only differs for unnormalised embeddings.
    Queries without positives get 0; leave them out of any mean.
    Cost: O(Q·N) time and memory.
    """
    return histogram_ap(scores, positives, candidates, num_bins=check_num_bins(num_bins, 1) + 1,
                        score_range=(-1.0, 1.0))
