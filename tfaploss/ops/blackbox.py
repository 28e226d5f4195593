"""Black-box differentiated AP (Rolínek, Musil, Paulus, Vlastelica, Michaelis, Martius,
"Optimizing Rank-based Metrics with Blackbox Differentiation", CVPR 2020).

Forward: the exact AP from the ranks. Backward: with ``g = dL/dr``, ``dL/ds = -(r -
rank(s + lambda * g)) / lambda`` (Vlastelica et al., ICLR 2020), ranks normalised by the
number of candidates. Cost: O(Q·N·log N) time (two sorts per row), O(Q·N) memory.
"""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.ops.backend import descending_order, gather_rows, inverse_permutations
from tfaploss.ops.masks import ranked_masks


def _order_and_ranks(scores, candidates):
    """Per row: the indices by decreasing score (ties: lower index first; the
    non-candidates last, at -inf), and each entry's 0-based position."""
    masked = ops.where(candidates, scores, ops.full_like(scores, float("-inf")))
    order = descending_order(masked)
    return order, inverse_permutations(order)


def _ranker(scores, candidates, lambda_, ranks=None):
    lambda_ = float(lambda_)
    candidates = ops.cast(candidates, "bool")

    @ops.custom_gradient
    def ranker(s):
        dtype = s.dtype
        n_cand = ops.maximum(ops.sum(ops.cast(candidates, dtype), axis=-1, keepdims=True), 1.0)

        def normalised(values, int_ranks=None):
            if int_ranks is None:
                _, int_ranks = _order_and_ranks(values, candidates)
            return (ops.cast(int_ranks, dtype) + 1.0) / n_cand

        r = normalised(s, ranks)

        def grad(*args, upstream=None):
            if upstream is None:  # TensorFlow and JAX pass it positionally
                (upstream,) = args
            # Non-candidates sit at -inf: a perturbation cannot move them.
            perturbed = normalised(s + lambda_ * ops.where(candidates, upstream, 0.0))
            return ops.where(candidates, -(r - perturbed) / lambda_, ops.zeros_like(s))

        return r, grad

    return ranker(scores)


def blackbox_ranks(scores, candidates, lambda_=4.0):
    """Normalised descending ranks ``(rank + 1) / n_candidates`` with the black-box
    gradient ``-(r - r(s + lambda * g)) / lambda``.

    Non-candidates are ranked last, receive no gradient, and do not count in the
    normaliser. Cost: O(Q·N·log N) time, O(Q·N) memory.
    """
    return _ranker(scores, candidates, lambda_)


def blackbox_ap(scores, positives, candidates=None, lambda_=4.0, margin=0.0, noise=None):
    """Exact AP per query with the black-box gradient, shape (Q,).

    ``AP_i = sum_{k in P_i} rank+_ik / rank_ik / (|P_i| + 1e-5)``, with ``rank`` the
    position among the candidates and ``rank+`` the position among the positives
    (the ``1e-5`` is the original's). With ``margin > 0`` the ranks are computed on
    ``s - margin * noise * (y - 0.5)``, ``noise`` by default ``|N(0, 1)|``. Only
    ``rank`` carries a gradient, as in the original.

    Cost: O(Q·N·log N) time and O(Q·N) memory, forward and backward.
    """
    scores = ops.convert_to_tensor(scores)
    dtype = scores.dtype
    positives, candidates = ranked_masks(positives, candidates)
    target = ops.cast(positives, dtype)
    if margin:
        if noise is None:
            noise = ops.abs(keras.random.normal(ops.shape(scores), dtype=dtype))
        scores = scores - float(margin) * ops.cast(noise, dtype) * (target - 0.5)
    order, order_ranks = _order_and_ranks(ops.stop_gradient(scores), candidates)
    ranks = _ranker(scores, candidates, lambda_, order_ranks)
    # Position among the positives: cumulative count of positives in ranking order.
    positives_in_order = gather_rows(target, order)
    cum_positives = ops.cumsum(positives_in_order, axis=-1)
    n_cand = ops.maximum(ops.sum(ops.cast(candidates, dtype), axis=-1, keepdims=True), 1.0)
    ranks_within = gather_rows(cum_positives, order_ranks) / n_cand
    ratios = ops.where(positives, ranks_within / ranks, ops.zeros_like(ranks))
    return ops.sum(ratios, axis=-1) / (ops.sum(target, axis=-1) + 1e-5)
