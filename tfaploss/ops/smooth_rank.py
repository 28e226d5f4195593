"""Smooth-rank AP surrogates (Smooth-AP, ROADMAP's SupAP, PNP) on score matrices.

All three rank every positive ``k`` of a query ``i`` among the query's candidates with
a smoothed step function of the score differences ``t = s_ij - s_ik``:

    pos_above[i, k] = sum_{j in P_i, j != k} h_pos(s_ij - s_ik)
    neg_above[i, k] = sum_{j in N_i}          h_neg(s_ij - s_ik)

(``P_i`` the query's positives, ``N_i`` its other candidates). Smooth-AP and SupAP
then take ``AP_i = mean_k (1 + pos_above) / (1 + pos_above + neg_above)``; PNP applies
its penalty ``f`` to ``neg_above``.

Only the positive pairs are ranked, in blocks with a hand-written gradient
(:mod:`tfaploss.ops.pair_blocks`; costs in :func:`positive_rank_terms`): never the dense
Q x N x N tensor (64 GiB at B=4096). On TensorFlow use a non-persistent
``tf.GradientTape`` (as Keras does): a persistent one keeps every block, O(P·N) memory.
"""

from __future__ import annotations

import math

from keras import ops

from tfaploss.ops.masks import masked_mean, ranked_masks
from tfaploss.ops.pair_blocks import Blocks, blocked_rank_terms, pair_gaps, pair_values

_CLIP = 50.0  # sigmoid argument clip of the Smooth-AP/ROADMAP/PNP code

PNP_VARIANTS = ("O", "Iu", "Ib", "Ds", "Dq")


def sigmoid_tau(t, temperature):
    """``sigmoid(clip(t / temperature, -50, 50))``, the originals' smoothed step."""
    return ops.sigmoid(ops.clip(t / temperature, -_CLIP, _CLIP))


def _check_temperature(temperature):
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a positive number; received {temperature!r}.")
    return float(temperature)


class SigmoidStep:
    """Smoothed step ``sigmoid(clip(t / temperature, -50, 50))`` (Smooth-AP, PNP)."""

    differentiable = True

    def __init__(self, temperature=0.01):
        self.temperature = _check_temperature(temperature)
        self.key = ("sigmoid", self.temperature)

    def value(self, t):
        return sigmoid_tau(t, self.temperature)

    def value_and_slope(self, t):
        z = t / self.temperature
        v = ops.sigmoid(ops.clip(z, -_CLIP, _CLIP))
        # Zero slope past the clip, as the originals' autograd.
        slope = ops.where(ops.abs(z) <= _CLIP, v * (1.0 - v) / self.temperature,
                          ops.zeros_like(v))
        return v, slope


class HeavisideStep:
    """True step ``[t >= 0]`` with no gradient (SupAP's positive pairs)."""

    differentiable = False
    key = ("heaviside",)

    def value(self, t):
        return ops.cast(t >= 0, t.dtype)

    def value_and_slope(self, t):
        v = self.value(t)
        return v, ops.zeros_like(v)


class SupAPUpperStep:
    """ROADMAP's upper bound of the step, used on negative pairs: ``sigma_tau(t)`` for
    ``t <= 0``, ``start + sigma_tau(t)`` on ``(0, delta]``, ``rho * (t - delta) +
    offset`` beyond (``offset=None``: continuous, ``start + sigma_tau(delta)``). It
    bounds ``[t > 0]`` from above whenever ``start >= 0.5`` and ``offset >= 1``."""

    differentiable = True

    def __init__(self, temperature=0.01, rho=100.0, delta=0.05, start=0.5, offset=None):
        self.temperature = _check_temperature(temperature)
        for name, val in (("rho", rho), ("delta", delta), ("start", start)):
            if not isinstance(val, (int, float)) or val < 0:
                raise ValueError(f"{name} must be a non-negative number; received {val!r}.")
        self.rho, self.delta, self.start = float(rho), float(delta), float(start)
        if offset is None:
            z = max(-_CLIP, min(_CLIP, self.delta / self.temperature))
            offset = self.start + 1.0 / (1.0 + math.exp(-z))
        elif not isinstance(offset, (int, float)):
            raise ValueError(f"offset must be a number or None; received {offset!r}.")
        self.offset = float(offset)
        self.key = ("supap_upper", self.temperature, self.rho, self.delta, self.start,
                    self.offset)

    def value_and_slope(self, t):
        sig, sig_slope = SigmoidStep(self.temperature).value_and_slope(t)
        value = ops.where(t <= 0, sig,
                          ops.where(t <= self.delta, self.start + sig,
                                    self.rho * (t - self.delta) + self.offset))
        slope = ops.where(t > self.delta, ops.full_like(t, self.rho), sig_slope)
        return value, slope

    def value(self, t):
        return self.value_and_slope(t)[0]


