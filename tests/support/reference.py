"""Plain NumPy references: exact AP and slow, literal versions of the losses.

The tests check the losses against these (``from tests.support import reference``; also a
place to check a new implementation); every function is written for clarity (loops
and dense tensors), not speed. Inputs are NumPy arrays.
"""

from __future__ import annotations

import numpy as np


def average_precision(scores, relevant):
    """Exact AP of one ranking: ``mean_{k relevant} (#relevant ranked <= k) / rank_k``.

    Ties are broken by position (a stable sort on decreasing score). NaN when
    nothing is relevant.
    """
    scores = np.asarray(scores, dtype=np.float64)
    relevant = np.asarray(relevant, dtype=bool)
    if not relevant.any():
        return float("nan")
    order = np.argsort(-scores, kind="stable")
    hits = relevant[order]
    ranks = np.arange(1, len(hits) + 1)
    precision = np.cumsum(hits) / ranks
    return float(precision[hits].mean())


def batch_average_precision(embeddings, labels, include_self=False, normalize=True):
    """Per-query exact AP of a batch ranked against itself, shape (B,).

    ``include_self=False``: each query ranks the OTHER items (the histogram-AP and
    FastAP convention); ``True``: the query is in its own ranking and counts as its
    own positive (Smooth-AP / ROADMAP / BlackBox). NaN for queries without positives.
    """
    x = np.asarray(embeddings, dtype=np.float64)
    if normalize:
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
    labels = np.asarray(labels).reshape(-1)
    s = x @ x.T
    out = np.empty(len(labels))
    for i in range(len(labels)):
        keep = np.ones(len(labels), bool)
        if not include_self:
            keep[i] = False
        out[i] = average_precision(s[i, keep], labels[keep] == labels[i])
    return out


def soft_bins_dense(scores, num_bins=20, score_range=(-1.0, 1.0)):
    """Triangular soft assignment of every score to every bin, shape (..., M).

    The paper's quantiser: centres ``hi - m * delta`` top first, edge bins saturate.
    """
    lo, hi = score_range
    delta = (hi - lo) / (num_bins - 1)
    centres = hi - delta * np.arange(num_bins)
    s = np.asarray(scores, dtype=np.float64)[..., None]
    q = np.maximum(0.0, 1.0 - np.abs(s - centres) / delta)
    q[..., 0] = np.where(s[..., 0] >= hi, 1.0, q[..., 0])
    q[..., -1] = np.where(s[..., 0] <= lo, 1.0, q[..., -1])
    return q


def histogram_ap_dense(scores, relevance, candidates=None, num_bins=20,
                       score_range=(-1.0, 1.0), tie_aware=None):
    """Histogram AP per query from the dense (Q, N, M) quantisation (Revaud et al.).

    ``tie_aware``: None (AP_Q), ``"simplified"`` (Eq. 13) or ``"full"`` (the
    authors' default). NaN for queries without relevant items.
    """
    s = np.asarray(scores, dtype=np.float64)
    rel = np.asarray(relevance, dtype=bool)
    cand = np.ones_like(rel) if candidates is None else np.asarray(candidates, dtype=bool)
    rel = rel & cand
    q = soft_bins_dense(s, num_bins, score_range) * cand[..., None]
    c = q.sum(axis=1)
    cp = (q * rel[..., None]).sum(axis=1)
    n_pos = rel.sum(axis=1).astype(np.float64)
    big_c, big_cp = np.cumsum(c, 1), np.cumsum(cp, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        if tie_aware is None:
            terms = np.where(big_c > 0, big_cp / np.where(big_c > 0, big_c, 1), 0) * cp
        else:
            prev_c, prev_cp = big_c - c, big_cp - cp
            if tie_aware == "simplified":
                terms = cp * (prev_cp + big_cp + 1) / (prev_c + big_c + 1)
            else:
                eps = 1e-8
                r = np.maximum(cp - 1, 0) / (np.maximum(c - 1, 0) + eps)
                terms = cp * (c * r + (prev_cp + 1 - r * (prev_c + 1))
                              * np.log((big_c + 1) / (prev_c + 1))) / (c + eps)
        return terms.sum(axis=1) / n_pos


def fastap_reference(embeddings, labels, num_bins=10):
    """FastAP loss as Kun He's original forward pass computes it (self excluded)."""
    x = np.asarray(embeddings, dtype=np.float64)
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    y = np.asarray(labels).reshape(-1)
    d2 = 2.0 - 2.0 * x @ x.T
    same = y[:, None] == y[None, :]
    eye = np.eye(len(y), dtype=bool)
    pos, neg = same & ~eye, ~same
    delta = 4.0 / num_bins
    centres = np.linspace(0.0, 4.0, num_bins + 1)
    pulse = np.maximum(0.0, 1.0 - np.abs(d2[..., None] - centres) / delta)
    h_pos = (pulse * pos[..., None]).sum(1)
    h = h_pos + (pulse * neg[..., None]).sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        fast = h_pos * np.cumsum(h_pos, 1) / np.cumsum(h, 1)
        fast[~np.isfinite(fast)] = 0.0
        fast = fast.sum(1) / pos.sum(1)
    return 1.0 - np.mean(fast[pos.sum(1) > 0])


def pairwise_distances(embeddings, normalize=True):
    x = np.asarray(embeddings, dtype=np.float64)
    if normalize:
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
    sq = (x * x).sum(1)
    return np.sqrt(np.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0.0))


