"""Retrieval metrics as the papers compute them.

Definitions (``R_q`` = number of database items sharing query ``q``'s label, the
query itself not counted; ``rel_q(i)`` = 1 when the item at rank ``i`` (1-based)
is relevant; ``P_q(i)`` = precision of the first ``i`` results):

* ``recall@K`` (ROADMAP / Smooth-AP code): 1 if any of the first K results is
  relevant. Averaged over **every** query; a lone query (``R_q = 0``) counts as a
  miss.
* ``precision@1`` (pytorch-metric-learning): ``rel_q(1)``, averaged over queries
  with ``R_q > 0`` (lone queries excluded).
* ``map@r`` (Musgrave et al. 2020, pytorch-metric-learning):
  ``(1/R_q) sum_{i<=R_q} P_q(i) rel_q(i)``; lone queries excluded.
* ``r_precision``: ``(1/R_q) sum_{i<=R_q} rel_q(i)``; lone queries excluded.
* ``map``: average precision over the full ranking,
  ``(1/R_q) sum_i P_q(i) rel_q(i)``; lone queries excluded. When the ranking is
  truncated to the first ``depth`` results, the positives beyond it contribute 0: the
  value is then a **lower bound**.

The rankings come from :func:`tfaploss.evaluation.retrieval.retrieval_metrics`.
"""


from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tfaploss.evaluation.arrays import as_matrix, check_int

# Rank entries (int64 + float32) materialised per query chunk.
CHUNK_ELEMENTS = 1 << 23


def check_labels(labels, n: int, name: str) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1:
        raise ValueError(f"`{name}` must be a 1-D array of labels; received shape {labels.shape}.")
    if labels.shape[0] != n:
        raise ValueError(f"`{name}` has {labels.shape[0]} entries but there are {n} embeddings.")
    if labels.dtype.kind == "f":
        if not np.all(np.isfinite(labels)) or np.any(labels != np.round(labels)):
            raise ValueError(f"`{name}` holds non-integer floats; labels must be class ids.")
        labels = labels.astype(np.int64)
    return labels


def check_ks(ks) -> tuple[int, ...]:
    ks = tuple(ks)
    if not ks or any(not isinstance(k, (int, np.integer)) or k < 1 for k in ks):
        raise ValueError(f"`ks` must be a non-empty sequence of positive integers; "
                         f"received {ks!r}.")
    return tuple(int(k) for k in ks)


def count_relevant(query_labels, db_labels, exclude=None) -> np.ndarray:
    """``R_q``: database items with the query's label, not counting the item
    ``exclude[q]`` (the query itself in self-retrieval; ``-1`` or ``None``: none)."""
    uniq, counts = np.unique(db_labels, return_counts=True)
    pos = np.clip(np.searchsorted(uniq, query_labels), 0, len(uniq) - 1)
    found = uniq[pos] == query_labels
    r = np.where(found, counts[pos], 0).astype(np.int64)
    if exclude is not None:
        exclude = np.asarray(exclude, np.int64)
        hit = (exclude >= 0) & (db_labels[np.maximum(exclude, 0)] == query_labels)
        r = r - hit.astype(np.int64)
    return r


def per_query_metrics(rel: np.ndarray, num_relevant: np.ndarray, ks: Sequence[int]):
    """Per-query values from a ranked relevance matrix ``rel`` (Q, K) bool and ``R_q``:
    a dict of (Q,) arrays ``hit@K``, ``p@1``, ``ap``, ``ap@r``, ``r_prec`` (0 where
    ``R_q = 0``, to be masked)."""
    q, depth = rel.shape
    relf = rel.astype(np.float64)
    cum = np.cumsum(relf, axis=1)
    ranks = np.arange(1, depth + 1, dtype=np.float64)
    prec_rel = cum / ranks * relf
    r = num_relevant.astype(np.float64)
    safe_r = np.maximum(r, 1.0)
    in_r = np.arange(depth)[None, :] < num_relevant[:, None]
    out = {f"hit@{k}": rel[:, :k].any(axis=1).astype(np.float64) for k in ks}
    out["p@1"] = relf[:, 0] if depth else np.zeros(q)
    out["ap"] = prec_rel.sum(axis=1) / safe_r
    out["ap@r"] = (prec_rel * in_r).sum(axis=1) / safe_r
    out["r_prec"] = (relf * in_r).sum(axis=1) / safe_r
    return out


