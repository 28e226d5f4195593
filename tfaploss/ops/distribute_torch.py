"""Ranking the global batch under ``torch.distributed`` (imported on PyTorch only).

The gradient contract is DistributedDataParallel's: parameter gradients are AVERAGED
over the ranks, once. Every rank evaluates the same global loss ``L`` of the gathered
(B, D) embeddings ``E`` (rank r owns rows ``E_r``); the backward of :func:`gather_rows`
all-reduces (sums) the ranks' (B, D) gradients and keeps rank r's rows, so rank r gets
``W * dL/dE_r`` (W identical copies of the global gradient), hence parameter gradients
``W * J_r^T dL/dE_r`` (``J_r = dE_r/dtheta``). DDP's average over the ranks is
``(1/W) sum_r W * J_r^T dL/dE_r = sum_r J_r^T dL/dE_r = dL/dtheta``: exactly the
one-process gradient of the global batch. (An all-reduce that SUMS parameter
gradients would give W times it.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    """Ranks of the default ``torch.distributed`` process group (1 when none is set up)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def _row_counts(local: int, device) -> list[int]:
    """Every rank's number of rows, in rank order (an all-gather of one int64)."""
    count = torch.tensor([local], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world_size())]
    dist.all_gather(counts, count)
    return [int(c) for c in counts]


def _all_gather_rows(tensor, counts):
    """Every rank's rows of ``tensor`` in rank order, without gradient (shards padded
    to the longest: ``all_gather`` needs one shape)."""
    tensor = tensor.detach()
    longest = max(counts)
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]))
        tensor = torch.cat([tensor, pad])
    parts = [torch.empty_like(tensor) for _ in counts]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


class _GatherRows(torch.autograd.Function):
    """All-gather of rows whose backward sums the ranks' gradients of this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, counts, rank):
        ctx.counts, ctx.rank = counts, rank
        return _all_gather_rows(tensor, counts)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's loss may depend on every row: sum over ranks (module docstring).
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = sum(ctx.counts[:ctx.rank])
        return grad[start:start + ctx.counts[ctx.rank]], None, None


def gather_rows(tensor, counts=None):
    """Every rank's rows of ``tensor``, in rank order; the backward sums the ranks'
    gradients of this rank's rows (module docstring). A collective. ``counts``: every
    rank's row count, when known (else gathered first)."""
    if counts is None:
        counts = _row_counts(tensor.shape[0], tensor.device)
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _GatherRows.apply(tensor, counts, dist.get_rank())
    return _all_gather_rows(tensor, counts)


def gather_ranks(labels, embeddings, sample_weight):
    """Every rank's ``labels``, ``embeddings`` (differentiable) and ``sample_weight``
    (or None), in rank order; and this rank's ``(start, stop)`` rows in them.

    Cost: all-gathers of the row counts, (B, D) embeddings, labels and weights, and an
    all-reduce of the embeddings' gradient.
    """
    counts = _row_counts(embeddings.shape[0], embeddings.device)
    start = sum(counts[:dist.get_rank()])

    def gather(tensor):
        return None if tensor is None else gather_rows(tensor, counts)

    return (gather(labels), gather(embeddings), gather(sample_weight),
            (start, start + embeddings.shape[0]))


def average_gradients(grads):
    """``grads`` (tensors) averaged over the ranks in place: one all-reduce per dtype."""
    ranks = world_size()
    by_dtype = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= ranks
        offset = 0
        for grad in group:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    return grads


def broadcast_from_first_rank(variables):
    """Rank 0's values of the Keras ``variables`` on every rank (as DDP does at start)."""
    with torch.no_grad():
        for variable in variables:
            value = variable.value
            data = value.data if isinstance(value, torch.nn.Parameter) else value
            dist.broadcast(data, src=0)
