"""Retrieval metrics of embeddings: rank the database for each query with a searcher,
then score the rankings (:mod:`tfaploss.evaluation.metrics` defines the metrics).
Ties are broken by database index; in self-retrieval each query's own row is removed
*by index*, so an exact duplicate of it is still retrieved and counted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tfaploss.evaluation.arrays import as_matrix, check_exclude, check_int
from tfaploss.evaluation.exact_topk import score_blocks
from tfaploss.evaluation.metrics import (
    CHUNK_ELEMENTS,
    check_ks,
    check_labels,
    count_relevant,
    metrics_from_ranks,
    per_query_metrics,
)
from tfaploss.evaluation.search import build_searcher
from tfaploss.evaluation.search_plan import SearchPlan
from tfaploss.evaluation.searchers import Searcher

__all__ = ["DEFAULT_APPROX_DEPTH", "retrieval_metrics"]

# Depth searched by the approximate backends when `map_depth` is not given (at least the
# largest K and the largest R_q, so recall@K, MAP@R and R-precision stay exact).
DEFAULT_APPROX_DEPTH = 1000


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
    """Per-query metrics of an exact search from the ranks of the positives alone (no
    sort of the whole ranking). Cost: the product ``Q N D`` plus ``O(Q N min(R, log N))``.
    """
    import threading

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


def _searched_metrics(searcher, queries, q_labels, d_labels, exclude, num_relevant, depth,
                      ks, bar):
    """Per-query metrics from a top-``depth`` search (approximate backends)."""
    num_q = queries.shape[0]
    chunk = int(max(1, min(num_q, CHUNK_ELEMENTS // max(depth, 1))))
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
      backend: a backend name (``"exact"``, ``"scann"``, ``"scann_ah"``, ``"faiss"``,
        ``"auto"``) or a :class:`~tfaploss.evaluation.search_plan.SearchPlan`; ignored
        when ``searcher`` is given.
      map_depth: length of the ranking the metrics read. Default: the full ranking
        for exact search, else ``max(max(ks), max R_q, 1000)`` (capped at the database
        size). ``map`` is a lower bound when the depth is shorter than the ranking;
        recall@K, MAP@R and R-precision stay exact while it is at least K and R_q.
      searcher: a prebuilt searcher over the database.
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

    Cost: exact search: the product ``O(Q N D)`` plus ranking each query's positives
    (``R_q`` comparisons per score when ``R_q <= 16``, else one sort of the scores),
    whatever ``map_depth`` is; memory one block of scores (64 MB) per thread. Other
    backends: one search of depth ``map_depth`` per query, then ``O(Q * depth)``.
    """
    ks = check_ks(ks)
    plan = SearchPlan.of(backend)
    queries = np.asarray(query_embeddings)
    if queries.ndim != 2:
        raise ValueError(f"`query_embeddings` must be 2-D; received shape {queries.shape}.")
    q_labels = check_labels(query_labels, queries.shape[0], "query_labels")
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
        d_labels = check_labels(db_labels, db.shape[0], "db_labels")
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
        exclude = check_exclude(exclude, num_q, n_db)
    n_avail = n_db - (1 if exclude is not None else 0)
    if num_q == 0 or n_avail < 1:
        raise ValueError(f"need at least one query and one database item to rank; got "
                         f"{num_q} queries and {n_avail} database items.")
    num_relevant = count_relevant(q_labels, d_labels, exclude)
    if not np.any(num_relevant > 0):
        raise ValueError("no query has a relevant item in the database (every label is "
                         "unique); retrieval metrics are undefined.")

    if searcher is None:
        searcher = build_searcher(db, plan, **searcher_kwargs)
    elif searcher.size != n_db:
        raise ValueError(f"`searcher` holds {searcher.size} items but the database has {n_db}.")
    if map_depth is not None:
        depth = min(check_int("map_depth", map_depth), n_avail)
    elif searcher.backend == "exact":
        depth = n_avail
    else:
        depth = min(n_avail, max(max(ks), int(num_relevant.max()), DEFAULT_APPROX_DEPTH))

    bar = None
    if progress:
        import keras

        bar = keras.utils.Progbar(num_q, unit_name="query")
    if searcher.backend == "exact":
        queries = as_matrix(queries, "query_embeddings")
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
    for name, key in (("precision@1", "p@1"), ("map@r", "ap@r"), ("r_precision", "r_prec"),
                      ("map", "ap")):
        metrics[name] = float(per_q[key][valid].mean())
    if not return_details:
        return metrics
    exact_search = searcher.backend in ("exact", "scann")
    details: dict[str, Any] = {
        "backend": searcher.backend, "num_queries": int(num_q), "num_database": int(n_db),
        "self_retrieval": bool(self_retrieval), "lone_queries": int((~valid).sum()),
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
