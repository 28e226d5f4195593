"""Smooth-rank AP surrogates (Smooth-AP, ROADMAP's SupAP, PNP) on score matrices.

All three rank every positive ``k`` of a query ``i`` among the query's candidates with
a smoothed step function of the score differences ``t = s_ij - s_ik``:

    pos_above[i, k] = sum_{j in P_i, j != k} h_pos(s_ij - s_ik)
    neg_above[i, k] = sum_{j in N_i}          h_neg(s_ij - s_ik)

(``P_i`` the query's positives, ``N_i`` its other candidates). Smooth-AP and SupAP
then take ``AP_i = mean_k (1 + pos_above) / (1 + pos_above + neg_above)``; PNP applies
its penalty ``f`` to ``neg_above``. See ``docs/losses.md``.

Memory. The dense form builds a Q x N x N tensor (64 GiB in float32 at B=4096). Here
only the positive pairs ``(i, k)`` are ranked: they are enumerated in the (Q, N)
mask's row-major order and processed in blocks of ``pairs_per_block`` pairs inside a
while loop (a data-dependent trip count with static block shapes, so it also compiles
under XLA and ``jax.jit``). A block is a (pairs_per_block, N) tensor; the default block size
keeps it at about 4M elements (16 MiB in float32). The gradient is written by hand
(:func:`positive_rank_terms` has a custom gradient, so no backend ever differentiates
the loop: JAX could not) and recomputes each block in a second loop, so nothing of
size O(P·N) is kept for the backward pass either.

Cost: O(P·N) time with P = number of positive pairs <= Q·m (m = most positives of any
query), i.e. O(B·m·B) for a batch, and O(pairs_per_block·N + Q·N) memory, for the
forward pass and again for the backward pass. Nothing depends on how labels are laid
out: classes need not be contiguous nor equally sized. The block computations are
``keras.ops``; the loop around them is ``tf.while_loop`` with TensorArrays on
TensorFlow (:mod:`tfaploss.ops.tensorflow_kernels`: inside a graph each block's
elementwise chain runs as one jit-compiled kernel, about twice as fast on CPU as
separate TensorFlow ops) and ``keras.ops.while_loop`` with preallocated buffers on JAX
and PyTorch.

On TensorFlow use a non-persistent ``tf.GradientTape`` (as Keras does): inside a
``tf.function`` a persistent tape makes TensorFlow keep every loop iteration's
intermediates, which brings back O(P·N) memory (and does not compile under XLA).
"""

from __future__ import annotations

import math

from keras import ops

from tfaploss.ops.backend import on_tensorflow, take

# Elements of one (pairs_per_block, N) block when pairs_per_block is left to us:
# 4M floats keeps each temporary at 16 MiB (float32) whatever the batch size.
_ELEMENTS_PER_BLOCK = 2**22
_CLIP = 50.0  # sigmoid argument clip of the Smooth-AP/ROADMAP/PNP code

PNP_VARIANTS = ("O", "Iu", "Ib", "Ds", "Dq")


def sigmoid_tau(t, temperature):
    """``sigmoid(clip(t / temperature, -50, 50))``, the originals' smoothed step."""
    return ops.sigmoid(ops.clip(t / temperature, -_CLIP, _CLIP))


def _check_temperature(temperature):
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a positive number; received {temperature!r}.")
    return float(temperature)


class SigmoidStep:
    """Smoothed step ``sigmoid(clip(t / temperature, -50, 50))`` (Smooth-AP, PNP)."""

    differentiable = True

    def __init__(self, temperature=0.01):
        self.temperature = _check_temperature(temperature)
        self.key = ("sigmoid", self.temperature)

    def value(self, t):
        return sigmoid_tau(t, self.temperature)

    def value_and_slope(self, t):
        z = t / self.temperature
        v = ops.sigmoid(ops.clip(z, -_CLIP, _CLIP))
        # Past the clip the originals' autograd gives zero slope; so do we.
        slope = ops.where(ops.abs(z) <= _CLIP, v * (1.0 - v) / self.temperature,
                          ops.zeros_like(v))
        return v, slope


class HeavisideStep:
    """True step ``[t >= 0]`` with no gradient (SupAP's positive pairs)."""

    differentiable = False
    key = ("heaviside",)

    def value(self, t):
        return ops.cast(t >= 0, t.dtype)

    def value_and_slope(self, t):
        v = self.value(t)
        return v, ops.zeros_like(v)