def _block_kernels(positive_step, negative_step):
    """The block kernel (:mod:`tfaploss.ops.pair_blocks`) of the positive pairs'
    ``(pos_sums, neg_sums)``."""
    use_positive = positive_step is not None
    same_step = positive_step is negative_step
    pos_slopes = use_positive and positive_step.differentiable

    def masked_row_sum(mask, values):
        return ops.sum(ops.where(mask, values, ops.zeros_like(values)), axis=1)

    def forward(s, kind, flat, valid):
        _, t, kinds = pair_gaps(s, kind, flat)
        zero = ops.zeros_like(t[:, 0])
        neg_values = negative_step.value(t)
        neg = ops.where(valid, masked_row_sum(kinds == 2, neg_values), zero)
        if not use_positive:
            return zero, neg
        # The positives' sum runs over j = k too (t = 0): its term is taken off after,
        # cheaper than masking the diagonal of every block.
        pos_values = neg_values if same_step else positive_step.value(t)
        self_term = positive_step.value(ops.zeros((), s.dtype))
        pos = masked_row_sum(kinds == 1, pos_values) - self_term
        return ops.where(valid, pos, zero), neg

    def backward(s, kind, flat, valid, g_pos, g_neg):
        rows, t, kinds = pair_gaps(s, kind, flat)
        _, slope = negative_step.value_and_slope(t)
        g_n = pair_values(g_neg, flat, valid)[:, None]
        if pos_slopes:
            # Includes j = k, whose row and pair contributions cancel.
            g_p = pair_values(g_pos, flat, valid)[:, None]
            if same_step:
                w = ops.where(kinds == 2, g_n, ops.where(kinds == 1, g_p, 0.0 * g_p)) * slope
            else:
                _, p_slope = positive_step.value_and_slope(t)
                w = (ops.where(kinds == 2, g_n * slope, ops.zeros_like(t))
                     + ops.where(kinds == 1, g_p * p_slope, ops.zeros_like(t)))
        else:
            w = ops.where(kinds == 2, g_n * slope, ops.zeros_like(t))
        return rows, w, -ops.sum(w, axis=1)

    return forward, backward


def positive_rank_terms(scores, positives, candidates, positive_step, negative_step,
                        pairs_per_block=None):
    """Smoothed counts of positives and negatives ranked above each positive pair.

    Args:
        scores: (Q, N) float scores (higher = more similar).
        positives: (Q, N) bool, relevant items (limited to ``candidates``).
        candidates: (Q, N) bool, items that take part in query i's ranking.
        positive_step: step of ``s_ij - s_ik`` for positives ``j != k`` (``None``:
            that sum is all zeros).
        negative_step: step for the negatives ``j`` (candidates not positives).
        pairs_per_block: positive pairs ranked per loop step; ``None``: about ``4M / N``.

    Returns:
        ``(pos_above, neg_above)``, both (Q, N); entry (i, k) holds the sums for the
        positive pair (i, k) and is 0 elsewhere.

    Cost: O(P·N) time (P positive pairs), O(pairs_per_block·N + Q·N) memory, forward
    and backward alike.
    """
    scores = ops.convert_to_tensor(scores)
    positives, candidates = ranked_masks(positives, candidates)
    # One int8 code per item (1 positive, 2 negative, 0 not ranked): one byte gathered.
    kind = ops.where(positives, ops.ones_like(positives, "int8"),
                     ops.where(candidates, ops.full_like(positives, 2, "int8"),
                               ops.zeros_like(positives, "int8")))
    key = (None if positive_step is None else positive_step.key, negative_step.key,
           positive_step is negative_step)
    return blocked_rank_terms(scores, kind, Blocks(positives, pairs_per_block),
                              positive_step is not None, key,
                              *_block_kernels(positive_step, negative_step))


