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
``tf.while_loop`` (a data-dependent trip count with static block shapes, so it also
compiles under XLA). A block is a (pairs_per_block, N) tensor; the default block size
keeps it at about 4M elements (16 MiB in float32). The gradient is written by hand
(:func:`positive_rank_terms` is a ``tf.custom_gradient``) and recomputes each block in
a second loop, so nothing of size O(P·N) is kept for the backward pass either.

Cost: O(P·N) time with P = number of positive pairs <= Q·m (m = most positives of any
query), i.e. O(B·m·B) for a batch, and O(pairs_per_block·N + Q·N) memory, for the
forward pass and again for the backward pass. Nothing depends on how labels are laid
out: classes need not be contiguous nor equally sized. Inside a graph each block's
elementwise chain runs as one jit-compiled (fused) kernel, about twice as fast on CPU
as separate TensorFlow ops; ``jit_compile=True`` on the whole step is faster still.

Use a non-persistent ``tf.GradientTape`` (as Keras does): inside a ``tf.function`` a
persistent tape makes TensorFlow keep every loop iteration's intermediates, which
brings back O(P·N) memory (and does not compile under XLA).
"""

from __future__ import annotations

import math

import tensorflow as tf

# Elements of one (pairs_per_block, N) block when pairs_per_block is left to us:
# 4M floats keeps each temporary at 16 MiB (float32) whatever the batch size.
_ELEMENTS_PER_BLOCK = 2**22
_CLIP = 50.0  # sigmoid argument clip of the Smooth-AP/ROADMAP/PNP code

PNP_VARIANTS = ("O", "Iu", "Ib", "Ds", "Dq")


def sigmoid_tau(t, temperature):
    """``sigmoid(clip(t / temperature, -50, 50))``, the originals' smoothed step."""
    return tf.sigmoid(tf.clip_by_value(t / temperature, -_CLIP, _CLIP))


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
        v = tf.sigmoid(tf.clip_by_value(z, -_CLIP, _CLIP))
        # Past the clip the originals' autograd gives zero slope; so do we.
        slope = tf.where(tf.abs(z) <= _CLIP, v * (1.0 - v) / self.temperature,
                         tf.zeros_like(v))
        return v, slope


class HeavisideStep:
    """True step ``[t >= 0]`` with no gradient (SupAP's positive pairs)."""

    differentiable = False
    key = ("heaviside",)

    def value(self, t):
        return tf.cast(t >= 0, t.dtype)

    def value_and_slope(self, t):
        v = self.value(t)
        return v, tf.zeros_like(v)


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
        value = tf.where(t <= 0, sig,
                         tf.where(t <= self.delta, self.start + sig,
                                  self.rho * (t - self.delta) + self.offset))
        slope = tf.where(t > self.delta, tf.fill(tf.shape(t), tf.cast(self.rho, t.dtype)),
                         sig_slope)
        return value, slope

    def value(self, t):
        return self._pieces(t)[0]

    def value_and_slope(self, t):
        return self._pieces(t)


