"""Ranking the global batch on several devices: the one home of the gathering.

A ranking loss is not a sum of per-sample losses: under data parallelism each replica
holds a shard of the batch, and ranking each shard on its own gives another loss (none
at all when no shard holds two items of one class). So a loss call on one of several
replicas all-gathers every replica's labels, embeddings (with their gradient) and
sample weights, ranks the global batch and returns this replica's share
(:func:`global_batch_loss`): :class:`tfaploss.losses.RetrievalLoss`,
:class:`tfaploss.losses.XBMLoss` and :class:`tfaploss.training.MultiStageModel` all go
through this module.

- TensorFlow: a replica context of ``MirroredStrategy`` or
  ``MultiWorkerMirroredStrategy``; the shares sum to the one-device loss and so do
  their gradients (the gather's backward sums the replicas' gradients of every row;
  the optimizer sums the replicas' weight gradients).
- PyTorch: an initialised ``torch.distributed`` process group of several ranks, each a
  replica (:mod:`tfaploss.ops.distribute_torch`, DistributedDataParallel's averaged
  gradients).
- JAX sees one batch per call (Keras shards it under ``jit``) and never gathers.

:func:`global_batch` marks code that already holds the global batch (``MultiStageModel``
gathers it itself), so that nothing is gathered twice. ``docs/losses.md`` ("Several
devices") states the contract for users.
"""

from __future__ import annotations

import contextlib
import threading

import keras

from tfaploss.ops.backend import on_tensorflow

# Per thread: MirroredStrategy traces each replica's step in a thread of its own.
_STATE = threading.local()


@contextlib.contextmanager
def global_batch():
    """Within this context, loss calls take their inputs as the global batch already."""
    depth = getattr(_STATE, "depth", 0)
    _STATE.depth = depth + 1
    try:
        yield
    finally:
        _STATE.depth = depth


def holds_global_batch() -> bool:
    """Whether the caller said (:func:`global_batch`) that it holds the global batch."""
    return getattr(_STATE, "depth", 0) > 0


def replicas_to_gather(owner: str, shapes_only: bool = False) -> int:
    """How many replicas a loss call must gather the batch from (1: none to gather).

    More than 1 only outside :func:`global_batch`: on TensorFlow in a replica context
    of a ``tf.distribute`` strategy with several replicas in sync; on PyTorch under an
    initialised ``torch.distributed`` process group of several ranks. Raises where
    the global batch cannot be gathered (see :func:`_supported_replicas`), rather
    than let each replica rank its own shard. ``shapes_only``: Keras is tracing the
    call for its output shapes (``fit`` does once, in the cross-replica context):
    nothing runs, so nothing is gathered or refused.
    """
    if holds_global_batch() or shapes_only:
        return 1
    if _on_torch():
        from tfaploss.ops import distribute_torch

        return distribute_torch.world_size()
    if not on_tensorflow():
        return 1
    return _supported_replicas(owner)


def _on_torch() -> bool:
    return keras.backend.backend() == "torch"


def _supported_replicas(owner: str) -> int:
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    if replicas == 1:
        return 1
    name = type(strategy).__name__
    if tf.distribute.get_replica_context() is None:
        raise RuntimeError(
            f"{owner} was called in the cross-replica context of {name} ({replicas} "
            "replicas in sync), where it cannot gather the replicas' shards of the "
            "batch. Call it per replica, inside strategy.run (as Model.fit does), "
            "where it ranks the global batch; or outside strategy.scope().")
    supported = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)
    if not isinstance(strategy, supported):
        raise ValueError(  # noqa: TRY004 - a strategy the loss cannot serve, not a bad type
            f"{owner} ranks the global batch under tf.distribute by all-gathering every "
            "replica's embeddings and labels, which is supported under MirroredStrategy "
            f"and MultiWorkerMirroredStrategy only; received {name} with {replicas} "
            "replicas in sync. Ranking each replica's shard on its own would give "
            "another loss (no positive pair may fall inside one shard). Train under "
            "MirroredStrategy or MultiWorkerMirroredStrategy, or on one replica.")
    return replicas


def replica_id():
    """This replica's index under a ``tf.distribute`` strategy with several replicas in
    sync, as a Python int; None elsewhere (one replica, a cross-replica context, JAX,
    PyTorch, where each process or trace is one replica). Keys state that one call of a
    replica's step hands to the next (MirroredStrategy runs each replica in a thread of
    its own)."""
    if not on_tensorflow():
        return None
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    return None if replica is None else int(replica)


