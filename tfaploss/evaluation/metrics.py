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
  truncated to the first ``depth`` results (ScaNN backends, or ``map_depth``), the
  positives beyond it contribute 0: the value is then a **lower bound** and the
  details say so.

Rankings are by inner product, descending, **ties broken by database index** (lower
index first; see :mod:`tfaploss.evaluation.searchers`). When the query set is the
database (``db_embeddings=None``), each query's own row is removed *by index*, so
an exact duplicate of the query elsewhere in the database is still retrieved and
counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tfaploss.evaluation.backend_choice import check_backend
from tfaploss.evaluation.searchers import Searcher, _as_matrix, _check_exclude
from tfaploss.evaluation.tuner import build_searcher

# Rank entries (int64 + float32) materialised per query chunk.
_CHUNK_ELEMENTS = 1 << 23
# Depth searched by the ScaNN backends when `map_depth` is not given (at least the
# largest K and the largest R_q, so recall@K, MAP@R and R-precision stay exact).
DEFAULT_APPROX_DEPTH = 1000


def _check_labels(labels, n: int, name: str) -> np.ndarray:
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


def _check_ks(ks) -> tuple[int, ...]:
    ks = tuple(ks)
    if not ks or any(not isinstance(k, (int, np.integer)) or k < 1 for k in ks):
        raise ValueError(f"`ks` must be a non-empty sequence of positive integers; received {ks!r}.")
    return tuple(int(k) for k in ks)


def count_relevant(query_labels, db_labels, exclude=None) -> np.ndarray:
    """``R_q``: database items with the query's label, not counting the item
    ``exclude[q]`` (the query itself in self-retrieval; ``-1`` or ``None``: none)."""
    uniq, counts = np.unique(db_labels, return_counts=True)
    pos = np.searchsorted(uniq, query_labels)
    pos = np.clip(pos, 0, len(uniq) - 1)
    found = uniq[pos] == query_labels
    r = np.where(found, counts[pos], 0).astype(np.int64)
    if exclude is not None:
        exclude = np.asarray(exclude, np.int64)
        hit = (exclude >= 0) & (db_labels[np.maximum(exclude, 0)] == query_labels)
        r = r - hit.astype(np.int64)
    return r


def per_query_metrics(rel: np.ndarray, num_relevant: np.ndarray, ks: Sequence[int]):
    """Per-query values from a ranked relevance matrix.

    Args:
      rel: (Q, K) bool, ``rel[q, i]`` = result ``i`` (0-based rank) is relevant.
      num_relevant: (Q,) ``R_q``.
      ks: cut-offs for recall@K.

    Returns a dict of (Q,) arrays: ``hit@K``, ``p@1``, ``ap``, ``ap@r``, ``r_prec``
    (undefined where ``R_q = 0``: those entries are 0 and must be masked).
    """
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
    """The values of :func:`per_query_metrics` from the 1-based ranks of the positives.

    Args:
      ranks: (P,) rank of each positive in its query's ranking, sorted by
        ``(query, rank)``.
      query: (P,) query (0 .. num_queries - 1) of each positive.
      num_relevant: (num_queries,) ``R_q``.
      depth: ranking length read; positives ranked deeper do not count.

    Cost: ``O(P)``, against ``O(Q * depth)`` for the relevance matrix.
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


def _rank_positives(scores: np.ndarray, positives: np.ndarray) -> np.ndarray:
    """1-based ranks of ``positives`` (ascending database indices) in one row of
    ``scores``: ``1 + #{higher score} + #{equal score, lower index}``, sorted."""
    v = scores[positives]
    if len(positives) <= 16:  # 2 x 0.06 ns per score and positive: cheaper than a sort
        above = np.array([np.count_nonzero(scores > x) for x in v], np.int64)
        equal = np.array([np.count_nonzero(scores == x) for x in v], np.int64)
    else:
        ordered = np.sort(scores)
        right = np.searchsorted(ordered, v, side="right")
        above = len(scores) - right
        equal = right - np.searchsorted(ordered, v, side="left")
    ranks = 1 + above
    for t in np.flatnonzero(equal > 1):  # exact ties: the lower index goes first
        ranks[t] += np.count_nonzero(scores[:positives[t]] == v[t])
    return np.sort(ranks)


