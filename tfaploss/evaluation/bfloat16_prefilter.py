"""Exact top-k through a bfloat16 prefilter: a fast approximate product picks the
candidates, float32 re-scores them, and an error bound makes sure none is missed.

On CPUs with bfloat16 matrix units (Intel AMX, AVX512-BF16), a bfloat16 product runs
1.4-5x faster than the float32 one, more than any float32 selection can make up for
(docs/search.md). So:

1. **Approximate scores.** Queries and database are rounded to bfloat16 (``q^``,
   ``x^``) and multiplied by oneDNN (PyTorch's or TensorFlow's matmul), which
   accumulates in float32 and rounds each score to bfloat16 (``a``).
2. **A bound on the error.** With ``dx = x - x^`` and ``dq = q - q^`` known exactly
   (we rounded them) and ``g = D u32 / (1 - D u32)`` (float32 summation, ``u32 =
   2^-24``), for every pair::

       |a - q.x| <= u' |a| + E,    u' = 2^-8 / (1 - 2^-8)   (bfloat16 output rounding)
       E = |q^| max|dx| + |dq| max|x| + g |q^| max|x^| + g |q| max|x| + tiny
       tiny = 2^-126 (sqrt(D) (max|x^| + |q^|) + 2 D + 2)

   The bfloat16 products are exact in float32 (8 + 8 significant bits); ``g |q| max|x|``
   also covers the float32 rounding of the reference (so the result is what a float32
   product would rank), and ``tiny`` covers subnormals flushed to zero (inputs,
   products, partial sums and the output).
3. **Candidates.** If ``a_k`` is a row's k-th largest approximate score, ``k`` entries
   have a true score at least ``L = a_k - u'|a_k| - E`` (``a - u'|a|`` rises with
   ``a``), so an entry whose upper bound ``a + u'|a| + E`` is below ``L`` cannot be in
   the top-k. Everything else is kept: about 1.1 k per query on clustered unit-norm
   embeddings (300k x 128, k = 100).
4. **Exact re-scoring** of the candidates in float32, and the top-k of those, ties by
   index.

The selection compares the bfloat16 bits as int16, one compare per score on half the
bytes of a float32 selection. A query block whose rows keep more than
:data:`MAX_CANDIDATES` candidates (a database of duplicates) is searched in float32
instead. :func:`choose_product` checks, once, that the product accumulates in float32
and rounds to nearest; ``prefilter="auto"`` takes it only where it wins with its one-off
costs counted (:func:`cheapest`).

Cost: the bfloat16 product (``Q N D``), one int16 compare per score, and ``~1.1 Q k D``
float32 multiply-adds of re-scoring. Memory: the database once more in bfloat16 (half
its float32 size), and ``threads x query_block x database_block`` int16 scores.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import sys

import numpy as np

from tfaploss.evaluation import exact_topk as fp32
from tfaploss.process_settings import HeldSetting, available_cores

logger = logging.getLogger(__name__)

QUERY_BLOCK = 512  # 512 x 8192 tiles: the fastest of those measured (docs/search.md)
DATABASE_BLOCK = 8192
MAX_CANDIDATES = 16384  # per row; above this a query block falls back to float32
_U_OUT = 2.0 ** -8 / (1 - 2.0 ** -8)  # bfloat16 round-to-nearest, relative to the result
_U32 = 2.0 ** -24
_SMALLEST_NORMAL = 2.0 ** -126
# Searches below this many multiply-adds (~0.15 s of float32 search) stay in float32:
# the cost model below was measured on searches 10-100x larger.
MIN_WORK = 1 << 32
# The cost model of prefilter="auto" (search_seconds, cheapest), measured on the 2-core
# AMD EPYC the tests run on (benchmarks/search.py, 300k x 128, k = 100; docs/search.md).
FLOAT32_RATE = 2.9e10  # multiply-adds/s of the float32 search (ExactSearcher, numpy)
IMPORT_SECONDS = {"torch": 2.5, "tensorflow": 7.0}  # the slow end: never-slower first
COPY_RATE = 1.5e8  # database elements/s of PreparedDatabase: 0.26 s at 300k x 128
# The warm prefilter's speed over float32's, the lowest measured on a CPU with AMX
# (PyTorch 1.67-2.4, TensorFlow 1.22-1.83): a search predicted to gain does.
PREFILTER_SPEEDUP = {"torch": 1.7, "tensorflow": 1.2}
_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def _cpu_has_bfloat16_units() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return any(flag in flags for flag in _CPU_FLAGS)
    except OSError:
        pass
    return False


def _torch():
    import torch

    return torch


# PyTorch single-threaded while searches run (concurrent ones too: the last to end
# restores the count the first one found).
_TORCH_ONE_THREAD = HeldSetting(lambda: _torch().get_num_threads(),
                                lambda count: _torch().set_num_threads(count), 1)


class _TorchProduct:
    """PyTorch's bfloat16 matmul (oneDNN): the faster product in the prefilter's tiles
    (1.5 against TensorFlow's 1.1 of the float32 product at 300k x 128)."""

    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch

    def from_bits(self, bits: np.ndarray):
        """The product's bfloat16 matrix of these bits (int16)."""
        # A copy: oneDNN runs at half speed on numpy's 16-byte aligned buffers.
        return self.torch.from_numpy(bits).view(self.torch.bfloat16).clone()

    def matmul(self, q, block) -> np.ndarray:
        """``q @ block.T`` in bfloat16, as its int16 bits (no copy)."""
        return self.torch.mm(q, block.T).view(self.torch.int16).numpy()

    def one_thread_each(self, active: bool):
        """Single-threaded products while our own threads run one each."""
        return _TORCH_ONE_THREAD.held() if active else contextlib.nullcontext()


class _TensorFlowProduct:
    """TensorFlow's bfloat16 matmul (oneDNN); TensorFlow is always installed."""

    name = "tensorflow"

    def __init__(self):
        import tensorflow as tf

        self.tf = tf

    def from_bits(self, bits: np.ndarray):
        with self.tf.device("/CPU:0"):
            return self.tf.bitcast(self.tf.constant(bits), self.tf.bfloat16)

    def matmul(self, q, block) -> np.ndarray:
        with self.tf.device("/CPU:0"):
            out = self.tf.bitcast(self.tf.matmul(q, block, transpose_b=True), self.tf.int16)
        return np.asarray(out)  # .numpy() would copy

    def one_thread_each(self, active: bool):
        return contextlib.nullcontext()  # TensorFlow's thread pool is fixed at start-up


_PRODUCTS = {"torch": _TorchProduct, "tensorflow": _TensorFlowProduct}


def _check_product(product) -> str | None:
    """None when ``product`` accumulates in float32 and rounds to nearest; else why
    not (a product of 512 ones is 512, and ``1 + 1.25 * 2^-8`` rounds up)."""
    ones = product.from_bits(round_to_bfloat16(np.ones((64, 512), np.float32)))
    total = bfloat16_values(product.matmul(ones, ones))
    q = np.zeros((64, 64), np.float32)
    x = np.zeros((64, 64), np.float32)
    q[:, :2], x[:, 0], x[:, 1] = 1.0, 1.0, 1.25 * 2.0 ** -8
    rounded = bfloat16_values(product.matmul(product.from_bits(round_to_bfloat16(q)),
                                             product.from_bits(round_to_bfloat16(x))))
    if not np.all(total == 512):
        return f"{product.name}'s bfloat16 product does not accumulate in float32"
    if not np.all(rounded == np.float32(1 + 2.0 ** -7)):
        return f"{product.name}'s bfloat16 product does not round to nearest"
    return None


@functools.cache
def _product_support(name: str) -> str | None:
    if not _installed(name):
        return f"{name} is not installed"
    return _check_product(_PRODUCTS[name]())


def choose_product(only: str | None = None) -> tuple[str | None, str | None]:
    """(the fastest product that can run the prefilter here, or None; why none can).
    ``only``: consider that product alone."""
    if not _cpu_has_bfloat16_units():
        return None, "the CPU has no bfloat16 matrix units (amx_bf16 or avx512_bf16)"
    reasons = []
    for name in (only,) if only else ("torch", "tensorflow"):
        why = _product_support(name)
        if why is None:
            return name, None
        reasons.append(why)
    return None, "; ".join(reasons)


def worthwhile(num_queries: int, size: int, dim: int) -> bool:
    """Whether a search is large enough for ``"auto"`` to weigh the prefilter at all
    (see :data:`MIN_WORK`); :func:`cheapest` decides."""
    return dim >= 32 and num_queries * size * dim >= MIN_WORK


def search_seconds(num_queries: int, size: int, dim: int, product: str | None = None, *,
                   imported: bool = True, copied: bool = True) -> float:
    """Estimated seconds of one exact search: float32 alone (``product`` None), or the
    prefilter with ``product`` plus the import of its framework unless ``imported`` and
    the bfloat16 copy of the database unless ``copied``."""
    work = float(num_queries) * size * dim
    if product is None:
        return work / FLOAT32_RATE
    seconds = work / (FLOAT32_RATE * PREFILTER_SPEEDUP[product])
    if not imported:
        seconds += IMPORT_SECONDS[product]
    if not copied:
        seconds += float(size) * dim / COPY_RATE
    return seconds


def cheapest(num_queries: int, size: int, dim: int, products, *, imported=(),
             held: str | None = None) -> str | None:
    """The decision of ``prefilter="auto"``: of ``products`` (the first wins a tie), the
    one whose search, one-off costs included (:func:`search_seconds`), is shortest, if
    shorter than float32 alone; else None. ``imported``: the products whose framework
    is imported; ``held``: the product of the searcher's bfloat16 copy.
    """
    if not worthwhile(num_queries, size, dim):
        return None
    best, best_seconds = None, search_seconds(num_queries, size, dim)
    for name in products:
        seconds = search_seconds(num_queries, size, dim, name,
                                 imported=name in imported or name == held,
                                 copied=name == held)
        if seconds < best_seconds:
            best, best_seconds = name, seconds
    return best


@functools.cache
def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _imported(name: str) -> bool:
    return name in sys.modules


def choose_for_search(num_queries: int, size: int, dim: int,
                      held: str | None = None) -> str | None:
    """The product ``prefilter="auto"`` runs a search with, or None for float32 alone:
    :func:`cheapest` over the installed products. A product is imported and checked only
    once chosen; one that fails is dropped and the choice made again.
    """
    if not worthwhile(num_queries, size, dim) or not _cpu_has_bfloat16_units():
        return None
    products = [name for name in _PRODUCTS if _installed(name)]
    while True:
        name = cheapest(num_queries, size, dim, products, held=held,
                        imported={p for p in products if _imported(p)})
        if name is None or _product_support(name) is None:
            return name
        products.remove(name)


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """The bits (int16) of float32 ``x`` rounded to the nearest bfloat16, ties to
    even (finite values beyond bfloat16's range become infinite)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    # In place on one temporary: a third faster than a fresh array a step.
    rounded = bits >> np.uint32(16)
    rounded &= np.uint32(1)
    rounded += np.uint32(0x7FFF)
    rounded += bits
    rounded >>= np.uint32(16)
    return rounded.astype(np.uint16).view(np.int16)


def bfloat16_values(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bits (int16)."""
    return (bits.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _keys(bits: np.ndarray) -> np.ndarray:
    """int16 keys that order as the bfloat16 values whose bits (as int16) are given
    (negative values get their magnitude bits flipped; -0 sorts just below +0)."""
    return bits ^ ((bits >> 15) & np.int16(0x7FFF))


def _values(keys: np.ndarray) -> np.ndarray:
    """float32 values of :func:`_keys` keys (the map is its own inverse)."""
    return bfloat16_values(_keys(keys))


def _key_at_most(t: np.ndarray) -> np.ndarray:
    """For each float threshold, a key every bfloat16 value ``>= t`` is at or above."""
    bits = (np.asarray(t, np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    # Dropping the low bits rounds towards zero, which is up for a negative value: one
    # key lower is then still below t.
    keys = _keys(bits.view(np.int16)).astype(np.int32) - 1
    return np.maximum(keys, np.iinfo(np.int16).min).astype(np.int16)


class PreparedDatabase:
    """A database in bfloat16 blocks, with the norms its error bound needs.

    Cost: a few passes over the database, in ``threads`` threads; memory: half the
    database's float32 size.

    Args:
      database: (N, D) float32.
      product: ``"torch"`` or ``"tensorflow"``; None: :func:`choose_product`.
      database_block: rows per block.
      threads: threads that make the blocks (0: every core this process may use).
    """

    def __init__(self, database: np.ndarray, product: str | None = None,
                 database_block: int = DATABASE_BLOCK, threads: int = 0):
        if product is None:
            product, why = choose_product()
            if product is None:
                raise RuntimeError(f"the bfloat16 prefilter cannot run here: {why}")
        self.product = _PRODUCTS[product]()
        self.database = database
        self.block = int(database_block)

        def prepare(d0):
            part = database[d0:d0 + self.block]
            bits = round_to_bfloat16(part)
            back = bfloat16_values(bits)
            if not np.all(np.isfinite(back)):
                raise OverflowError("the database overflows bfloat16")
            # float64 norms: the bound must not inherit float32 rounding of its own.
            # x - x^ is exact in float32.
            return (self.product.from_bits(bits), _max_norm(part - back), _max_norm(part),
                    _max_norm(back))

        # Each block goes to the product as it is made: one block a thread held besides.
        parts = fp32._run(list(range(0, len(database), self.block)), prepare,
                          threads or available_cores())
        self.blocks = [p[0] for p in parts]
        self.max_dx = max((p[1] for p in parts), default=0.0)
        self.max_x = max((p[2] for p in parts), default=0.0)
        self.max_xr = max((p[3] for p in parts), default=0.0)
        d = database.shape[1]
        self.gamma = d * _U32 / (1 - d * _U32)
        self.dim = d

    def fits(self, queries: np.ndarray) -> bool:
        """Whether no score of these queries can come near float32's range (the bound
        assumes none overflows)."""
        return float(np.linalg.norm(queries, axis=1).max(initial=0.0)) * self.max_xr < 1e30

    def error_bounds(self, queries: np.ndarray, rounded: np.ndarray) -> np.ndarray:
        """Per query, ``E`` of the module docstring (float64)."""
        q = np.linalg.norm(queries.astype(np.float64), axis=1)
        qr = np.linalg.norm(rounded.astype(np.float64), axis=1)
        dq = np.linalg.norm(queries.astype(np.float64) - rounded, axis=1)
        # Subnormals flushed to zero: inputs (each term at most 2^-126 times the other
        # factor), products and partial sums (2^-126 each), and the output.
        tiny = _SMALLEST_NORMAL * (math.sqrt(self.dim) * (self.max_xr + qr) + 2 * self.dim + 2)
        bound = (qr * self.max_dx + dq * self.max_x + self.gamma * qr * self.max_xr
                 + self.gamma * q * self.max_x + tiny)
        return bound * (1 + 1e-9)  # float64's own rounding in the lines above


def _max_norm(x: np.ndarray) -> float:
    return float(np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float64).max()))


def _admission(lo: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """The smallest approximate score that may still beat a row whose k-th largest
    approximate score is at least ``lo`` (float64)."""
    lo = lo.astype(np.float64)
    t = lo - _U_OUT * np.abs(lo) - 2 * bound  # (lower bound of the k-th true) - E
    with np.errstate(invalid="ignore"):
        a = np.where(t >= 0, t / (1 + _U_OUT), t / (1 - _U_OUT))
    # Lowered a little for float64's rounding in the lines above (never raised).
    return np.where(np.isneginf(lo), -np.inf, a - 1e-12 * np.abs(a) - 1e-300)


class _Candidates:
    """Every (row, index) whose approximate score may be in the row's top-k, in a
    padded (rows x width) table."""

    def __init__(self, rows: int, k: int, bound: np.ndarray):
        self.k = k
        self.bound = bound
        self.lo = np.full(rows, -np.inf)  # a lower bound on the row's k-th approx. score
        self.threshold = _key_at_most(_admission(self.lo, bound))
        self.count = np.zeros(rows, np.int64)
        self.values = np.full((rows, 4 * k), -np.inf, np.float32)
        self.indices = np.zeros((rows, 4 * k), np.int64)

    def _raise_lo(self, rows: np.ndarray, lo: np.ndarray) -> None:
        self.lo[rows] = np.maximum(self.lo[rows], lo)
        self.threshold[rows] = _key_at_most(_admission(self.lo[rows], self.bound[rows]))

    def add(self, bits: np.ndarray, offset: int) -> None:
        """Fold in the bfloat16 scores (as int16 bits, (R, nb)) of rows ``offset ..``."""
        rows_n, nb = bits.shape
        k = self.k
        if nb > k:
            unfilled = np.flatnonzero(np.isneginf(self.lo))
            if unfilled.size:
                kth = fp32.kth_of_group_maxima(_keys(bits[unfilled]), k)
                self._raise_lo(unfilled, _values(kth))
        keys = bits if self.threshold.min() > 0 else _keys(bits)
        pos = np.flatnonzero(keys >= self.threshold[:, None])  # most of the cost
        if pos.size == 0:
            return
        rows = pos // nb
        counts = np.bincount(rows, minlength=rows_n)
        if nb > k:
            heavy = np.flatnonzero(counts > fp32._HEAVY_FACTOR * k)
            if heavy.size:
                kth = fp32.kth_of_group_maxima(_keys(bits[heavy]), k)
                self._raise_lo(heavy, _values(kth))
                keep = _keys(bits.reshape(-1)[pos]) >= self.threshold[rows]
                pos, rows = pos[keep], rows[keep]
                counts = np.bincount(rows, minlength=rows_n)
        if int((self.count + counts).max()) > self.values.shape[1]:
            self.prune()
            self._make_room(int((self.count + counts).max()))
        # pos is row-major, so the rows come sorted: each one's new entries follow on.
        starts = np.cumsum(counts) - counts
        col = self.count[rows] + np.arange(rows.size) - starts[rows]
        self.values[rows, col] = bfloat16_values(bits.reshape(-1)[pos])
        self.indices[rows, col] = offset + pos % nb
        self.count += counts
        if self.count.max() > 3 * k:
            self.prune()

    def _make_room(self, width: int) -> None:
        if width <= self.values.shape[1]:
            return
        width = max(width, 2 * self.values.shape[1])
        grow = width - self.values.shape[1]
        self.values = np.pad(self.values, ((0, 0), (0, grow)), constant_values=-np.inf)
        self.indices = np.pad(self.indices, ((0, 0), (0, grow)))

    def prune(self) -> None:
        """Raise each row's threshold from its k-th largest candidate, and drop what
        falls below it."""
        k, width = self.k, self.values.shape[1]
        full = np.flatnonzero(self.count >= k)
        if full.size == 0:
            return
        values = self.values[full]
        kth = np.partition(values, width - k, axis=1)[:, width - k]
        self._raise_lo(full, kth)
        keep = values >= _admission(self.lo[full], self.bound[full])[:, None]
        col = np.cumsum(keep, axis=1) - 1
        r, c = np.nonzero(keep)
        kept_values, kept_indices = values[r, c], self.indices[full][r, c]
        self.values[full] = -np.inf
        self.values[full[r], col[r, c]] = kept_values
        self.indices[full[r], col[r, c]] = kept_indices
        self.count[full] = keep.sum(axis=1)

    def topk(self, q: np.ndarray, database: np.ndarray, rows_at_once: int = 64):
        """Top-k by float32 score, ties by index; (R, k), padded with -inf / -1
        where a row has fewer candidates."""
        k = self.k
        width = max(int(self.count.max()), 1)
        keys = np.full((len(q), max(width, k)), fp32._EMPTY, np.uint64)
        for r0 in range(0, len(q), rows_at_once):
            r1 = min(r0 + rows_at_once, len(q))
            idx = self.indices[r0:r1, :width]
            valid = np.arange(width) < self.count[r0:r1, None]
            idx = np.where(valid, idx, 0)
            scores = np.einsum("rwd,rd->rw", database[idx], q[r0:r1])
            keys[r0:r1, :width] = np.where(valid, fp32._sort_keys(scores, idx), fp32._EMPTY)
        if keys.shape[1] > k:
            keys.partition(k - 1, axis=1)
        return fp32._decode(np.sort(keys[:, :k], axis=1))


def _topk_range(prepared: PreparedDatabase, q, k, start, stop):
    """Top-k of the query rows ``q`` over database rows ``start:stop`` (``start`` on a
    block edge), or None when the bound keeps too many candidates."""
    product = prepared.product
    bits = round_to_bfloat16(q)
    rounded, back = product.from_bits(bits), bfloat16_values(bits)
    cand = _Candidates(len(q), k, prepared.error_bounds(q, back))
    for b in range(start // prepared.block, -(-stop // prepared.block)):
        cand.add(product.matmul(rounded, prepared.blocks[b]), b * prepared.block)
        if cand.count.max() > MAX_CANDIDATES:
            cand.prune()
            if cand.count.max() > MAX_CANDIDATES:
                return None
    cand.prune()
    return cand.topk(q, prepared.database)


def exact_topk(queries: np.ndarray, prepared: PreparedDatabase, k: int, *,
               query_block: int = QUERY_BLOCK, threads: int = 0):
    """Exact top-k inner products through the prefilter: (scores (Q, k) float32,
    indices (Q, k) int64), best first, ties by index. Same contract as
    :func:`tfaploss.evaluation.exact_topk.exact_topk`."""
    database = prepared.database
    fp32.check_database_size(len(database))
    threads = threads or available_cores()
    tasks, shards = fp32._plan(len(queries), len(database), query_block, threads)
    # Shards start on block edges, so each task reads whole prepared blocks.
    block = prepared.block
    tasks = [(q0, q1, d0 // block * block, d1 if d1 == len(database) else d1 // block * block)
             for q0, q1, d0, d1 in tasks]
    fallbacks = []

    def run(task):
        q0, q1, d0, d1 = task
        if d0 >= d1:
            return (np.full((q1 - q0, k), -np.inf, np.float32),
                    np.full((q1 - q0, k), -1, np.int64))
        out = _topk_range(prepared, queries[q0:q1], k, d0, d1)
        if out is None:
            fallbacks.append(task)
            return fp32._topk_range(queries[q0:q1], database, k, d0, d1,
                                    fp32.DATABASE_BLOCK)
        return out

    use_pool = threads > 1 and len(tasks) > 1
    with prepared.product.one_thread_each(use_pool):
        results = fp32._run(tasks, run, threads)
    if fallbacks:
        logger.info("exact search: %d of %d query blocks kept more than %d candidates a "
                    "query under the bfloat16 bound and were searched in float32",
                    len(fallbacks), len(tasks), MAX_CANDIDATES)
    return fp32.join_shards(results, shards, k)