def refuse_per_replica(owner: str, entry: str, shapes_only: bool = False) -> None:
    """Raise if ``entry`` (a loss entry point that does not gather) would rank each
    replica's shard of the batch on its own (``shapes_only``: see
    :func:`replicas_to_gather`)."""
    replicas = replicas_to_gather(owner, shapes_only)
    if replicas > 1:
        if _on_torch():
            where = f"torch.distributed ({replicas} ranks) that is one rank's"
        else:
            import tensorflow as tf

            where = (f"{type(tf.distribute.get_strategy()).__name__} ({replicas} "
                     "replicas in sync) that is one replica's")
        raise ValueError(
            f"{owner}: {entry} ranks only the batch it is given, and under "
            f"{where} shard of the global batch. Train it with "
            "tfaploss.training.MultiStageModel (it ranks the global batch on every "
            "replica), or on one replica.")


def gather_replicas(labels, embeddings, sample_weight):
    """Every replica's rows of ``labels``, ``embeddings`` and ``sample_weight`` (each a
    tensor, a nested structure of tensors, or None), in replica order, with the
    gradient; and this replica's ``(start, stop)`` rows in them. Shards may differ in
    size. Call where :func:`replicas_to_gather` returned more than 1 (TensorFlow: in a
    replica context; PyTorch: on every rank, see
    :func:`tfaploss.ops.distribute_torch.gather_ranks`).

    Cost: an all-gather of the (B, D) embeddings (and its backward: an all-reduce of
    their (B, D) gradient, of which each replica keeps its rows) and of B labels.
    """
    if _on_torch():
        from tfaploss.ops import distribute_torch

        return distribute_torch.gather_ranks(labels, embeddings, sample_weight)
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    local = tf.shape(embeddings)[0]
    sizes = context.all_gather(tf.reshape(local, [1]), axis=0)
    start = tf.reduce_sum(sizes[: context.replica_id_in_sync_group])

    def gather(structure):
        # The identity places the tensor on this replica's device: a step's input (the
        # labels, as given) has no device, and MultiWorkerMirroredStrategy with one
        # device per worker then refuses to gather it ("destinations can not be empty").
        return keras.tree.map_structure(
            lambda tensor: None if tensor is None
            else context.all_gather(tf.identity(tensor), axis=0),
            structure)

    return (gather(labels), gather(embeddings), gather(sample_weight),
            (start, start + local))


def replica_share(loss, reduction: str, replicas: int, rows):
    """This replica's share of ``loss``, the loss of the global batch (reduced by
    Keras in this replica context), such that the replicas' shares, summed (as the
    optimizer sums their gradients), give the one-device loss and gradient.

    The mean reductions are already divided by ``replicas`` (Keras's
    ``scale_loss_for_distribution``); ``"sum"`` is divided here; ``"none"`` keeps
    this replica's ``rows`` (the gather's gradient sums over replicas, so the rows'
    gradient is the one-device one).

    On PyTorch, where DistributedDataParallel AVERAGES the ranks' gradients, every
    rank keeps the whole loss for the mean reductions and ``"sum"`` alike (Keras scales
    neither there): the ranks' shares averaged are the one-process loss, and so are
    their gradients (:mod:`tfaploss.ops.distribute_torch`). ``"none"`` keeps this
    rank's rows, to be reduced as any per-sample loss under DDP.
    """
    if reduction in (None, "none"):
        start, stop = rows
        return loss[start:stop]
    if _on_torch():
        return loss
    import tensorflow as tf

    if reduction == "sum":
        return loss / tf.cast(replicas, loss.dtype)
    return loss


def global_batch_loss(reduced, labels, embeddings, sample_weight, reduction: str,
                      replicas: int):
    """``reduced(labels, embeddings, sample_weight)``, a loss reduced by ``reduction``, of
    the global batch gathered from every replica's rows of this replica's ``labels``,
    ``embeddings`` and ``sample_weight`` (None or one weight per row); returned as this
    replica's share (:func:`replica_share`). Call where :func:`replicas_to_gather`
    returned ``replicas`` > 1.
    """
    labels, embeddings, sample_weight, rows = gather_replicas(labels, embeddings,
                                                              sample_weight)
    with global_batch():
        loss = reduced(labels, embeddings, sample_weight)
    return replica_share(loss, reduction, replicas, rows)