def _exact_rank_metrics(searcher, queries, q_labels, d_labels, exclude, num_relevant,
                        depth, ks, bar):
    """Per-query metrics of an exact search from the ranks of the positives.

    Every metric here is a function of where the positives land, so instead of
    sorting each query's whole ranking, each query block's scores are computed once
    and only the positives are ranked: ``R_q`` comparisons per score for small
    classes, one ``np.sort`` of the scores' values (SIMD, no index payload) for large
    ones. Cost: the product ``Q N D`` plus ``O(Q N min(R, log N))``.
    """
    import threading

    from tfaploss.evaluation.exact_search import score_blocks

    order = np.argsort(d_labels, kind="stable")  # positives of a label, index order
    uniq, starts, counts = np.unique(d_labels[order], return_index=True, return_counts=True)
    pos = np.clip(np.searchsorted(uniq, q_labels), 0, len(uniq) - 1)
    found = uniq[pos] == q_labels
    lock = threading.Lock()

    def block(q0, scores):
        ranks, query = [], []
        for r in range(scores.shape[0]):
            qi = q0 + r
            if not found[qi]:
                continue
            positives = order[starts[pos[qi]]:starts[pos[qi]] + counts[pos[qi]]]
            row = scores[r]
            if exclude is not None and exclude[qi] >= 0:
                row[exclude[qi]] = -np.inf
                positives = positives[positives != exclude[qi]]
            if len(positives):
                ranks.append(_rank_positives(row, positives))
                query.append(np.full(len(positives), r))
        n = scores.shape[0]
        flat = np.concatenate(ranks) if ranks else np.zeros(0, np.int64)
        qid = np.concatenate(query) if query else np.zeros(0, np.int64)
        out = metrics_from_ranks(flat, qid, n, num_relevant[q0:q0 + n], depth, ks)
        if bar is not None:
            with lock:
                bar.add(n)
        return out

    return score_blocks(queries, searcher.database, block, threads=searcher.num_threads)


