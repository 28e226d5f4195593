"""Plain NumPy references: exact AP and slow, literal versions of the losses.

Meant for tests and for checking a new implementation; every function is written
for clarity (loops and dense tensors), not speed. Inputs are NumPy arrays.
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
