"""Exact inner-product top-k on the CPU: blocked BLAS products + a threshold top-k.

The cost of exact search is the product ``queries x database^T`` (``Q N D``
multiply-adds); everything else must stay small beside it. A full ``argsort`` or
``argpartition`` of every score costs 2-3 ns per score on one core, as much as the
product itself at D = 128, so the selection here touches most scores only once, with
one comparison:

* The database is read in blocks of ``database_block`` rows, in index order. Each
  query row keeps its running top-k and its k-th best score ``t``. In a new block
  only the scores ``> t`` can enter (an equal score loses: the kept one has a lower
  index), and after the first blocks very few do (about ``k * block / seen``), so
  the work per score is one compare plus a scan of a nearly empty mask (~0.2 ns).
* The first block of a row (``t = -inf``) and any row that lets through more than
  ``4 k`` candidates (adversarial orders, e.g. a database sorted by score) are cut
  first by ``np.partition`` to the block's own k best; so a block never costs more
  than a partition.
* Candidates are merged with the running top-k by a *stable* sort on the score:
  the kept entries come first and have lower indices, new ones follow in index
  order, so ties end up ordered by index without an index key.

Query blocks (and, when there are too few of them, database shards) run in a
thread pool with single-threaded BLAS, so the selection runs in parallel too; the
products release the GIL. Memory: ``threads x query_block x database_block`` scores.

:func:`score_blocks` exposes the blocked products alone, for callers that need all
scores of a query block once (e.g. ranking every positive for mAP).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

QUERY_BLOCK = 512
DATABASE_BLOCK = 8192  # 512 x 8192: ~8 % faster than 256 x 4096 (larger GEMMs)
_HEAVY_FACTOR = 4  # a row with more than 4 k candidates in a block is partitioned first


def available_threads() -> int:
    """CPU cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def single_threaded_blas(active: bool):
    """Limit BLAS to one thread while our own thread pool runs (threadpoolctl if
    installed; without it the pool is not used and BLAS keeps its threads)."""
    if not active:
        yield
        return
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _threadpoolctl_available() -> bool:
    try:
        import threadpoolctl  # noqa: F401
    except ImportError:
        return False
    return True


def merge_sorted_topk(parts_s, parts_i, k: int):
    """Top-k of the column-concatenation of ``parts``, each (R, *) sorted by score
    (descending) with ties by index, and every index of a part below those of the
    parts after it. Returns (scores, indices), (R, k) with the same order."""
    s = np.concatenate(parts_s, axis=1)
    i = np.concatenate(parts_i, axis=1)
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1)


def _kth_largest_bound(s: np.ndarray, k: int) -> np.ndarray:
    """Per row, the largest ``x`` with ``s > x`` <=> ``s >=`` the row's k-th largest."""
    kth = np.partition(s, s.shape[1] - k, axis=1)[:, s.shape[1] - k]
    return np.nextafter(kth, np.float32(-np.inf))


def update_topk(best_s: np.ndarray, best_i: np.ndarray, s: np.ndarray, offset: int) -> None:
    """Fold a score block into a running top-k, in place.

    Args:
      best_s, best_i: (R, k) running top-k, sorted by score (descending), ties by
        index; unfilled slots hold ``-inf`` / ``-1``. Every index is < ``offset``.
      s: (R, nb) scores of database rows ``offset .. offset + nb - 1``.
    """
    rows_n, nb = s.shape
    k = best_s.shape[1]
    lo = best_s[:, -1].copy()  # a new score must be > lo to enter
    if nb > k:
        unfilled = np.flatnonzero(lo == -np.inf)
        if unfilled.size:
            lo[unfilled] = _kth_largest_bound(s[unfilled], k)
    flat = s.reshape(-1)
    pos = np.flatnonzero(s > lo[:, None])
    if pos.size == 0:
        return
    rows = pos // nb
    counts = np.bincount(rows, minlength=rows_n)
    if nb > k:
        heavy = np.flatnonzero(counts > _HEAVY_FACTOR * k)
        if heavy.size:
            lo[heavy] = np.maximum(lo[heavy], _kth_largest_bound(s[heavy], k))
            keep = flat[pos] > lo[rows]
            pos, rows = pos[keep], rows[keep]
            counts = np.bincount(rows, minlength=rows_n)
    active = np.flatnonzero(counts)
    slot = np.zeros(rows_n, np.int64)
    slot[active] = np.arange(active.size)
    starts = np.cumsum(counts) - counts
    col = k + np.arange(pos.size) - starts[rows]
    width = k + int(counts.max())
    cand_s = np.full((active.size, width), -np.inf, np.float32)
    cand_i = np.full((active.size, width), -1, np.int64)
    cand_s[:, :k] = best_s[active]
    cand_i[:, :k] = best_i[active]
    cand_s[slot[rows], col] = flat[pos]
    cand_i[slot[rows], col] = offset + pos % nb
    order = np.argsort(-cand_s, axis=1, kind="stable")[:, :k]
    best_s[active] = np.take_along_axis(cand_s, order, 1)
    best_i[active] = np.take_along_axis(cand_i, order, 1)