def contrastive_reference(embeddings, labels, margin=1.0):
    """TF Addons' contrastive loss averaged over ordered pairs i != j."""
    d = pairwise_distances(embeddings)
    y = np.asarray(labels).reshape(-1)
    same = y[:, None] == y[None, :]
    off = ~np.eye(len(y), dtype=bool)
    keep = off & (same & off).any(1, keepdims=True)
    loss = np.where(same, d**2, np.maximum(margin - d, 0.0) ** 2)
    return loss[keep].mean()


def contrastive_per_query_reference(embeddings, labels, margin=1.0):
    """The balanced contrastive loss, one query at a time: the mean of d² over its
    positives plus the mean of max(margin - d, 0)² over its negatives, averaged over
    the queries that have a positive."""
    d = pairwise_distances(embeddings)
    y = np.asarray(labels).reshape(-1)
    terms = []
    for i in range(len(y)):
        others = np.arange(len(y)) != i
        pos, neg = others & (y == y[i]), y != y[i]
        if pos.any():
            neg_mean = (np.maximum(margin - d[i, neg], 0.0) ** 2).mean() if neg.any() else 0.0
            terms.append((d[i, pos] ** 2).mean() + neg_mean)
    return float(np.mean(terms))


def triplet_semihard_reference(embeddings, labels, margin=1.0):
    """TF Addons ``triplet_semihard_loss`` written as explicit loops."""
    d = pairwise_distances(embeddings)
    y = np.asarray(labels).reshape(-1)
    total, count = 0.0, 0
    for a in range(len(y)):
        negs = d[a, y != y[a]]
        for p in range(len(y)):
            if p == a or y[p] != y[a]:
                continue
            outside = negs[negs > d[a, p]]
            n = outside.min() if outside.size else negs.max()
            total += max(margin + d[a, p] - n, 0.0)
            count += 1
    return total / count


def triplet_hard_reference(embeddings, labels, margin=1.0):
    """TF Addons ``triplet_hard_loss`` (soft=False) over anchors with a positive."""
    d = pairwise_distances(embeddings)
    y = np.asarray(labels).reshape(-1)
    out = []
    for a in range(len(y)):
        pos = (y == y[a]) & (np.arange(len(y)) != a)
        if pos.any():
            out.append(max(d[a, pos].max() - d[a, y != y[a]].min() + margin, 0.0))
    return float(np.mean(out))


def triplet_all_reference(embeddings, labels, margin=1.0):
    """Mean of ``max(d_ap - d_an + margin, 0)`` over every valid triplet."""
    d = pairwise_distances(embeddings)
    y = np.asarray(labels).reshape(-1)
    same = y[:, None] == y[None, :]
    pos = same & ~np.eye(len(y), dtype=bool)
    t = np.maximum(d[:, :, None] - d[:, None, :] + margin, 0.0)
    valid = pos[:, :, None] & ~same[:, None, :]
    return t[valid].mean()


# -- the originals' batch losses, lone queries included (float64, dense) ---------------


def _unit_scores(embeddings, normalize=True):
    x = np.asarray(embeddings, dtype=np.float64)
    if normalize:
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
    return x @ x.T


def _mean_over(values, queries):
    values = np.asarray(values, dtype=np.float64)
    return float(np.mean(values if queries is None else values[np.asarray(queries, bool)]))


def histogram_ap_loss_reference(embeddings, labels, num_bins=20, score_range=(-1.0, 1.0),
                                tie_aware=None, queries=None):
    """``1 - mAP`` of Revaud et al.'s ``APLoss`` on a batch, the query in its own list.

    As the authors' training code: scores ``x xᵀ`` of the normalised batch, relevance
    ``y_i == y_j`` with the diagonal kept, every query in the mean (a query alone in
    its class has one positive: itself). ``queries``: a boolean mask of the queries
    to average over instead (None: all).
    """
    y = np.asarray(labels).reshape(-1)
    ap = histogram_ap_dense(_unit_scores(embeddings), y[:, None] == y[None, :],
                            num_bins=num_bins, score_range=score_range, tie_aware=tie_aware)
    return 1.0 - _mean_over(ap, queries)


def sigmoid_step(temperature=0.01):
    """The originals' ``sigmoid(clip(t / temperature, -50, 50))``."""
    return lambda t: 1.0 / (1.0 + np.exp(-np.clip(t / temperature, -50.0, 50.0)))


def heaviside_step(t):
    """ROADMAP's ``heaviside(t)`` with value 1 at 0."""
    return (t >= 0).astype(np.float64)