class SupAPUpperStep:
    """ROADMAP's upper bound of the step, used on negative pairs.

    ``H(t) = sigma_tau(t)`` for ``t <= 0``, ``start + sigma_tau(t)`` for
    ``0 < t <= delta`` and ``rho * (t - delta) + offset`` for ``t > delta``;
    ``offset=None`` makes it continuous at ``delta``: ``start + sigma_tau(delta)``.
    It bounds ``[t > 0]`` from above whenever ``start >= 0.5`` and ``offset >= 1``.
    """

    differentiable = True

    def __init__(self, temperature=0.01, rho=100.0, delta=0.05, start=0.5, offset=None):
        self.temperature = _check_temperature(temperature)
        for name, val in (("rho", rho), ("delta", delta), ("start", start)):
            if not isinstance(val, (int, float)) or val < 0:
                raise ValueError(f"{name} must be a non-negative number; received {val!r}.")
        self.rho, self.delta, self.start = float(rho), float(delta), float(start)
        if offset is None:
            z = max(-_CLIP, min(_CLIP, self.delta / self.temperature))
            offset = self.start + 1.0 / (1.0 + math.exp(-z))
        elif not isinstance(offset, (int, float)):
            raise ValueError(f"offset must be a number or None; received {offset!r}.")
        self.offset = float(offset)
        self.key = ("supap_upper", self.temperature, self.rho, self.delta, self.start,
                    self.offset)

    def _pieces(self, t):
        sig, sig_slope = SigmoidStep(self.temperature).value_and_slope(t)
        value = ops.where(t <= 0, sig,
                          ops.where(t <= self.delta, self.start + sig,
                                    self.rho * (t - self.delta) + self.offset))
        slope = ops.where(t > self.delta, ops.full_like(t, self.rho), sig_slope)
        return value, slope

    def value(self, t):
        return self._pieces(t)[0]

    def value_and_slope(self, t):
        return self._pieces(t)


def _static_or_dynamic(x, axis):
    static = x.shape[axis]
    return int(static) if static is not None else ops.shape(x)[axis]


