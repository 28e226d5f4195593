"""ROADMAP's calibration loss (Ramzi et al., NeurIPS 2021) on a score matrix."""

from __future__ import annotations

from keras import ops

from tfaploss.ops.masks import masked_mean, ranked_masks

CALIBRATION_AVERAGING = ("nonzero_pairs", "per_query")


def calibration_loss(scores, positives, candidates, pos_margin=0.9, neg_margin=0.6,
                     averaging="nonzero_pairs"):
    """Calibration term: ``l+ = [pos_margin - s_ij]_+`` on positive pairs, ``l- = [s_ij -
    neg_margin]_+`` on the other candidates (leave the query itself out of them).

    ``averaging="nonzero_pairs"`` (the authors' code): mean of the non-zero ``l+`` plus
    mean of the non-zero ``l-`` (each 0 when there is none). ``"per_query"`` (the
    paper's Eq. 7): per query, the mean of ``l+`` over its positives plus the mean of
    ``l-`` over its negatives, averaged over the queries with a positive.

    Returns a scalar. Cost: O(Q·N) time and memory.
    """
    if averaging not in CALIBRATION_AVERAGING:
        raise ValueError(f"averaging must be one of {CALIBRATION_AVERAGING}; received "
                         f"{averaging!r}.")
    scores = ops.convert_to_tensor(scores)
    positives, candidates = ranked_masks(positives, candidates)
    negatives = ops.logical_and(candidates, ops.logical_not(positives))
    zeros = ops.zeros_like(scores)
    pos_terms = ops.where(positives, ops.relu(pos_margin - scores), zeros)
    neg_terms = ops.where(negatives, ops.relu(scores - neg_margin), zeros)
    if averaging == "nonzero_pairs":
        return masked_mean(pos_terms, pos_terms > 0) + masked_mean(neg_terms, neg_terms > 0)
    per_query = (masked_mean(pos_terms, positives, axis=1)
                 + masked_mean(neg_terms, negatives, axis=1))
    return masked_mean(per_query, ops.any(positives, axis=1))