def sup_ap_upper_step(temperature=0.01, rho=100.0, delta=0.05, start=0.5, offset=None):
    """ROADMAP's upper bound of the step on negative pairs (see ``SupAPLoss``)."""
    if offset is None:
        offset = start + 1.0 / (1.0 + np.exp(-min(delta / temperature, 50.0)))
    sig = sigmoid_step(temperature)
    return lambda t: np.where(t <= 0, sig(t), np.where(t <= delta, start + sig(t),
                                                       rho * (t - delta) + offset))


def smooth_rank_ap_loss_reference(embeddings, labels, positive_step, negative_step,
                                  queries=None):
    """``1 - mean_i AP_i`` of ROADMAP's Smooth-AP/SupAP code, dense (B, B, B).

    Every item is in every query's ranking (the query too, as its own positive);
    ``AP_i = mean_{k in P_i} (1 + sum_{j in P_i, j!=k} h+(s_ij - s_ik))
    / (1 + sum_{j in P_i, j!=k} h+(.) + sum_{j not in P_i} h-(.))``; every query counts.
    """
    s = _unit_scores(embeddings)
    y = np.asarray(labels).reshape(-1)
    same = y[:, None] == y[None, :]
    t = s[:, None, :] - s[:, :, None]  # t[i, k, j] = s_ij - s_ik
    not_k = ~np.eye(len(y), dtype=bool)[None]
    pos = (positive_step(t) * (same[:, None, :] & not_k)).sum(-1)
    neg = (negative_step(t) * ~same[:, None, :]).sum(-1)
    precision = (1.0 + pos) / (1.0 + pos + neg)
    ap = (precision * same).sum(1) / same.sum(1)
    return 1.0 - _mean_over(ap, queries)


def pnp_dq_loss_reference(embeddings, labels, alpha=4.0, temperature=0.01, queries=None):
    """PNP-Dq (Li et al.): ``mean_i mean_{k in P_i} 1 - (1 + R_ik)^-alpha``, dense.

    ``R_ik`` sums ``sigmoid_tau(s_ij - s_ik)`` over the negatives j of query i; the
    query is its own positive (k = i included), as the authors' code.
    """
    s = _unit_scores(embeddings)
    y = np.asarray(labels).reshape(-1)
    same = y[:, None] == y[None, :]
    t = s[:, None, :] - s[:, :, None]
    r = (sigmoid_step(temperature)(t) * ~same[:, None, :]).sum(-1)
    values = ((1.0 - (1.0 + r) ** -alpha) * same).sum(1) / same.sum(1)
    return _mean_over(values, queries)


def blackbox_ap_reference(scores, relevance, lambda_=4.0, queries=None):
    """ROADMAP's BlackBoxAP (margin 0): the loss and its black-box ``dL/dS``.

    Ranks of all N items normalised by N (ties by index), ``AP_i = sum_{k in P_i}
    rank+_ik / rank_ik / (|P_i| + 1e-5)``, ``L = 1 - mean_i AP_i`` over every query;
    backward ``-(r - rank(s + lambda dL/dr)) / lambda``. ``queries``: a boolean mask
    of the queries to average over (None: all).
    """
    s = np.asarray(scores, dtype=np.float64)
    t = np.asarray(relevance, dtype=np.float64)
    n = s.shape[1]
    keep = np.ones(len(s), bool) if queries is None else np.asarray(queries, bool)

    def rank_normalised(v):
        return (np.argsort(np.argsort(-v, axis=1, kind="stable"), axis=1) + 1) / n

    r = rank_normalised(s)
    order = np.argsort(-s, axis=1, kind="stable")
    cum = np.cumsum(np.take_along_axis(t, order, 1), 1)
    within = np.take_along_axis(cum, np.argsort(order, 1), 1) / n
    denom = t.sum(1) + 1e-5
    loss = 1.0 - np.mean(((within / r * t).sum(1) / denom)[keep])
    g = (within / r**2) * t / denom[:, None] / keep.sum() * keep[:, None]  # dL/dr
    return float(loss), -(r - rank_normalised(s + lambda_ * g)) / lambda_


def score_gradient_to_embeddings(embeddings, d_scores, normalize=True):
    """Chain ``dL/dS`` of ``S = n nᵀ`` (``n`` the normalised rows) back to ``dL/dx``."""
    x = np.asarray(embeddings, dtype=np.float64)
    norm = np.linalg.norm(x, axis=1, keepdims=True) if normalize else np.ones((len(x), 1))
    n = x / norm
    d_n = (d_scores + d_scores.T) @ n
    if not normalize:
        return d_n
    return (d_n - (d_n * n).sum(1, keepdims=True) * n) / norm


def numerical_gradient(fn, x, h=1e-6):
    """Central finite differences of a scalar ``fn`` at ``x`` (float64)."""
    x = np.array(x, dtype=np.float64)
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[index] = h
        grad[index] = (fn(x + step) - fn(x - step)) / (2 * h)
    return grad