def _block_size(num_queries, num_items, pairs_per_block):
    """Pairs per block: a Python int when the shapes are static (XLA), else a tensor."""
    if pairs_per_block is not None:
        if not (isinstance(pairs_per_block, int) and pairs_per_block > 0):
            raise ValueError("pairs_per_block must be a positive int or None; received "
                             f"{pairs_per_block!r}.")
        block = pairs_per_block
    elif isinstance(num_items, int):
        block = max(1, _ELEMENTS_PER_BLOCK // max(num_items, 1))
    else:
        block = ops.maximum(1, _ELEMENTS_PER_BLOCK // num_items)
    if isinstance(block, int) and isinstance(num_queries, int) and isinstance(num_items, int):
        block = max(1, min(block, num_queries * num_items))  # never pad past the matrix
    return block


def _enumerate_pairs(positives, block):
    """Row-major flat indices of the positive pairs, padded to whole blocks.

    Returns ``(pair_index, num_pairs)``: ``pair_index[p]`` is the flat (Q·N) index of
    the p-th positive pair for ``p < num_pairs``; later entries are padding. Built
    with a cumulative sum and one scatter (static shapes, O(Q·N)).
    """
    flat = ops.reshape(positives, [-1])
    flat_int = ops.cast(flat, "int32")
    size = flat_int.shape[0] if flat_int.shape[0] is not None else ops.size(flat_int)
    num_pairs = ops.sum(flat_int)
    padded = ((size + block - 1) // block) * block
    # Non-positive entries are sent to one dummy slot past the end (then dropped).
    target = ops.where(flat, ops.cumsum(flat_int) - 1, ops.full_like(flat_int, padded))
    updates = ops.where(flat, ops.arange(size, dtype="int32"), ops.zeros_like(flat_int))
    length = (padded + 1,) if isinstance(padded, int) else ops.reshape(padded + 1, [1])
    pair_index = ops.scatter_update(ops.zeros(length, "int32"),
                                    target[:, None], updates, reduction="add")
    return pair_index, num_pairs


def _block_kernels(positive_step, negative_step):
    """(forward, backward) functions of one block of positive pairs.

    ``forward(s, kind, flat, valid) -> (pos_sums, neg_sums)``, each (block,);
    ``backward(s, kind, flat, valid, g_pos, g_neg) -> (rows, w, col)`` with ``w``
    (block, N) the gradient reaching row ``rows[p]`` of the scores and ``col`` (block,)
    the one reaching the pair's own entry.
    """
    use_positive = positive_step is not None
    same_step = positive_step is negative_step
    pos_slopes = use_positive and positive_step.differentiable

    def geometry(s, kind, flat):
        num_items = s.shape[1] if s.shape[1] is not None else ops.shape(s)[1]
        rows = flat // num_items
        own = take(ops.reshape(s, [-1]), flat)
        t = take(s, rows, axis=0) - own[:, None]
        return rows, t, take(kind, rows, axis=0)

    def masked_row_sum(mask, values):
        return ops.sum(ops.where(mask, values, ops.zeros_like(values)), axis=1)

    def forward(s, kind, flat, valid):
        _, t, kinds = geometry(s, kind, flat)
        zero = ops.zeros_like(t[:, 0])
        neg_values = negative_step.value(t)
        neg = ops.where(valid, masked_row_sum(kinds == 2, neg_values), zero)
        if not use_positive:
            return zero, neg
        # Smooth-AP uses one step for both sums: evaluate it once. The sum over
        # positives runs over j = k too (t = 0); its term is taken off afterwards,
        # cheaper than masking the diagonal of every block.
        pos_values = neg_values if same_step else positive_step.value(t)
        self_term = positive_step.value(ops.zeros((), s.dtype))
        pos = masked_row_sum(kinds == 1, pos_values) - self_term
        return ops.where(valid, pos, zero), neg

    def backward(s, kind, flat, valid, g_pos, g_neg):
        rows, t, kinds = geometry(s, kind, flat)
        zero = ops.zeros_like(t[:, 0])
        _, slope = negative_step.value_and_slope(t)
        g_n = ops.where(valid, take(ops.reshape(g_neg, [-1]), flat), zero)[:, None]
        if pos_slopes:
            # Includes j = k, whose row and pair contributions cancel.
            g_p = ops.where(valid, take(ops.reshape(g_pos, [-1]), flat), zero)[:, None]
            if same_step:
                w = ops.where(kinds == 2, g_n, ops.where(kinds == 1, g_p, 0.0 * g_p)) * slope
            else:
                _, p_slope = positive_step.value_and_slope(t)
                w = (ops.where(kinds == 2, g_n * slope, ops.zeros_like(t))
                     + ops.where(kinds == 1, g_p * p_slope, ops.zeros_like(t)))
        else:
            w = ops.where(kinds == 2, g_n * slope, ops.zeros_like(t))
        return rows, w, -ops.sum(w, axis=1)

    return forward, backward


class _Blocks:
    """The enumeration of the positive pairs into fixed-size blocks, shared by the
    forward and backward loops of every backend."""

    def __init__(self, positives, block):
        self.block = block
        self.pair_index, self.num_pairs = _enumerate_pairs(positives, block)
        self.num_blocks = (self.num_pairs + block - 1) // block
        size = self.pair_index.shape[0]
        # Static when the shapes are (always on JAX and PyTorch).
        self.max_blocks = (size // block if size is not None and isinstance(block, int)
                           else ops.size(self.pair_index) // block)
        # Where pair (i, k) sits in the enumeration, to read per-pair results back.
        self.flat_positives = ops.reshape(positives, [-1])
        self.pair_order = ops.maximum(
            ops.cumsum(ops.cast(self.flat_positives, "int32")) - 1, 0)

    def pairs(self, b):
        """Flat indices of block ``b``'s pairs and which of them are real pairs."""
        offset = b * self.block
        flat = ops.slice(self.pair_index, ops.reshape(offset, [1]),
                         ops.reshape(self.block, [1]) if not isinstance(self.block, int)
                         else [self.block])
        valid = (ops.arange(self.block, dtype="int32") + offset) < self.num_pairs
        return flat, valid

    def to_matrix(self, per_block, like):
        """(blocks, block) results in pair order -> (Q, N), zero off the pairs."""
        values = take(ops.reshape(per_block, [-1]), self.pair_order)
        values = ops.where(self.flat_positives, values, ops.zeros_like(values))
        return ops.reshape(values, ops.shape(like))


def _keras_rank_terms(scores, kind, blocks, use_positive, forward_block, backward_block):
    """The blocked loop with ``keras.ops`` (JAX, PyTorch): results go into
    (max_blocks, block) buffers, the backward into a scatter-add."""
    block, max_blocks = blocks.block, blocks.max_blocks

    def run(step, init):
        def body(b, *state):
            return (b + 1, *step(b, *state))

        out = ops.while_loop(lambda b, *_: b < blocks.num_blocks, body,
                             (ops.convert_to_tensor(0, "int32"), *init),
                             maximum_iterations=max_blocks)
        return out[1:]

    def write(buffer, b, values):
        return ops.slice_update(buffer, (b, b * 0), ops.expand_dims(values, 0))  # same int type

    @ops.custom_gradient
    def terms(s):
        def forward(b, pos_buf, neg_buf):
            flat, valid = blocks.pairs(b)
            pos, neg = forward_block(s, kind, flat, valid)
            return write(pos_buf, b, pos), write(neg_buf, b, neg)

        empty = ops.zeros((max_blocks, block), s.dtype)
        pos_buf, neg_buf = run(forward, (empty, empty))
        neg_above = blocks.to_matrix(neg_buf, s)
        pos_above = blocks.to_matrix(pos_buf, s) if use_positive else ops.zeros_like(s)

        def grad(*args, upstream=None):
            if upstream is None:  # JAX passes it positionally
                (upstream,) = args
            g_pos, g_neg = upstream[0], upstream[1]

            def backward(b, d_s, col_buf):
                flat, valid = blocks.pairs(b)
                rows, w, col = backward_block(s, kind, flat, valid, g_pos, g_neg)
                # d t_ij / d s_ij = 1: whole rows, added here; d t_ij / d s_ik = -1:
                # one number per pair, scattered once after the loop.
                d_s = ops.scatter_update(d_s, rows[:, None], w, reduction="add")
                return d_s, write(col_buf, b, col)

            d_rows, col_buf = run(backward, (ops.zeros_like(s), empty))
            return d_rows + blocks.to_matrix(col_buf, s)

        # One output (the portable form of keras.ops.custom_gradient): both sums stacked.
        return ops.stack([pos_above, neg_above]), grad

    both = terms(scores)
    return both[0], both[1]


def positive_rank_terms(scores, positives, candidates, positive_step, negative_step,
                        pairs_per_block=None):
    """Smoothed counts of positives and negatives ranked above each positive pair.

    Args:
        scores: (Q, N) float scores (higher = more similar).
        positives: (Q, N) bool, relevant items; entries outside ``candidates`` are
            ignored.
        candidates: (Q, N) bool, items that take part in query i's ranking.
        positive_step: step applied to ``s_ij - s_ik`` for positives ``j != k``
            (``None`` skips that sum, which is then all zeros).
        negative_step: step applied for the negatives ``j`` (candidates that are not
            positives).
        pairs_per_block: positive pairs ranked per loop step; ``None`` picks about
            ``4M / N``. Bounds memory to O(pairs_per_block · N).

    Returns:
        ``(pos_above, neg_above)``, both (Q, N); entry (i, k) holds the sums for the
        positive pair (i, k) and is 0 elsewhere.

    Cost: O(P·N) time (P positive pairs), O(pairs_per_block·N + Q·N) memory, forward
    and backward alike.
    """
    scores = ops.convert_to_tensor(scores)
    candidates = ops.cast(candidates, "bool")
    positives = ops.logical_and(ops.cast(positives, "bool"), candidates)
    # One int8 code per item (1 positive, 2 negative, 0 out of the ranking): a block
    # gathers one byte per element instead of two masks.
    kind = ops.where(positives, ops.ones_like(positives, "int8"),
                     ops.where(candidates, ops.full_like(positives, 2, "int8"),
                               ops.zeros_like(positives, "int8")))
    num_queries = _static_or_dynamic(scores, 0)
    num_items = _static_or_dynamic(scores, 1)
    if isinstance(num_queries, int) and isinstance(num_items, int) and (
            num_queries * num_items >= 2**31 - 1):
        raise ValueError(  # pairs are addressed by int32 flat indices
            f"positive_rank_terms: a {num_queries} x {num_items} score matrix is too "
            "large (queries x items must stay below 2**31); rank fewer queries per call.")
    blocks = _Blocks(positives, _block_size(num_queries, num_items, pairs_per_block))
    forward_block, backward_block = _block_kernels(positive_step, negative_step)
    use_positive = positive_step is not None
    if on_tensorflow():
        from tfaploss.ops import tensorflow_kernels

        key = (None if positive_step is None else positive_step.key, negative_step.key,
               positive_step is negative_step)
        return tensorflow_kernels.blocked_rank_terms(
            scores, kind, blocks, use_positive, key, forward_block, backward_block)
    return _keras_rank_terms(scores, kind, blocks, use_positive, forward_block,
                             backward_block)


def _positive_count(positives, candidates):
    positives = ops.logical_and(ops.cast(positives, "bool"), ops.cast(candidates, "bool"))
    return positives, ops.sum(ops.cast(positives, "int32"), axis=1)


def _mean_over_positives(positives, values, counts):
    total = ops.sum(ops.where(positives, values, ops.zeros_like(values)), axis=1)
    return total / ops.cast(ops.maximum(counts, 1), values.dtype)


def _precision(pos_above, neg_above):
    # rank+/rank written as 1 - neg/rank: exactly 1, with exactly zero gradient, when
    # no negative is ranked (an all-positive batch).
    return 1.0 - neg_above / (1.0 + pos_above + neg_above)


def smooth_ap_per_query(scores, positives, candidates, temperature=0.01,
                        pairs_per_block=None):
    """Smooth-AP (Brown et al., ECCV 2020) of every query.

    ``AP_i = 1/|P_i| sum_{k in P_i} (1 + sum_{j in P_i, j!=k} sig(s_ij - s_ik))
    / (1 + sum_{j in C_i, j!=k} sig(s_ij - s_ik))`` with
    ``sig(t) = sigmoid(clip(t / temperature, -50, 50))``. For the original's
    convention (query counts as its own positive), pass masks whose diagonal is a
    positive candidate.

    Returns ``(ap, num_positives)``, each (Q,); ``ap`` is 0 where a query has no
    positive. Cost: O(P·N) time, O(pairs_per_block·N + Q·N) memory.
    """
    step = SigmoidStep(temperature)
    positives, counts = _positive_count(positives, candidates)
    pos_above, neg_above = positive_rank_terms(scores, positives, candidates, step, step,
                                               pairs_per_block)
    precision = _precision(pos_above, neg_above)
    return _mean_over_positives(positives, precision, counts), counts


def sup_ap_per_query(scores, positives, candidates, temperature=0.01, rho=100.0,
                     delta=0.05, start=0.5, offset=None, pairs_per_block=None):
    """ROADMAP's SupAP (Ramzi et al., NeurIPS 2021) of every query.

    As Smooth-AP, but positives ``j`` enter both ranks through the true step
    ``[s_ij >= s_ik]`` (no gradient) and negatives through :class:`SupAPUpperStep`,
    so ``SupAP_i <= AP_i`` (exact) for ``start >= 0.5``, ``offset >= 1``.

    Returns ``(ap, num_positives)``, each (Q,). Cost as :func:`smooth_ap_per_query`.
    """
    upper = SupAPUpperStep(temperature, rho, delta, start, offset)
    positives, counts = _positive_count(positives, candidates)
    pos_above, neg_above = positive_rank_terms(scores, positives, candidates,
                                               HeavisideStep(), upper, pairs_per_block)
    precision = _precision(pos_above, neg_above)
    return _mean_over_positives(positives, precision, counts), counts


def pnp_penalty(r, variant="Dq", b=2.0, alpha=4.0):
    """PNP's penalty f(R) of the smooth count R of negatives above a positive."""
    if variant == "O":
        return r
    if variant == "Iu":
        return (1.0 + r) * ops.log1p(r)
    if variant == "Ib":
        return (b * r - ops.log1p(b * r)) / (b * b)
    if variant == "Ds":
        return ops.log1p(r)
    if variant == "Dq":
        return 1.0 - ops.power(1.0 + r, -alpha)
    raise ValueError(f"variant must be one of {PNP_VARIANTS}; received {variant!r}.")


def pnp_per_query(scores, positives, candidates, variant="Dq", b=2.0, alpha=4.0,
                  temperature=0.01, pairs_per_block=None):
    """PNP (Li et al., AAAI 2022) loss of every query: ``mean_{k in P_i} f(R_ik)``.

    ``R_ik = sum_{j in N_i} sigmoid(clip((s_ij - s_ik) / temperature, -50, 50))``
    counts the negatives ranked above positive k; ``f`` is the variant's penalty
    (``"Dq"``: ``1 - (1 + R)^-alpha``, so the loss is ``1 - mean (1 + R)^-alpha``).

    Returns ``(values, num_positives)``, each (Q,). Cost: O(P·N) time,
    O(pairs_per_block·N + Q·N) memory.
    """
    if variant not in PNP_VARIANTS:
        raise ValueError(f"variant must be one of {PNP_VARIANTS}; received {variant!r}.")
    positives, counts = _positive_count(positives, candidates)
    _, neg_above = positive_rank_terms(scores, positives, candidates, None,
                                       SigmoidStep(temperature), pairs_per_block)
    return _mean_over_positives(positives, pnp_penalty(neg_above, variant, b, alpha),
                                counts), counts
