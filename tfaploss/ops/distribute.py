"""Ranking the global batch on several devices: the one home of the gathering.

Ranking each replica's shard on its own gives another loss, so a loss call on one of
several replicas (TensorFlow ``MirroredStrategy``/``MultiWorkerMirroredStrategy``,
PyTorch ``torch.distributed``; JAX never gathers) all-gathers every replica's rows,
ranks the global batch and returns this replica's share (:func:`global_batch_loss`).
:func:`global_batch` marks code that holds the global batch already. ``docs/losses.md``
("Several devices") states the contract.
"""

from __future__ import annotations

import contextlib
import threading

import keras
from keras import ops

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


def replicas_to_gather(owner: str, shapes_only: bool = False) -> int:
    """How many replicas a loss call must gather the batch from (1: none to gather).

    Raises where the global batch cannot be gathered, rather than let each replica rank
    its own shard. ``shapes_only``: Keras traces the call for its output shapes only
    (nothing runs, so nothing is gathered or refused).
    """
    if getattr(_STATE, "depth", 0) > 0 or shapes_only:  # within global_batch()
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
    sync, as a Python int; None elsewhere."""
    if not on_tensorflow():
        return None
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    return None if replica is None else int(replica)


def refuse_per_replica(owner: str, entry: str, shapes_only: bool = False) -> None:
    """Raise if ``entry`` (a loss entry point that does not gather) would rank one
    replica's shard of the batch."""
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
    gradient; and this replica's ``(start, stop)`` rows in them.

    Cost: an all-gather of the (B, D) embeddings (backward: an all-reduce of their
    gradient) and of B labels.
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
        # The identity places the tensor on this replica's device: without one,
        # MultiWorkerMirroredStrategy refuses ("destinations can not be empty").
        return keras.tree.map_structure(
            lambda tensor: None if tensor is None
            else context.all_gather(tf.identity(tensor), axis=0),
            structure)

    return (gather(labels), gather(embeddings), gather(sample_weight),
            (start, start + local))


def replica_share(loss, reduction: str, replicas: int, rows):
    """This replica's share of ``loss``, the global batch's loss reduced by Keras here.

    TensorFlow: the shares sum (as the optimizer sums gradients) to the one-device loss;
    Keras already divides the means by ``replicas``, ``"sum"`` is divided here.
    PyTorch: every rank keeps the whole loss, since DistributedDataParallel averages
    (:mod:`tfaploss.ops.distribute_torch`). ``"none"``: this replica's ``rows``.
    """
    if reduction in (None, "none"):
        start, stop = rows
        return loss[start:stop]
    if reduction == "sum" and not _on_torch():
        return loss / ops.cast(replicas, loss.dtype)
    return loss


def global_batch_loss(reduced, labels, embeddings, sample_weight, reduction: str,
                      replicas: int):
    """``reduced(labels, embeddings, sample_weight)`` of the global batch gathered from
    every replica's rows, as this replica's share (:func:`replica_share`)."""
    labels, embeddings, sample_weight, rows = gather_replicas(labels, embeddings,
                                                              sample_weight)
    with global_batch():
        loss = reduced(labels, embeddings, sample_weight)
    return replica_share(loss, reduction, replicas, rows)