def _product(q: np.ndarray, block: np.ndarray, buffer: np.ndarray) -> np.ndarray:
    out = buffer.reshape(-1)[:q.shape[0] * block.shape[0]].reshape(q.shape[0], block.shape[0])
    return np.matmul(q, block.T, out=out)


def _topk_range(q, database, k, start, stop, database_block):
    best_s = np.full((q.shape[0], k), -np.inf, np.float32)
    best_i = np.full((q.shape[0], k), -1, np.int64)
    buffer = np.empty((q.shape[0], min(database_block, stop - start)), np.float32)
    for d0 in range(start, stop, database_block):
        s = _product(q, database[d0:min(d0 + database_block, stop)], buffer)
        update_topk(best_s, best_i, s, d0)
    return best_s, best_i


def _plan(num_queries: int, size: int, query_block: int, threads: int):
    """Tasks (q0, q1, d0, d1): query blocks, each split into database shards when there
    are too few query blocks to keep every thread busy."""
    q_starts = list(range(0, num_queries, query_block))
    shards = 1 if len(q_starts) >= 2 * threads else threads
    shards = max(1, min(shards, size // 4096 or 1))
    edges = np.linspace(0, size, shards + 1).astype(int)
    return [(q0, min(q0 + query_block, num_queries), int(edges[j]), int(edges[j + 1]))
            for q0 in q_starts for j in range(shards)], shards


def _run(tasks, fn, threads):
    use_pool = threads > 1 and len(tasks) > 1 and _threadpoolctl_available()
    with single_threaded_blas(use_pool):
        if not use_pool:
            return [fn(t) for t in tasks]
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(fn, tasks))


def exact_topk(queries: np.ndarray, database: np.ndarray, k: int, *,
               query_block: int = QUERY_BLOCK, database_block: int = DATABASE_BLOCK,
               threads: int = 0):
    """Exact top-k inner products: (scores (Q, k) float32, indices (Q, k) int64),
    best first, ties by index. ``k`` must be <= the database size.

    Cost: ``Q N D`` multiply-adds (BLAS) plus about one comparison per score;
    memory ``threads x query_block x database_block`` floats.
    """
    threads = threads or available_threads()
    tasks, shards = _plan(len(queries), len(database), query_block, threads)
    results = _run(tasks, lambda t: _topk_range(queries[t[0]:t[1]], database, k, t[2], t[3],
                                                database_block), threads)
    out_s, out_i = [], []
    for b in range(0, len(results), shards):
        group = results[b:b + shards]
        if shards == 1:
            s, i = group[0]
        else:
            s, i = merge_sorted_topk([g[0] for g in group], [g[1] for g in group], k)
        out_s.append(s)
        out_i.append(i)
    return np.concatenate(out_s), np.concatenate(out_i)


def score_blocks(queries: np.ndarray, database: np.ndarray,
                 fn: Callable[[int, np.ndarray], object], *, max_block_bytes: int = 1 << 26,
                 threads: int = 0) -> list:
    """Apply ``fn(q0, scores)`` to every query block's full score matrix
    (``scores = queries[q0:q0 + b] @ database.T``, float32, (b, N)), in a thread pool;
    returns the results in query order. ``fn`` may overwrite ``scores``.

    The block height ``b`` keeps each score matrix under ``max_block_bytes``.
    """
    threads = threads or available_threads()
    n = len(database)
    rows = int(max(1, min(len(queries), max_block_bytes // (4 * max(n, 1)))))
    tasks = [(q0, min(q0 + rows, len(queries))) for q0 in range(0, len(queries), rows)]

    def run(task):
        q0, q1 = task
        return fn(q0, np.matmul(queries[q0:q1], database.T))

    return _run(tasks, run, threads)