def _positive_count(positives, candidates):
    positives, _ = ranked_masks(positives, candidates)
    return positives, ops.sum(ops.cast(positives, "int32"), axis=1)


def _ap_per_query(scores, positives, candidates, positive_step, negative_step,
                  pairs_per_block):
    """``(mean_k rank+ / rank, num_positives)`` per query, the ranks from the steps."""
    positives, counts = _positive_count(positives, candidates)
    pos_above, neg_above = positive_rank_terms(scores, positives, candidates, positive_step,
                                               negative_step, pairs_per_block)
    # rank+/rank written as 1 - neg/rank: exactly 1, with exactly zero gradient, when
    # no negative is ranked (an all-positive batch).
    precision = 1.0 - neg_above / (1.0 + pos_above + neg_above)
    return masked_mean(precision, positives, axis=1), counts


def smooth_ap_per_query(scores, positives, candidates, temperature=0.01,
                        pairs_per_block=None):
    """Smooth-AP (Brown et al., ECCV 2020) of every query.

    ``AP_i = 1/|P_i| sum_{k in P_i} (1 + sum_{j in P_i, j!=k} sig(s_ij - s_ik))
    / (1 + sum_{j in C_i, j!=k} sig(s_ij - s_ik))`` with
    ``sig(t) = sigmoid(clip(t / temperature, -50, 50))``.

    Returns ``(ap, num_positives)``, each (Q,); ``ap`` is 0 where a query has no
    positive. Cost: O(P·N) time, O(pairs_per_block·N + Q·N) memory.
    """
    step = SigmoidStep(temperature)
    return _ap_per_query(scores, positives, candidates, step, step, pairs_per_block)


def sup_ap_per_query(scores, positives, candidates, temperature=0.01, rho=100.0,
                     delta=0.05, start=0.5, offset=None, pairs_per_block=None):
    """ROADMAP's SupAP (Ramzi et al., NeurIPS 2021) of every query.

    As Smooth-AP, but positives ``j`` enter both ranks through the true step
    ``[s_ij >= s_ik]`` (no gradient) and negatives through :class:`SupAPUpperStep`.

    Returns ``(ap, num_positives)``, each (Q,). Cost as :func:`smooth_ap_per_query`.
    """
    upper = SupAPUpperStep(temperature, rho, delta, start, offset)
    return _ap_per_query(scores, positives, candidates, HeavisideStep(), upper,
                         pairs_per_block)


def pnp_penalty(r, variant="Dq", b=2.0, alpha=4.0):
    """PNP's penalty f(R) of the smooth count R of negatives above a positive."""
    if variant == "O":
        return r
    if variant == "Iu":
        return (1.0 + r) * ops.log1p(r)
    if variant == "Ib":
        return (b * r - ops.log1p(b * r)) / (b * b)
    if variant == "Ds":
        return ops.log1p(r)
    if variant == "Dq":
        return 1.0 - ops.power(1.0 + r, -alpha)
    raise ValueError(f"variant must be one of {PNP_VARIANTS}; received {variant!r}.")


def pnp_per_query(scores, positives, candidates, variant="Dq", b=2.0, alpha=4.0,
                  temperature=0.01, pairs_per_block=None):
    """PNP (Li et al., AAAI 2022) loss of every query: ``mean_{k in P_i} f(R_ik)``.

    ``R_ik = sum_{j in N_i} sigmoid(clip((s_ij - s_ik) / temperature, -50, 50))``
    counts the negatives ranked above positive k; ``f`` is the variant's penalty
    (``"Dq"``: ``1 - (1 + R)^-alpha``, so the loss is ``1 - mean (1 + R)^-alpha``).

    Returns ``(values, num_positives)``, each (Q,). Cost: O(P·N) time,
    O(pairs_per_block·N + Q·N) memory.
    """
    if variant not in PNP_VARIANTS:
        raise ValueError(f"variant must be one of {PNP_VARIANTS}; received {variant!r}.")
    positives, counts = _positive_count(positives, candidates)
    _, neg_above = positive_rank_terms(scores, positives, candidates, None,
                                       SigmoidStep(temperature), pairs_per_block)
    return masked_mean(pnp_penalty(neg_above, variant, b, alpha), positives, axis=1), counts