def metrics_from_ranks(ranks: np.ndarray, query: np.ndarray, num_queries: int,
                       num_relevant: np.ndarray, depth: int, ks: Sequence[int]):
    """The values of :func:`per_query_metrics` from the 1-based ``ranks`` (P,) of the
    positives, sorted by ``(query, rank)``, and the ``query`` of each; positives ranked
    deeper than ``depth`` do not count. Cost: ``O(P)``, against ``O(Q * depth)``.
    """
    ranks = ranks.astype(np.float64)
    counts = np.bincount(query, minlength=num_queries)
    starts = np.cumsum(counts) - counts
    j = np.arange(1, len(ranks) + 1) - starts[query]  # 1-based position among positives
    seen = ranks <= depth
    r = num_relevant.astype(np.float64)
    safe_r = np.maximum(r, 1.0)
    within_r = seen & (ranks <= r[query])
    prec = j / ranks

    def per_query(weights):
        return np.bincount(query, weights=weights, minlength=num_queries)

    first = np.full(num_queries, np.inf)
    has = counts > 0
    first[has] = ranks[starts[has]]
    out = {f"hit@{k}": (first <= min(k, depth)).astype(np.float64) for k in ks}
    out["p@1"] = (first == 1).astype(np.float64)
    out["ap"] = per_query(prec * seen) / safe_r
    out["ap@r"] = per_query(prec * within_r) / safe_r
    out["r_prec"] = per_query(within_r.astype(np.float64)) / safe_r
    return out


def gldv2_map_at_k(retrieved, relevant, k: int = 100) -> float:
    """Google Landmarks v2 retrieval mAP@k (Weyand et al. 2020; the Kaggle metric).

    ``AP@k(q) = (1 / min(m_q, k)) sum_{i<=k} P_q(i) rel_q(i)`` with ``m_q`` the
    number of index images relevant to ``q``; averaged over the queries that have at
    least one relevant image (queries without ground truth are ignored, as in the
    challenge's private set).

    Args:
      retrieved: (Q, >=k) array (or list of sequences) of retrieved ids, best first.
      relevant: length-Q sequence of collections of relevant ids.
    """
    check_int("k", k)
    if len(retrieved) != len(relevant):
        raise ValueError(f"`retrieved` has {len(retrieved)} queries but `relevant` has "
                         f"{len(relevant)}.")
    aps = []
    for ret, rel in zip(retrieved, relevant):
        rel = set(np.asarray(list(rel)).tolist())
        if not rel:
            continue
        ret = list(np.asarray(ret)[:k].tolist())
        hits, score, seen = 0, 0.0, set()
        for i, item in enumerate(ret):
            # A repeated id is counted once, as in the challenge's scorer.
            if item in rel and item not in seen:
                hits += 1
                score += hits / (i + 1)
            seen.add(item)
        aps.append(score / min(len(rel), k))
    if not aps:
        raise ValueError("no query in `relevant` has a relevant image; mAP@k is undefined.")
    return float(np.mean(aps))


def _check_level_labels(labels, n: int, name: str) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim == 1:
        labels = labels[:, None]
    if labels.ndim != 2 or labels.shape[0] != n:
        raise ValueError(f"`{name}` must have shape ({n}, levels), finest level first; "
                         f"received shape {labels.shape}.")
    for column in range(labels.shape[1]):
        check_labels(labels[:, column], n, name)
    return labels


