"""ROADMAP's calibration loss (Ramzi et al., NeurIPS 2021) on a score matrix."""

from __future__ import annotations

import tensorflow as tf

CALIBRATION_AVERAGING = ("nonzero_pairs", "per_query")


def calibration_loss(scores, positives, candidates, pos_margin=0.9, neg_margin=0.6,
                     averaging="nonzero_pairs"):
    """Calibration term pulling positive scores above ``pos_margin`` and negatives
    below ``neg_margin``.

    Per pair: ``l+ = [pos_margin - s_ij]_+`` on positive pairs,
    ``l- = [s_ij - neg_margin]_+`` on negative pairs (candidates that are not
    positives). Leave the query itself out of ``candidates`` (ordered pairs i != j).

    ``averaging="nonzero_pairs"`` (the authors' code, pytorch-metric-learning's
    contrastive loss with ``AvgNonZeroReducer``): mean of the non-zero ``l+`` plus mean
    of the non-zero ``l-`` over all pairs (each 0 when there is none).
    ``averaging="per_query"`` (the paper's Eq. 7): per query, the mean of ``l+`` over
    its positives plus the mean of ``l-`` over its negatives, averaged over the
    queries with a positive.

    Returns a scalar. Cost: O(Q·N) time and memory.
    """
    if averaging not in CALIBRATION_AVERAGING:
        raise ValueError(f"averaging must be one of {CALIBRATION_AVERAGING}; received "
                         f"{averaging!r}.")
    scores = tf.convert_to_tensor(scores)
    candidates = tf.cast(candidates, tf.bool)
    positives = tf.logical_and(tf.cast(positives, tf.bool), candidates)
    negatives = tf.logical_and(candidates, tf.logical_not(positives))
    zeros = tf.zeros_like(scores)
    pos_terms = tf.where(positives, tf.nn.relu(pos_margin - scores), zeros)
    neg_terms = tf.where(negatives, tf.nn.relu(scores - neg_margin), zeros)

    def mean_of(terms, mask, axis=None):
        count = tf.reduce_sum(tf.cast(mask, scores.dtype), axis=axis)
        return tf.reduce_sum(terms, axis=axis) / tf.maximum(count, 1.0)

    if averaging == "nonzero_pairs":
        return mean_of(pos_terms, pos_terms > 0) + mean_of(neg_terms, neg_terms > 0)
    per_query = mean_of(pos_terms, positives, axis=1) + mean_of(neg_terms, negatives, axis=1)
    has_positive = tf.reduce_any(positives, axis=1)
    return mean_of(tf.where(has_positive, per_query, tf.zeros_like(per_query)), has_positive)
