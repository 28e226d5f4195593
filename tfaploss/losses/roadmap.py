"""ROADMAP (Ramzi et al., "Robust and Decomposable Average Precision for Image
Retrieval", NeurIPS 2021): SupAP plus a calibration term."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses._checks import number, one_of
from tfaploss.losses.base import RetrievalLoss
from tfaploss.losses.smooth_ap import UpperStepArgs
from tfaploss.ops.calibration import CALIBRATION_AVERAGING, calibration_loss
from tfaploss.ops.smooth_rank import sup_ap_per_query


class _CalibrationArgs:
    """The calibration term's arguments, checked and kept."""

    def _keep_margins(self, pos_margin, neg_margin, averaging):
        owner = type(self).__name__
        self.pos_margin = number(owner, "pos_margin", pos_margin)
        self.neg_margin = number(owner, "neg_margin", neg_margin)
        self.averaging = one_of(owner, "averaging", averaging, CALIBRATION_AVERAGING)


@keras.saving.register_keras_serializable(package="tfaploss")
class CalibrationLoss(_CalibrationArgs, RetrievalLoss):
    """ROADMAP's calibration loss. Over ordered pairs i != j of the batch:

        l+ = [pos_margin - s_ij]_+ (same label),  l- = [s_ij - neg_margin]_+ (other)
        L  = mean of the non-zero l+  +  mean of the non-zero l-

    (the authors' code; each mean is 0 when nothing violates its margin).
    ``averaging="per_query"`` gives the paper's Eq. 7 instead: per query the mean of
    ``l+`` over its positives plus the mean of ``l-`` over its negatives, averaged
    over queries with a positive (the code form weighs a few violating pairs much
    more). Cost: O(B²) time and memory.

    Args:
        pos_margin: alpha, the score positives should reach (0.9).
        neg_margin: beta, the score negatives should stay below (0.6).
        averaging: ``"nonzero_pairs"`` (code) or ``"per_query"`` (paper Eq. 7).
{shared_args}
    """

    # Pairs i != j: no query is ranked against itself, so none is "lone" with itself.
    unused_args = ("include_self", "drop_lone_queries")

    def __init__(self, pos_margin=0.9, neg_margin=0.6, averaging="nonzero_pairs",
                 *, name="calibration_loss", **kwargs):
        super().__init__(name=name, **kwargs)
        self._keep_margins(pos_margin, neg_margin, averaging)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        # A batch-level value: every query carries it, so the mean reduction returns it.
        total = calibration_loss(scores, positives, candidates, self.pos_margin,
                                 self.neg_margin, self.averaging)
        any_pair = ops.any(ops.logical_and(ops.cast(positives, "bool"),
                                           ops.cast(candidates, "bool")))
        queries = ops.shape(scores)[:1]
        return (ops.broadcast_to(total, queries),
                ops.broadcast_to(ops.cast(any_pair, scores.dtype), queries))


@keras.saving.register_keras_serializable(package="tfaploss")
class ROADMAPLoss(UpperStepArgs, _CalibrationArgs, RetrievalLoss):
    """ROADMAP: ``L = (1 - lambda_) * SupAP + lambda_ * Calibration`` (paper, λ = 0.5).

    SupAP is :class:`~tfaploss.losses.SupAPLoss`, the calibration term
    :class:`CalibrationLoss` over pairs i != j. The authors' code sums both terms with
    weight 1, i.e. twice this loss at ``lambda_=0.5``.

    Cost: that of SupAP, O(B·m·B) time and O(pairs_per_block·B + B²) memory (m =
    largest class in the batch), plus O(B²) for calibration.

    Training from scratch (the authors start from ImageNet weights), the calibration
    term can collapse every embedding to one point: keep the learning rate at 1e-3
    or below, or lower ``lambda_`` (0.1), or train with ``SupAPLoss`` until the
    embeddings spread out (measurements: ``docs/losses.md``, "ROADMAP from scratch").

    Args:
        lambda_: weight of the calibration term, in [0, 1].
        pos_margin, neg_margin, averaging: calibration (see :class:`CalibrationLoss`).
{shared_args}
    """

    def __init__(self, lambda_=0.5, temperature=0.01, rho=100.0, delta=0.05, start=0.5,
                 offset=None, pos_margin=0.9, neg_margin=0.6, averaging="nonzero_pairs",
                 include_self=True, pairs_per_block=None, *, name="roadmap_loss", **kwargs):
        super().__init__(include_self=include_self, name=name, **kwargs)
        self.lambda_ = number("ROADMAPLoss", "lambda_", lambda_, low=0, high=1)
        self._keep_upper_step(temperature, rho, delta, start, offset, pairs_per_block)
        self._keep_margins(pos_margin, neg_margin, averaging)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        ap, counts = sup_ap_per_query(scores, positives, candidates, self.temperature,
                                      self.rho, self.delta, self.start, self.offset,
                                      self.pairs_per_block)
        # Calibration runs over pairs i != j: drop the query itself when it is ranked.
        pair_candidates = self.without_self_pairs(ops.cast(candidates, "bool"), self_pairs)
        others = ops.logical_and(ops.cast(positives, "bool"), pair_candidates)
        calibration = calibration_loss(scores, others, pair_candidates, self.pos_margin,
                                       self.neg_margin, self.averaging)
        # Every valid query carries the batch-level calibration value.
        values = (1.0 - self.lambda_) * (1.0 - ap) + self.lambda_ * calibration
        return values, ops.cast(counts > 0, ap.dtype)
