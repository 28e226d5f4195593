"""Recall@k surrogate (RS@k, Patel, Tolias, Matas, CVPR 2022) on score matrices, and the
pair selection and mixing of its Similarity Mixup (SiMix).

For query ``i`` and each of its positives ``p``:

    rank(i, p) = 1 + sum_{j in C_i, j != p} sig1(s_ij - s_ip)
    R@k_i      = min(k, sum_{p in P_i} sig2_k(k - rank(i, p))) / min(k, |P_i|)

with ``sig1(t) = sigmoid(clip(t / tau1, -50, 50))``, ``sig2_k`` the same with
temperature ``tau2_k`` and ``C_i`` the query's candidates; the ranks come from
:func:`tfaploss.ops.smooth_rank.positive_rank_terms`. Cost: O(P·N) time (P positive
pairs) and O(pairs_per_block·N + Q·N) memory, forward and backward alike.
"""

from __future__ import annotations

import math

from keras import ops

from tfaploss.ops.backend import dim
from tfaploss.ops.masks import ranked_masks
from tfaploss.ops.smooth_rank import SigmoidStep, positive_rank_terms


def recall_at_k_per_query(scores, positives, candidates, k_values, tau1, tau2,
                          k_limit=None, pairs_per_block=None):
    """Smoothed recall@k of every query, averaged over ``k_values``.

    Args:
        scores: (Q, N) float scores.
        positives: (Q, N) bool, the positives counted in the recall (the query itself
            excluded); entries outside ``candidates`` are ignored.
        candidates: (Q, N) bool, the items ranked; may include the query itself (it
            then counts in its positives' ranks, as in the authors' code).
        k_values: tuple of positive ints.
        tau1: temperature of the rank sigmoid.
        tau2: tuple of temperatures of the "rank <= k" sigmoid, one per k.
        k_limit: each k is replaced by ``min(k, k_limit)`` (the authors clip k to the
            batch size); None: N.
        pairs_per_block: positive pairs ranked per loop step (None: automatic).

    Returns:
        ``(mean_recall, num_positives)``, each (Q,); ``mean_recall`` is 0 where a query
        has no positive.
    """
    positives, candidates = ranked_masks(positives, candidates)
    counts = ops.sum(ops.cast(positives, "int32"), axis=1)
    step = SigmoidStep(tau1)
    # The same step for positives and negatives: their sum is every candidate but p.
    pos_above, neg_above = positive_rank_terms(scores, positives, candidates, step, step,
                                               pairs_per_block)
    rank = 1.0 + pos_above + neg_above
    dtype = rank.dtype
    if k_limit is None:
        k_limit = dim(scores, 1)
    limit = ops.cast(k_limit, dtype)
    k_effs = [ops.minimum(ops.cast(k, dtype), limit) for k in k_values]
    hits = _soft_hits(rank, positives, k_effs, tau2)
    count_f = ops.cast(counts, dtype)
    total = ops.zeros_like(count_f)
    for index, k_eff in enumerate(k_effs):
        norm = ops.minimum(k_eff, count_f)
        recall = ops.minimum(hits[index], k_eff) / ops.where(norm > 0, norm,
                                                             ops.ones_like(norm))
        total = total + recall
    mean = total / float(len(k_values))
    return ops.where(counts > 0, mean, ops.zeros_like(mean)), counts


def _soft_hits(rank, positives, k_effs, tau2):
    """(K, Q): ``sum_{p in P_i} sig(k - rank(i, p); tau2_k)`` for each k, with a
    hand-written gradient that keeps only ``rank`` (not K (Q, N) sigmoids)."""
    steps = [SigmoidStep(t) for t in tau2]

    @ops.custom_gradient
    def hits(r):
        zero = ops.zeros_like(r)
        out = ops.stack([ops.sum(ops.where(positives, step.value(k - r), zero), axis=1)
                         for k, step in zip(k_effs, steps)])

        def grad(*args, upstream=None):
            if upstream is None:  # JAX passes it positionally
                (upstream,) = args
            d_rank = zero
            for index, (k, step) in enumerate(zip(k_effs, steps)):
                _, slope = step.value_and_slope(k - r)  # d sig / d(k - r); zero past clip
                d_rank = d_rank - upstream[index][:, None] * slope
            return ops.where(positives, d_rank, zero)

        return out, grad

    return hits(rank)