def hierarchical_metrics(query_embeddings, query_labels, db_embeddings=None, db_labels=None,
                         alpha: float = 1.0) -> dict[str, float]:
    """H-AP, ASI and NDCG of exact rankings with multi-level labels (HAPPIER's metrics).

    Ramzi et al., "Hierarchical Average Precision Training for Pertinent Image
    Retrieval", ECCV 2022; the definitions of their ``engine/metrics.py`` (``hap``,
    ``asi``, ``ndcg``; github.com/elias-ramzi/HAPPIER, commit 5af91b3). Labels (Q, L)
    and (N, L), column 0 the finest level; ``level`` of a database item for a query is
    the number of label columns they share (0..L). With ``n`` the 1-based rank and
    ``lev_n``/``rel_n`` the level/relevance of the item at rank n:

    * ``rel`` (the authors' "pop" relevance, as :class:`~tfaploss.losses.HAPLoss`):
      ``w[l] / c_l`` with ``w[l] = (l / (L - 1)) ** alpha`` (``w[1] = 1`` for L = 1)
      and ``c_l`` the number of items at level ``l`` from the query, the query itself
      counted at level L when the query set is the database (their dataset-wide
      relevances include it; it is not ranked).
    * ``h_ap = sum_n H-rank_n / n / sum_n rel_n`` with
      ``H-rank_n = sum_{l=1..L} min(rel_n, r_l) · #{m <= n: rel_m = r_l}`` (``r_l`` the
      query's relevance of level l; this is ``sum_{m <= n} min(rel_m, rel_n)`` unless two
      levels have equal relevance values, which their code then counts twice).
    * ``asi = (1/R) sum_{n=1..R} (1/n) sum_{v} min(#{m <= n: lev_m = v},
      #{m <= n: ideal lev_m = v})`` over the R items with level > 0 (``at_R=True``);
      "ideal" is the ranking by decreasing level.
    * ``ndcg = DCG / IDCG`` with gains ``2 ** lev_n - 1``, discounts ``log2(1 + n)``,
      the full ranking.

    Each is averaged over the queries with at least one item of level > 0 (the
    authors' code would return NaN for the others). Rankings: inner product,
    descending, ties by database index; with ``db_embeddings=None`` the query set is
    the database and each query's own row is removed by index (the authors drop the
    top-1 result instead). Cost: O(Q·N·(D + log N + L)) time, O(chunk·N·L) memory.

    Returns ``{"h_ap", "asi", "ndcg", "num_queries"}``.
    """
    queries = as_matrix(query_embeddings, "query_embeddings")
    self_retrieval = db_embeddings is None
    database = queries if self_retrieval else as_matrix(db_embeddings, "db_embeddings")
    q_labels = _check_level_labels(query_labels, queries.shape[0], "query_labels")
    d_labels = q_labels if self_retrieval else _check_level_labels(
        db_labels, database.shape[0], "db_labels")
    if d_labels.shape[1] != q_labels.shape[1]:
        raise ValueError(f"`db_labels` has {d_labels.shape[1]} levels but `query_labels` has "
                         f"{q_labels.shape[1]}.")
    if not (isinstance(alpha, (int, float)) and alpha > 0):
        raise ValueError(f"`alpha` must be > 0; received {alpha!r}.")
    num_levels = q_labels.shape[1]
    weights = np.array([(lvl / max(num_levels - 1, 1)) ** alpha
                        for lvl in range(num_levels + 1)])
    weights[0] = 0.0
    n_db = database.shape[0]
    chunk = max(1, CHUNK_ELEMENTS // max(n_db * (num_levels + 2), 1))
    sums = {"h_ap": 0.0, "asi": 0.0, "ndcg": 0.0}
    counted = 0
    for start in range(0, queries.shape[0], chunk):
        stop = min(start + chunk, queries.shape[0])
        scores = queries[start:stop] @ database.T
        order = np.argsort(-scores, axis=1, kind="stable")
        levels = np.zeros(scores.shape, np.int64)
        for column in range(num_levels):
            levels += q_labels[start:stop, column][:, None] == d_labels[:, column][None, :]
        if self_retrieval:
            own = np.arange(start, stop)[:, None]
            order = order[order != own].reshape(stop - start, n_db - 1)
        sorted_levels = np.take_along_axis(levels, order, axis=1)
        counts = np.stack([(sorted_levels == lvl).sum(1) for lvl in range(num_levels + 1)], 1)
        counts[:, num_levels] += int(self_retrieval)
        level_rel = np.where(counts > 0, weights[None, :] / np.maximum(counts, 1), 0.0)
        sorted_rel = np.take_along_axis(level_rel, sorted_levels, axis=1)
        valid = (sorted_levels > 0).any(axis=1)
        ranks = np.arange(1, sorted_levels.shape[1] + 1, dtype=np.float64)
        # H-AP
        hrank = np.zeros(sorted_rel.shape)
        for lvl in range(1, num_levels + 1):
            r_l = level_rel[:, lvl:lvl + 1]
            seen = np.cumsum(sorted_rel == r_l, axis=1)
            hrank += np.minimum(sorted_rel, r_l) * seen
        total_rel = sorted_rel.sum(1)
        h_ap = (hrank / ranks).sum(1) / np.where(total_rel > 0, total_rel, 1.0)
        # ASI at R
        ideal = -np.sort(-sorted_levels, axis=1)
        num_rel = (sorted_levels > 0).sum(1)
        si = np.zeros(sorted_levels.shape)
        for lvl in range(1, num_levels + 1):
            si += np.minimum(np.cumsum(sorted_levels == lvl, axis=1),
                             np.cumsum(ideal == lvl, axis=1))
        at_r = (ideal > 0) / ranks
        asi = (si * at_r).sum(1) / np.maximum(num_rel, 1)
        # NDCG
        gains = 2.0 ** sorted_levels - 1.0
        discount = 1.0 / np.log2(1.0 + ranks)
        dcg = (gains * discount).sum(1)
        idcg = ((2.0 ** ideal - 1.0) * discount).sum(1)
        ndcg = dcg / np.where(idcg > 0, idcg, 1.0)
        for key, value in (("h_ap", h_ap), ("asi", asi), ("ndcg", ndcg)):
            sums[key] += float(value[valid].sum())
        counted += int(valid.sum())
    if counted == 0:
        raise ValueError("no query has an item of level > 0 in the database; the "
                         "hierarchical metrics are undefined.")
    return {**{k: v / counted for k, v in sums.items()}, "num_queries": counted}
