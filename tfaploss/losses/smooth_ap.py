"""Smooth-AP (Brown et al., ECCV 2020) and ROADMAP's SupAP (Ramzi et al., NeurIPS 2021);
the kernels are in :mod:`tfaploss.ops.smooth_rank`."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses._checks import integer, positive_number
from tfaploss.losses.base import RetrievalLoss
from tfaploss.ops.smooth_rank import SupAPUpperStep, smooth_ap_per_query, sup_ap_per_query


@keras.saving.register_keras_serializable(package="tfaploss")
class SmoothAPLoss(RetrievalLoss):
    """Smooth-AP (Brown et al., "Smooth-AP: Smoothing the Path Towards Large-Scale
    Image Retrieval", ECCV 2020). For query i and each positive k (the query itself
    included by default):

        rank(i,k)  = 1 + sum_{j != k}         sig(s_ij - s_ik)
        rank+(i,k) = 1 + sum_{j in P_i, j!=k} sig(s_ij - s_ik)
        AP_i = mean_{k in P_i} rank+ / rank,   L = 1 - mean_i AP_i

    with ``sig(t) = sigmoid(clip(t / temperature, -50, 50))`` and ``s`` the cosine
    scores. Unlike the original, classes need not be contiguous equal-size blocks.

    Cost: O(B·m·B) time (m = largest class in the batch) and O(pairs_per_block·B + B²)
    memory (~16 MiB per float32 temporary by default); never a B×B×B tensor
    (measurements: ``docs/losses.md``).

    Args:
        temperature: sigmoid temperature (paper: 0.01).
{shared_args}
    """

    def __init__(self, temperature=0.01, include_self=True, pairs_per_block=None,
                 *, name="smooth_ap_loss", **kwargs):
        super().__init__(include_self=include_self, name=name, **kwargs)
        self.temperature = positive_number("SmoothAPLoss", "temperature", temperature)
        self.pairs_per_block = integer("SmoothAPLoss", "pairs_per_block", pairs_per_block,
                                       optional=True)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        ap, counts = smooth_ap_per_query(scores, positives, candidates, self.temperature,
                                         self.pairs_per_block)
        return 1.0 - ap, ops.cast(counts > 0, ap.dtype)


class UpperStepArgs:
    """The step-rank upper bound's constants and ``pairs_per_block``, checked and kept
    (a mixin of SupAP, ROADMAP and the SupRank losses)."""

    def _keep_upper_step(self, temperature, rho, delta, start, offset, pairs_per_block,
                         temperature_name="temperature"):
        owner = type(self).__name__
        try:
            step = SupAPUpperStep(temperature, rho, delta, start, offset)
        except ValueError as err:
            message = str(err).replace("temperature must", f"{temperature_name} must")
            raise ValueError(f"{owner}: {message}") from None
        setattr(self, temperature_name, step.temperature)
        self.rho, self.delta, self.start = step.rho, step.delta, step.start
        self.offset = None if offset is None else step.offset
        self.pairs_per_block = integer(owner, "pairs_per_block", pairs_per_block,
                                       optional=True)
        return step


@keras.saving.register_keras_serializable(package="tfaploss")
class SupAPLoss(UpperStepArgs, RetrievalLoss):
    """ROADMAP's smooth-rank upper bound "SupAP" (Ramzi et al., "Robust and Decomposable
    Average Precision for Image Retrieval", NeurIPS 2021). As :class:`SmoothAPLoss`, but
    positives ``j`` enter both ranks through the true step ``H(t) = [t >= 0]`` (no
    gradient) and negatives through the upper bound

        H-(t) = sig(t)                      t <= 0
                start + sig(t)              0 < t <= delta
                rho·(t - delta) + offset    t > delta

    ``offset=None`` gives the continuous ``start + sig(delta)``; the authors' SOP config
    uses ``offset=1.44``, their iNaturalist config ``start=0, offset=1.0``. With
    ``start >= 0.5`` and ``offset >= 1``, the loss bounds ``1 - mAP`` from above.

    Cost: as :class:`SmoothAPLoss`, O(B·m·B) time, O(pairs_per_block·B + B²) memory.

    Args:
{shared_args}
    """

    def __init__(self, temperature=0.01, rho=100.0, delta=0.05, start=0.5, offset=None,
                 include_self=True, pairs_per_block=None, *, name="sup_ap_loss", **kwargs):
        super().__init__(include_self=include_self, name=name, **kwargs)
        self._keep_upper_step(temperature, rho, delta, start, offset, pairs_per_block)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        ap, counts = sup_ap_per_query(scores, positives, candidates, self.temperature,
                                      self.rho, self.delta, self.start, self.offset,
                                      self.pairs_per_block)
        return 1.0 - ap, ops.cast(counts > 0, ap.dtype)