def simix_pairs(labels, group_size):
    """The pairs SiMix mixes: every pair within each group of ``group_size`` items of
    the same label, groups taken in label order (a stable sort of the labels).

    With ``group_size`` items per class (the authors' sampler) that is every same-class
    pair once, as the authors' ``pos_mixup``; a group that straddles two classes (or the
    end of the batch) loses its mixed-class pairs.

    Returns ``(first, second, valid)``, each of static length
    ``ceil(B / g) · g(g-1)/2``: item indices into the batch and whether the pair is used.
    """
    if not (isinstance(group_size, int) and not isinstance(group_size, bool)
            and group_size >= 2):
        raise ValueError(f"simix_pairs: group_size must be an int >= 2; received "
                         f"{group_size!r}.")
    n = labels.shape[0]
    if n is None:
        raise ValueError("SiMix needs a batch of static size (the number of mixed "
                         "embeddings is fixed when the step is traced).")
    n = int(n)
    groups = -(-n // group_size)
    # Any order of ties gives the same pairs when a class fills whole groups.
    order = ops.argsort(labels)
    pad = groups * group_size - n
    # Positions past the end of the batch point at its last item and are marked invalid.
    slots = ops.concatenate([ops.cast(order, "int32"),
                             ops.full((pad,), n - 1, "int32")]) if pad else ops.cast(
                                 order, "int32")
    real = ops.arange(groups * group_size) < n
    a_off = [i for i in range(group_size) for j in range(i + 1, group_size)]
    b_off = [j for i in range(group_size) for j in range(i + 1, group_size)]
    base = ops.arange(groups, dtype="int32")[:, None] * group_size
    a_pos = ops.reshape(base + ops.convert_to_tensor(a_off, "int32")[None, :], [-1])
    b_pos = ops.reshape(base + ops.convert_to_tensor(b_off, "int32")[None, :], [-1])
    first = ops.take(slots, a_pos, axis=0)
    second = ops.take(slots, b_pos, axis=0)
    valid = ops.logical_and(
        ops.logical_and(ops.take(real, a_pos, axis=0), ops.take(real, b_pos, axis=0)),
        ops.equal(ops.take(labels, first, axis=0), ops.take(labels, second, axis=0)))
    return first, second, valid


def simix_mix(embeddings, alphas, first, second):
    """``alpha · x_first + (1 - alpha) · x_second`` per pair, shape (F, D); not
    re-normalised, as the authors'."""
    alphas = ops.cast(alphas, embeddings.dtype)[:, None]
    return (alphas * ops.take(embeddings, first, axis=0)
            + (1.0 - alphas) * ops.take(embeddings, second, axis=0))


# SiMix's coefficients hash (seed, batch, pair index) in wrapping int32 arithmetic, the
# same bits on every backend (unsigned shifts through masks).
_MASK32 = 0xFFFFFFFF
# Embeddings are hashed on this grid: a training step moves some across a grid line,
# while a chunked and a whole-batch forward pass (~1e-7 apart) rarely differ.
SIMIX_HASH_GRID = 2.0 ** -10


def _int32(value):
    """A Python int as an int32 constant with the same low 32 bits."""
    value &= _MASK32
    return ops.convert_to_tensor(value - (1 << 32) if value >= 1 << 31 else value, "int32")


def _shift_right(x, bits):
    """Logical (unsigned) right shift of int32 ``x``."""
    return ops.bitwise_and(ops.right_shift(x, _int32(bits)), _int32((1 << (32 - bits)) - 1))


def _mix32(x):
    """Chris Wellons's ``lowbias32`` integer hash (a bijection of 32-bit words)."""
    x = ops.bitwise_xor(x, _shift_right(x, 16))
    x = ops.multiply(x, _int32(0x7FEB352D))
    x = ops.bitwise_xor(x, _shift_right(x, 15))
    x = ops.multiply(x, _int32(0x846CA68B))
    return ops.bitwise_xor(x, _shift_right(x, 16))


def _hash_cells(values, salt):
    """Wrapping sum over every cell of ``mix(mix(index + salt) ^ value)``: one 32-bit
    word that changes with any value or its position."""
    index = ops.reshape(ops.arange(math.prod(int(n) for n in values.shape), dtype="int32"),
                        tuple(values.shape))
    terms = _mix32(ops.bitwise_xor(_mix32(ops.add(index, _int32(salt))), values))
    return ops.cast(ops.sum(terms), "int32")


def simix_coefficients(embeddings, labels, num_pairs, seed, dtype=None):
    """SiMix's mixing coefficients for one batch: ``num_pairs`` values in (0, 1), a
    stateless hash of ``seed``, ``labels`` and ``embeddings`` rounded to
    :data:`SIMIX_HASH_GRID` (after L2 normalisation), uniform as far as a 32-bit hash
    allows (23 bits each); no gradient. ``docs/losses.md`` ("SiMix") says why.

    Args:
        embeddings: (B, D) float.
        labels: (B,) ints.
        num_pairs: F, a Python int.
        seed: a Python int (its low 32 bits are used).
        dtype: of the result (None: that of ``embeddings``).

    Cost: O(B·D + F) integer operations.
    """
    dtype = dtype or embeddings.dtype
    x = ops.stop_gradient(embeddings)
    norm = ops.sqrt(ops.sum(x * x, axis=1, keepdims=True))
    x = x / ops.where(norm > 0, norm, ops.ones_like(norm))
    cells = ops.cast(ops.floor(ops.clip(x, -1.0, 1.0) / SIMIX_HASH_GRID), "int32")
    batch = ops.add(_hash_cells(cells, 0x3C6EF372),
                    _hash_cells(ops.cast(labels, "int32"), 0xA54FF53A))
    key = _mix32(ops.bitwise_xor(_mix32(batch), _mix32(_int32(seed ^ 0x510E527F))))
    counter = ops.multiply(ops.arange(num_pairs, dtype="int32"), _int32(0x9E3779B9))
    bits = _mix32(_mix32(ops.bitwise_xor(ops.add(counter, key), _int32(0x1F83D9AB))))
    # The top 23 bits, centred in their cell (exact in float32): never 0 or 1.
    top = ops.cast(_shift_right(bits, 9), "float32")
    return ops.cast((top + 0.5) * (1.0 / (1 << 23)), dtype)