def _chunk_size(depth: int, num_queries: int) -> int:
    return int(max(1, min(num_queries, _CHUNK_ELEMENTS // max(depth, 1))))


def _searched_metrics(searcher, queries, q_labels, d_labels, exclude, num_relevant, depth,
                      ks, bar):
    """Per-query metrics from a top-``depth`` search (approximate backends)."""
    num_q = queries.shape[0]
    chunk = _chunk_size(depth, num_q)
    parts = []
    for q0 in range(0, num_q, chunk):
        q1 = min(q0 + chunk, num_q)
        idx, _ = searcher.search(queries[q0:q1], depth,
                                 exclude=None if exclude is None else exclude[q0:q1])
        rel = (idx >= 0) & (d_labels[np.maximum(idx, 0)] == q_labels[q0:q1, None])
        parts.append(per_query_metrics(rel, num_relevant[q0:q1], ks))
        if bar is not None:
            bar.update(q1)
    return parts


def retrieval_metrics(query_embeddings, query_labels, db_embeddings=None, db_labels=None,
                      ks=(1, 10, 100), backend="exact", map_depth: int | None = None,
                      searcher: Searcher | None = None, return_details: bool = False,
                      progress: bool = False, exclude=None, **searcher_kwargs):
    """Recall@K, Precision@1, MAP@R, R-precision and mAP of a retrieval.

    Args:
      query_embeddings: (Q, D) float array (L2-normalised for cosine similarity).
      query_labels: (Q,) integer labels.
      db_embeddings, db_labels: the database; ``None`` means the query set is the
        database and each query's own index is removed from its ranking.
      ks: cut-offs for ``recall@K``.
      backend: ``"exact"`` (blocked products; every positive is ranked among all
        scores, no sort of the whole ranking), ``"scann"`` (ScaNN brute force),
        ``"scann_ah"`` (ScaNN tree + AH + reorder), ``"faiss"`` (faiss, flat unless
        ``searcher_kwargs`` name another kind), or ``"auto"`` (exact without a target
        recall, see :func:`~tfaploss.evaluation.backend_choice.resolve_backend`).
        Ignored when ``searcher`` is given.
      map_depth: length of the ranking the metrics read. Default: the full ranking
        for ``"exact"``; ``max(max(ks), max R_q, 1000)`` (capped at the database
        size) for the ScaNN backends. ``map`` is a lower bound whenever the depth is
        shorter than the full ranking; recall@K, MAP@R and R-precision are exact as
        long as the depth is at least K and R_q (and the search is exact).
      searcher: a prebuilt searcher over the database (e.g. from
        :func:`~tfaploss.evaluation.load_searcher`).
      return_details: also return a dict describing how the numbers were obtained.
      progress: show a progress bar over query chunks.
      exclude: with a separate database, one database index per query (``-1``: none)
        removed from that query's ranking and from its ``R_q`` -- e.g. expanded
        queries evaluated against the database they came from.
      **searcher_kwargs: passed to the searcher's constructor.

    Returns:
      dict of floats: ``recall@K`` for each K, ``precision@1``, ``map@r``,
      ``r_precision``, ``map``; with ``return_details=True`` a tuple
      ``(metrics, details)``.

    Cost: exact backend: the product ``O(Q N D)`` plus ranking each query's
    positives among its scores (``R_q`` comparisons per score when ``R_q <= 16``, else
    one sort of the score values), whatever ``map_depth`` is; memory one block of
    scores (64 MB) per thread. ScaNN backends: one search of depth ``map_depth`` per
    query, then ``O(Q * depth)``.
    """
    ks = _check_ks(ks)
    check_backend(backend)
    queries = np.asarray(query_embeddings)
    if queries.ndim != 2:
        raise ValueError(f"`query_embeddings` must be 2-D; received shape {queries.shape}.")
    q_labels = _check_labels(query_labels, queries.shape[0], "query_labels")
    self_retrieval = db_embeddings is None
    if self_retrieval:
        if db_labels is not None:
            raise ValueError("`db_labels` was given without `db_embeddings`.")
        db, d_labels = queries, q_labels
    else:
        if db_labels is None:
            raise ValueError("`db_embeddings` was given without `db_labels`.")
        db = np.asarray(db_embeddings)
        if db.ndim != 2:
            raise ValueError(f"`db_embeddings` must be 2-D; received shape {db.shape}.")
        d_labels = _check_labels(db_labels, db.shape[0], "db_labels")
        if q_labels.dtype.kind != d_labels.dtype.kind and {q_labels.dtype.kind,
                                                            d_labels.dtype.kind} != {"i", "u"}:
            raise ValueError(f"`query_labels` ({q_labels.dtype}) and `db_labels` "
                             f"({d_labels.dtype}) must have comparable dtypes.")

    num_q, n_db = queries.shape[0], db.shape[0]
    if self_retrieval:
        if exclude is not None:
            raise ValueError("`exclude` is only for a separate database; without "
                             "`db_embeddings` each query's own index is removed already.")
        exclude = np.arange(num_q)
    elif exclude is not None:
        exclude = _check_exclude(exclude, num_q, n_db)
    n_avail = n_db - (1 if exclude is not None else 0)
    if num_q == 0 or n_avail < 1:
        raise ValueError(f"need at least one query and one database item to rank; got "
                         f"{num_q} queries and {n_avail} database items.")
    num_relevant = count_relevant(q_labels, d_labels, exclude)
    if not np.any(num_relevant > 0):
        raise ValueError("no query has a relevant item in the database (every label is "
                         "unique); retrieval metrics are undefined.")

    if searcher is None:
        searcher = build_searcher(db, backend, **searcher_kwargs)
    elif searcher.size != n_db:
        raise ValueError(f"`searcher` holds {searcher.size} items but the database has {n_db}.")
    if map_depth is None:
        if searcher.backend == "exact":
            depth = n_avail
        else:
            depth = min(n_avail, max(max(ks), int(num_relevant.max()), DEFAULT_APPROX_DEPTH))
    else:
        if not isinstance(map_depth, (int, np.integer)) or map_depth < 1:
            raise ValueError(f"`map_depth` must be a positive integer; received {map_depth!r}.")
        depth = min(int(map_depth), n_avail)

    bar = None
    if progress:
        import keras

        bar = keras.utils.Progbar(num_q, unit_name="query")
    if searcher.backend == "exact":
        queries = _as_matrix(queries, "query_embeddings")
        if queries.shape[1] != searcher.dim:
            raise ValueError(f"`query_embeddings` have dimension {queries.shape[1]} but the "
                             f"database has dimension {searcher.dim}.")
        parts = _exact_rank_metrics(searcher, queries, q_labels, d_labels, exclude,
                                    num_relevant, depth, ks, bar)
    else:
        parts = _searched_metrics(searcher, queries, q_labels, d_labels, exclude,
                                  num_relevant, depth, ks, bar)
    per_q = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    valid = num_relevant > 0
    metrics = {f"recall@{k}": float(per_q[f"hit@{k}"].mean()) for k in ks}
    metrics["precision@1"] = float(per_q["p@1"][valid].mean())
    metrics["map@r"] = float(per_q["ap@r"][valid].mean())
    metrics["r_precision"] = float(per_q["r_prec"][valid].mean())
    metrics["map"] = float(per_q["ap"][valid].mean())
    if not return_details:
        return metrics
    exact_search = searcher.backend in ("exact", "scann")
    details: dict[str, Any] = {
        "backend": searcher.backend,
        "num_queries": int(num_q),
        "num_database": int(n_db),
        "self_retrieval": bool(self_retrieval),
        "lone_queries": int((~valid).sum()),
        "depth": int(depth),
        "map_is_lower_bound": bool(depth < n_avail or not exact_search),
        "map_r_truncated": bool(depth < int(num_relevant.max())),
        "conventions": {
            "recall@K": "every query counted; a lone query is a miss (ROADMAP)",
            "precision@1, map@r, r_precision, map":
                "queries without a relevant database item excluded (pytorch-metric-learning)",
            "ties": "equal scores ranked by database index, lower first",
            "self": "query removed from its own ranking by index" if self_retrieval
                    else ("separate query and database sets" if exclude is None else
                          "separate query set, one database index removed per query"),
        },
        "per_query": {"ap": per_q["ap"], "num_relevant": num_relevant},
    }
    return metrics, details


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
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"`k` must be a positive integer; received {k!r}.")
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
        _check_labels(labels[:, column], n, name)
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
    queries = _as_matrix(query_embeddings, "query_embeddings")
    self_retrieval = db_embeddings is None
    database = queries if self_retrieval else _as_matrix(db_embeddings, "db_embeddings")
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
    chunk = max(1, _CHUNK_ELEMENTS // max(n_db * (num_levels + 2), 1))
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
