"""The pairs (i, k) of a (Q, N) mask, enumerated into fixed-size blocks, and the loop
that runs a block kernel over them with a hand-written gradient, on every backend.

One (block, N) tensor at a time inside a while loop (static block shapes, so it
compiles under XLA and ``jax.jit``); the backward pass recomputes each block, so
nothing of size O(P·N) is kept.

A block kernel is a pair ``(forward, backward)``:
``forward(s, kind, flat, valid) -> (first, second)``, each (block,), the two sums of
the block's pairs; ``backward(s, kind, flat, valid, g_first, g_second) -> (rows, w,
col)`` with ``w`` (block, N) the gradient reaching row ``rows[p]`` of the scores and
``col`` (block,) the one reaching the pair's own entry.
"""

from __future__ import annotations

from keras import ops

from tfaploss.ops.backend import dim, take, tf_kernels

# Elements of one (pairs_per_block, N) block when pairs_per_block is left to us:
# 4M floats keeps each temporary at 16 MiB (float32) whatever the batch size.
ELEMENTS_PER_BLOCK = 2**22


def block_size(num_queries, num_items, pairs_per_block):
    """Pairs per block: a Python int when the shapes are static (XLA), else a tensor."""
    if pairs_per_block is not None:
        if not (isinstance(pairs_per_block, int) and pairs_per_block > 0):
            raise ValueError("pairs_per_block must be a positive int or None; received "
                             f"{pairs_per_block!r}.")
        block = pairs_per_block
    elif isinstance(num_items, int):
        block = max(1, ELEMENTS_PER_BLOCK // max(num_items, 1))
    else:
        block = ops.maximum(1, ELEMENTS_PER_BLOCK // num_items)
    if isinstance(block, int) and isinstance(num_queries, int) and isinstance(num_items, int):
        block = max(1, min(block, num_queries * num_items))  # never pad past the matrix
    return block


def _enumerate_pairs(positives, block):
    """``(pair_index, num_pairs)``: the row-major flat indices of the positive pairs,
    padded to whole blocks. O(Q·N)."""
    flat = ops.reshape(positives, [-1])
    flat_int = ops.cast(flat, "int32")
    size = dim(flat_int, 0)
    num_pairs = ops.sum(flat_int)
    padded = ((size + block - 1) // block) * block
    # Non-positive entries are sent to one dummy slot past the end (then dropped).
    target = ops.where(flat, ops.cumsum(flat_int) - 1, ops.full_like(flat_int, padded))
    updates = ops.where(flat, ops.arange(size, dtype="int32"), ops.zeros_like(flat_int))
    length = (padded + 1,) if isinstance(padded, int) else ops.reshape(padded + 1, [1])
    pair_index = ops.scatter_update(ops.zeros(length, "int32"),
                                    target[:, None], updates, reduction="add")
    return pair_index, num_pairs


class Blocks:
    """The enumeration of the positive pairs into fixed-size blocks."""

    def __init__(self, positives, pairs_per_block=None):
        num_queries, num_items = dim(positives, 0), dim(positives, 1)
        if isinstance(num_queries, int) and isinstance(num_items, int) and (
                num_queries * num_items >= 2**31 - 1):
            raise ValueError(  # pairs are addressed by int32 flat indices
                f"a {num_queries} x {num_items} score matrix is too large to rank (queries "
                "x items must stay below 2**31); rank fewer queries per call.")
        self.block = block = block_size(num_queries, num_items, pairs_per_block)
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


def pair_gaps(s, kind, flat):
    """``(rows, t, kinds)`` of a block's pairs (flat indices ``flat`` into the (Q, N)
    ``s``): each pair's query row, ``t = s[row] - s[pair]``, (block, N), what every block
    kernel ranks, and that row of the (Q, N) ``kind``."""
    rows = flat // dim(s, 1)
    t = take(s, rows, axis=0) - take(ops.reshape(s, [-1]), flat)[:, None]
    return rows, t, take(kind, rows, axis=0)


def pair_values(values, flat, valid):
    """The (Q, N) ``values`` at a block's pairs, (block,); 0 for the padding past the
    last pair (a backward kernel's upstream gradient)."""
    read = take(ops.reshape(values, [-1]), flat)
    return ops.where(valid, read, ops.zeros_like(read))


def _keras_rank_terms(scores, kind, blocks, use_positive, forward_block, backward_block):
    """The blocked loop with ``keras.ops`` (JAX, PyTorch), into (max_blocks, block)
    buffers."""
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
                # Rows added here; each pair's own entry (-1) scattered after the loop.
                d_s = ops.scatter_update(d_s, rows[:, None], w, reduction="add")
                return d_s, write(col_buf, b, col)

            d_rows, col_buf = run(backward, (ops.zeros_like(s), empty))
            return d_rows + blocks.to_matrix(col_buf, s)

        # One output (the portable form of keras.ops.custom_gradient): both sums stacked.
        return ops.stack([pos_above, neg_above]), grad

    both = terms(scores)
    return both[0], both[1]


def blocked_rank_terms(scores, kind, blocks, use_first, key, forward_block, backward_block):
    """The two (Q, N) sums of ``forward_block`` at every pair of ``blocks`` (0 off the
    pairs), with the gradient of ``backward_block``. ``kind``: what the kernels read
    per entry besides the scores; ``use_first``: whether the first sum is needed (else
    zeros); ``key``: names the kernels (TensorFlow compiles them once per key)."""
    kernels = tf_kernels()
    if kernels:
        return kernels.blocked_rank_terms(scores, kind, blocks, use_first, key,
                                          forward_block, backward_block)
    return _keras_rank_terms(scores, kind, blocks, use_first, forward_block, backward_block)
