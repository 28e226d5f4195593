"""Exact inner-product top-k on the CPU: blocked BLAS products + a threshold top-k.

The database is read in blocks; each query row keeps its running top-k and its k-th
best score, so only scores above it enter (one compare per score, against ~2 ns of
product per score at D = 128). A block that lets through too many candidates is first
bounded by folded group maxima; kept entries are uint64 keys (score bits, then index),
so an unstable partition orders ties by index. Query blocks (or database shards) run
in a thread pool with single-threaded BLAS. The design and its measurements:
``docs/search.md`` ("Exact search at the product's speed").

:func:`score_blocks` exposes the blocked products alone, for callers that need all
scores of a query block once (e.g. ranking every positive for mAP).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tfaploss.process_settings import available_cores

QUERY_BLOCK = 512
DATABASE_BLOCK = 8192  # 512 x 8192: ~8 % faster than 256 x 4096 (larger GEMMs)
_HEAVY_FACTOR = 4  # a row with more than 4 k candidates in a block is bounded first
_MERGE_AFTER = 1  # merge once a row has k pending candidates (0.5-2 k measured alike)


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


_EMPTY = np.uint64(0xFFFF_FFFF_FFFF_FFFF)  # an unfilled slot: sorts after every real key
_INDEX_MASK = np.uint64(0xFFFF_FFFF)
MAX_DATABASE = 0xFFFF_FFFF  # indices share a 64-bit key with the score: 32 bits each


def _sort_keys(scores: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """uint64 keys whose ascending order is (score descending, index ascending): the
    score's bits made to sort as unsigned integers, flipped, above the index. Keys are
    unique, so an unstable sort orders ties by index like a stable one."""
    bits = (scores + np.float32(0.0)).view(np.uint32)  # + 0: -0.0 and 0.0 tie, as in a sort
    negative = bits >> np.uint32(31) == 1
    ascending = np.where(negative, ~bits, bits | np.uint32(0x8000_0000))
    return ((~ascending).astype(np.uint64) << np.uint64(32)) | indices.astype(np.uint64)


def _decode(keys: np.ndarray):
    """(scores float32, indices int64) of :func:`_sort_keys` keys; unfilled: -inf, -1."""
    ascending = ~(keys >> np.uint64(32)).astype(np.uint32)
    negative = ascending >> np.uint32(31) == 0
    bits = np.where(negative, ~ascending, ascending & np.uint32(0x7FFF_FFFF))
    scores = bits.view(np.float32)
    indices = (keys & _INDEX_MASK).astype(np.int64)
    empty = keys == _EMPTY
    scores[empty], indices[empty] = -np.inf, -1
    return scores, indices


def kth_of_group_maxima(s: np.ndarray, k: int) -> np.ndarray:
    """Per row, a value at most the row's k-th largest (any ordered dtype): the k-th
    largest of the maxima of disjoint groups, folded in halves with ``np.maximum`` in
    about one pass (``np.partition`` of the row costs ~6 ns a score; this bound lets
    ~10-25 % more candidates through)."""
    m = s
    while m.shape[1] >= 8 * k:
        half = m.shape[1] // 2  # an odd last column is left out: still a lower bound
        m = np.maximum(m[:, :half], m[:, half:2 * half])
    return np.partition(m, m.shape[1] - k, axis=1)[:, m.shape[1] - k]


def _kth_largest_bound(s: np.ndarray, k: int) -> np.ndarray:
    """Per row, an ``x`` such that every score ``<= x`` has ``k`` scores of the row
    strictly above it (so it cannot enter a top-k that already saw the row)."""
    return np.nextafter(kth_of_group_maxima(s, k), np.float32(-np.inf))


class _RunningTopk:
    """The running top-k of query rows over database blocks seen in index order.

    Candidates (uint64 keys, :func:`_sort_keys`) wait in a pending list until a row
    holds more than ``merge_after`` of them. ``lo``, what a new score must beat, only
    rises, so a deferred merge admits a few more candidates but never loses one.
    """

    def __init__(self, rows: int, k: int, merge_after: int):
        self.k = k
        self.merge_after = merge_after
        self.keys = np.full((rows, k), _EMPTY, np.uint64)
        self.lo = np.full(rows, -np.inf, np.float32)
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []  # (rows, keys)
        self.pending_count = np.zeros(rows, np.int64)

    def add(self, s: np.ndarray, offset: int) -> None:
        """Fold the scores ``s`` (R, nb) of database rows ``offset ..`` in."""
        rows_n, nb = s.shape
        k, lo = self.k, self.lo
        if nb > k:
            unfilled = np.flatnonzero(lo == -np.inf)
            if unfilled.size:
                lo[unfilled] = _kth_largest_bound(s[unfilled], k)
        pos = np.flatnonzero(s > lo[:, None])  # one compare a score: most of the cost
        if pos.size == 0:
            return
        rows = pos // nb
        counts = np.bincount(rows, minlength=rows_n)
        flat = s.reshape(-1)
        if nb > k:
            # Adversarial orders (a database sorted by score): cut a row that lets
            # many candidates through to about its k best in this block first.
            heavy = np.flatnonzero(counts > _HEAVY_FACTOR * k)
            if heavy.size:
                lo[heavy] = np.maximum(lo[heavy], _kth_largest_bound(s[heavy], k))
                keep = flat[pos] > lo[rows]
                pos, rows = pos[keep], rows[keep]
                counts = np.bincount(rows, minlength=rows_n)
        self.pending.append((rows, _sort_keys(flat[pos], offset + pos % nb)))
        self.pending_count += counts
        if self.pending_count.max() > self.merge_after:
            self.merge()

    def merge(self) -> None:
        """Merge the pending candidates into the kept top-k."""
        if not self.pending:
            return
        k, counts = self.k, self.pending_count
        if len(self.pending) == 1:
            rows, keys = self.pending[0]
        else:
            rows, keys = (np.concatenate(p) for p in zip(*self.pending))
            by_row = np.argsort(rows)  # any order within a row: keys are unique
            rows, keys = rows[by_row], keys[by_row]
        self.pending = []
        active = np.flatnonzero(counts)
        slot = np.zeros(len(counts), np.int64)
        slot[active] = np.arange(active.size)
        starts = np.cumsum(counts) - counts
        col = k + np.arange(rows.size) - starts[rows]
        cand = np.full((active.size, k + int(counts.max())), _EMPTY, np.uint64)
        cand[:, :k] = self.keys[active]
        cand[slot[rows], col] = keys
        cand.partition(k - 1, axis=1)
        self.keys[active] = cand[:, :k]
        kth, _ = _decode(cand[:, k - 1])
        self.lo[active] = np.maximum(self.lo[active], kth)
        counts[:] = 0

    def result(self):
        """(scores, indices), (R, k), best first, ties by index."""
        self.merge()
        return _decode(np.sort(self.keys, axis=1))


def _product(q: np.ndarray, block: np.ndarray, buffer: np.ndarray) -> np.ndarray:
    out = buffer.reshape(-1)[:q.shape[0] * block.shape[0]].reshape(q.shape[0], block.shape[0])
    return np.matmul(q, block.T, out=out)


def _topk_range(q, database, k, start, stop, database_block):
    block = min(database_block, stop - start)
    top = _RunningTopk(q.shape[0], k, _MERGE_AFTER * k)
    buffer = np.empty((q.shape[0], block), np.float32)
    for d0 in range(start, stop, database_block):
        top.add(_product(q, database[d0:min(d0 + database_block, stop)], buffer), d0)
    return top.result()


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
    # Without threadpoolctl the pool is not used and BLAS keeps its threads.
    if threads <= 1 or len(tasks) <= 1 or not _threadpoolctl_available():
        return [fn(t) for t in tasks]
    from threadpoolctl import threadpool_limits

    # BLAS single-threaded while our own thread pool runs.
    with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, tasks))


def exact_topk(queries: np.ndarray, database: np.ndarray, k: int, *,
               query_block: int = QUERY_BLOCK, database_block: int = DATABASE_BLOCK,
               threads: int = 0):
    """Exact top-k inner products: (scores (Q, k) float32, indices (Q, k) int64),
    best first, ties by index. ``k`` must be <= the database size.

    Cost: ``Q N D`` multiply-adds (BLAS) plus about one comparison per score;
    memory ``threads x query_block x database_block`` floats.
    """
    check_database_size(len(database))
    threads = threads or available_cores()
    tasks, shards = _plan(len(queries), len(database), query_block, threads)
    results = _run(tasks, lambda t: _topk_range(queries[t[0]:t[1]], database, k, t[2], t[3],
                                                database_block), threads)
    return join_shards(results, shards, k)


def check_database_size(size: int) -> None:
    if size >= MAX_DATABASE:
        raise ValueError(f"`database` must have fewer than {MAX_DATABASE} rows for exact "
                         f"search; received {size}.")


def join_shards(results, shards: int, k: int):
    """The (scores, indices) of every query block from its tasks' results, in
    :func:`_plan`'s order (each query block's database shards in turn)."""
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
    threads = threads or available_cores()
    n = len(database)
    rows = int(max(1, min(len(queries), max_block_bytes // (4 * max(n, 1)))))
    tasks = [(q0, min(q0 + rows, len(queries))) for q0 in range(0, len(queries), rows)]

    def run(task):
        q0, q1 = task
        return fn(q0, np.matmul(queries[q0:q1], database.T))

    return _run(tasks, run, threads)