def _static_or_dynamic(x, axis):
    static = x.shape[axis]
    return int(static) if static is not None else tf.shape(x)[axis]


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
        block = tf.maximum(1, _ELEMENTS_PER_BLOCK // num_items)
    if isinstance(block, int) and isinstance(num_queries, int) and isinstance(num_items, int):
        block = max(1, min(block, num_queries * num_items))  # never pad past the matrix
    return block


def _enumerate_pairs(positives, block):
    """Row-major flat indices of the positive pairs, padded to whole blocks.

    Returns ``(pair_index, num_pairs)``: ``pair_index[p]`` is the flat (Q·N) index of
    the p-th positive pair for ``p < num_pairs``; later entries are padding. Built
    with a cumulative sum and one scatter (static shapes, O(Q·N)).
    """
    flat = tf.reshape(positives, [-1])
    flat_int = tf.cast(flat, tf.int32)
    size = tf.size(flat_int)
    num_pairs = tf.reduce_sum(flat_int)
    padded = ((size + block - 1) // block) * block
    # Non-positive entries are sent to one dummy slot past the end (then dropped).
    target = tf.where(flat, tf.cumsum(flat_int) - 1, tf.fill(tf.shape(flat_int), padded))
    updates = tf.where(flat, tf.range(size), tf.zeros_like(flat_int))
    pair_index = tf.scatter_nd(target[:, None], updates, shape=padded[None] + 1)
    return pair_index, num_pairs


# jit-compiled block kernels, shared by every call with the same steps. Outside XLA
# the TensorFlow runtime runs each elementwise op of a block as its own pass over a
# (pairs_per_block, N) tensor; compiling the block fuses them (~2x faster on CPU).
# Set to False on a device without XLA support.
FUSE_BLOCKS = True
_KERNELS = {}


def _block_kernels(positive_step, negative_step):
    """(forward, backward) functions of one block of positive pairs.

    ``forward(s, kind, flat, valid) -> (pos_sums, neg_sums)``, each (block,);
    ``backward(s, kind, flat, valid, g_pos, g_neg) -> (rows, w, col)`` with ``w``
    (block, N) the gradient reaching row ``rows[p]`` of the scores and ``col`` (block,)
    the one reaching the pair's own entry. In eager mode the plain Python functions
    are returned (no compilation per shape); in a graph they are jit-compiled.
    """
    use_positive = positive_step is not None
    same_step = positive_step is negative_step
    pos_slopes = use_positive and positive_step.differentiable

    def geometry(s, kind, flat):
        num_items = tf.shape(s)[1]
        rows = flat // num_items
        pairs = tf.stack([rows, flat % num_items], axis=1)
        t = tf.gather(s, rows) - tf.gather_nd(s, pairs)[:, None]
        return rows, pairs, t, tf.gather(kind, rows)

    def masked_row_sum(mask, values):
        return tf.reduce_sum(tf.where(mask, values, tf.zeros_like(values)), axis=1)

    def forward(s, kind, flat, valid):
        _, _, t, kinds = geometry(s, kind, flat)
        zero = tf.zeros_like(t[:, 0])
        neg_values = negative_step.value(t)
        neg = tf.where(valid, masked_row_sum(kinds == 2, neg_values), zero)
        if not use_positive:
            return zero, neg
        # Smooth-AP uses one step for both sums: evaluate it once. The sum over
        # positives runs over j = k too (t = 0); its term is taken off afterwards,
        # cheaper than masking the diagonal of every block.
        pos_values = neg_values if same_step else positive_step.value(t)
        self_term = positive_step.value(tf.zeros([], s.dtype))
        pos = masked_row_sum(kinds == 1, pos_values) - self_term
        return tf.where(valid, pos, zero), neg

    def backward(s, kind, flat, valid, g_pos, g_neg):
        rows, pairs, t, kinds = geometry(s, kind, flat)
        zero = tf.zeros_like(t[:, 0])
        _, slope = negative_step.value_and_slope(t)
        g_n = tf.where(valid, tf.gather_nd(g_neg, pairs), zero)[:, None]
        if pos_slopes:
            # Includes j = k, whose row and pair contributions cancel.
            g_p = tf.where(valid, tf.gather_nd(g_pos, pairs), zero)[:, None]
            if same_step:
                w = tf.where(kinds == 2, g_n, tf.where(kinds == 1, g_p, 0.0 * g_p)) * slope
            else:
                _, p_slope = positive_step.value_and_slope(t)
                w = (tf.where(kinds == 2, g_n * slope, tf.zeros_like(t))
                     + tf.where(kinds == 1, g_p * p_slope, tf.zeros_like(t)))
        else:
            w = tf.where(kinds == 2, g_n * slope, tf.zeros_like(t))
        return rows, w, -tf.reduce_sum(w, axis=1)

    if tf.executing_eagerly() or not FUSE_BLOCKS:
        return forward, backward
    key = (None if positive_step is None else positive_step.key, negative_step.key,
           same_step)
    if key not in _KERNELS:
        _KERNELS[key] = (tf.function(forward, jit_compile=True, autograph=False),
                         tf.function(backward, jit_compile=True, autograph=False))
    return _KERNELS[key]


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
    scores = tf.convert_to_tensor(scores)
    candidates = tf.cast(candidates, tf.bool)
    positives = tf.logical_and(tf.cast(positives, tf.bool), candidates)
    # One int8 code per item (1 positive, 2 negative, 0 out of the ranking): a block
    # gathers one byte per element instead of two masks.
    kind = tf.where(positives, tf.ones_like(positives, tf.int8),
                    tf.where(candidates, tf.fill(tf.shape(positives), tf.constant(2, tf.int8)),
                             tf.zeros_like(positives, tf.int8)))
    num_queries = _static_or_dynamic(scores, 0)
    num_items = _static_or_dynamic(scores, 1)
    if isinstance(num_queries, int) and isinstance(num_items, int) and (
            num_queries * num_items >= 2**31 - 1):
        raise ValueError(  # pairs are addressed by int32 flat indices
            f"positive_rank_terms: a {num_queries} x {num_items} score matrix is too "
            "large (queries x items must stay below 2**31); rank fewer queries per call.")
    block = _block_size(num_queries, num_items, pairs_per_block)
    pair_index, num_pairs = _enumerate_pairs(positives, block)
    num_blocks = (num_pairs + block - 1) // block
    max_blocks = tf.size(pair_index) // block  # static when the shapes are
    # Where pair (i, k) sits in the enumeration, to read per-pair results back.
    flat_positives = tf.reshape(positives, [-1])
    pair_order = tf.maximum(tf.cumsum(tf.cast(flat_positives, tf.int32)) - 1, 0)
    use_positive = positive_step is not None
    forward_block, backward_block = _block_kernels(positive_step, negative_step)

    def block_pairs(b):
        offset = b * block
        flat = tf.slice(pair_index, offset[None], tf.reshape(block, [1]))
        valid = (tf.range(block) + offset) < num_pairs
        return flat, valid

    def per_pair_to_matrix(per_block, like):
        """(max_blocks, block) results in pair order -> (Q, N), zero off the pairs."""
        flat = tf.reshape(per_block, [-1])
        values = tf.gather(flat, pair_order)
        values = tf.where(flat_positives, values, tf.zeros_like(values))
        return tf.reshape(values, tf.shape(like))

    def new_array(dtype):
        return tf.TensorArray(dtype, size=max_blocks, element_shape=[block]
                              if isinstance(block, int) else None)

    @tf.custom_gradient
    def terms(s):
        def body(b, pos_arr, neg_arr):
            flat, valid = block_pairs(b)
            pos, neg = forward_block(s, kind, flat, valid)
            if use_positive:
                pos_arr = pos_arr.write(b, pos)
            return b + 1, pos_arr, neg_arr.write(b, neg)

        _, pos_arr, neg_arr = tf.while_loop(
            lambda b, *_: b < num_blocks, body,
            (tf.constant(0), new_array(s.dtype), new_array(s.dtype)),
            parallel_iterations=1, maximum_iterations=max_blocks)
        neg_above = per_pair_to_matrix(neg_arr.stack(), s)
        pos_above = (per_pair_to_matrix(pos_arr.stack(), s) if use_positive
                     else tf.zeros_like(s))

        def grad(g_pos, g_neg):
            g_neg = tf.zeros_like(s) if g_neg is None else g_neg
            g_pos = tf.zeros_like(s) if g_pos is None else g_pos

            def back(b, d_s, col_arr):
                flat, valid = block_pairs(b)
                rows, w, col = backward_block(s, kind, flat, valid, g_pos, g_neg)
                # d t_ij / d s_ij = 1: whole rows, added here; d t_ij / d s_ik = -1:
                # one number per pair, scattered once after the loop.
                d_s = tf.tensor_scatter_nd_add(d_s, rows[:, None], w)
                return b + 1, d_s, col_arr.write(b, col)

            _, d_rows, col_arr = tf.while_loop(
                lambda b, *_: b < num_blocks, back,
                (tf.constant(0), tf.zeros_like(s), new_array(s.dtype)),
                parallel_iterations=1, maximum_iterations=max_blocks)
            return d_rows + per_pair_to_matrix(col_arr.stack(), s)

        return (pos_above, neg_above), grad

    return terms(scores)


def _positive_count(positives, candidates):
    positives = tf.logical_and(tf.cast(positives, tf.bool), tf.cast(candidates, tf.bool))
    return positives, tf.reduce_sum(tf.cast(positives, tf.int32), axis=1)


def _mean_over_positives(positives, values, counts):
    total = tf.reduce_sum(tf.where(positives, values, tf.zeros_like(values)), axis=1)
    return total / tf.cast(tf.maximum(counts, 1), values.dtype)


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
        return (1.0 + r) * tf.math.log1p(r)
    if variant == "Ib":
        return (b * r - tf.math.log1p(b * r)) / (b * b)
    if variant == "Ds":
        return tf.math.log1p(r)
    if variant == "Dq":
        return 1.0 - tf.pow(1.0 + r, -alpha)
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
