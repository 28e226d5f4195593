"""Functional core of the AP surrogates: functions of a (queries x database) score
matrix and boolean ``positives`` and ``candidates`` masks, wrapped by the losses."""

from tfaploss.ops.backend import inverse_permutations
from tfaploss.ops.blackbox import blackbox_ap, blackbox_ranks
from tfaploss.ops.calibration import calibration_loss
from tfaploss.ops.hap import hap_per_query, hierarchy_levels, pop_relevance
from tfaploss.ops.histogram import (
    fastap,
    histogram_ap,
    soft_bins_dense,
    soft_histograms,
    tie_aware_histogram_ap,
    two_bin_assignment,
)
from tfaploss.ops.masks import label_masks, pairwise_scores, safe_normalize
from tfaploss.ops.smooth_rank import (
    pnp_penalty,
    pnp_per_query,
    positive_rank_terms,
    sigmoid_tau,
    smooth_ap_per_query,
    sup_ap_per_query,
)

__all__ = [
    "blackbox_ap", "blackbox_ranks", "calibration_loss", "fastap", "hap_per_query",
    "hierarchy_levels", "histogram_ap", "inverse_permutations", "label_masks",
    "pairwise_scores", "pnp_penalty", "pnp_per_query", "pop_relevance",
    "positive_rank_terms", "safe_normalize", "sigmoid_tau", "smooth_ap_per_query",
    "soft_bins_dense", "soft_histograms", "sup_ap_per_query", "tie_aware_histogram_ap",
    "two_bin_assignment",
]
