"""A run across processes: who this process is (:func:`current`, set up by
:func:`start` from torchrun's or JAX's launch) and the collectives its ranks share.
docs/scale_out.md, "``tfaploss train`` across processes and machines", has the
launchers, the rules and the timings.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import keras

from tfaploss.config.fields import ConfigError
from tfaploss.durable.checkpoints import RunBackup, read_latest

__all__ = ["GroupBackup", "ProcessGroup", "RankStoppedError", "StopAgreement",
           "agreed_stop", "check_resume", "check_shards", "current", "start"]

LOG = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600
# JAX's own default: how long before a process whose heartbeats stopped counts as dead.
_JAX_HEARTBEAT_S = 100


class RankStoppedError(RuntimeError):
    """Another rank stopped (rank 0 failed while the others waited for it); its own
    output says why."""


@dataclass(frozen=True)
class ProcessGroup:
    """This process's place among the ranks of a run (one process: rank 0 of 1);
    ``launcher``: ``"torchrun"``, ``"coordinator"``, ``"cluster"`` or ``"user"``."""

    backend: str = "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "none"
    timeout_s: int = DEFAULT_TIMEOUT_S

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes the run directory."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        if not self.distributed:
            return "one process"
        how = {"torch": "torch.distributed", "jax": "jax.distributed"}[self.backend]
        return (f"{self.world_size} processes ({how}, launched by {self.launcher}); this "
                f"is rank {self.rank}; rank 0 writes the run directory")

    def to_dict(self) -> dict:
        return {"processes": self.world_size, "backend": self.backend,
                "launcher": self.launcher, "timeout_s": self.timeout_s}

    def shard(self) -> dict:
        """``make_train_dataset``'s ``num_shards`` and ``shard_index`` for this rank."""
        return {"num_shards": self.world_size, "shard_index": self.rank}

    def any_rank(self, *values: int) -> tuple[int, ...]:
        """Each value's maximum over the ranks (a collective). Cost: one all-reduce
        (0.3 ms on gloo, 4 ms on JAX, 2 CPU processes, ``benchmarks/stop_agreement.py``)."""
        values = tuple(int(v) for v in values)
        if not self.distributed:
            return values
        if self.backend == "torch":
            import torch
            import torch.distributed as dist

            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            tensor = torch.tensor(values, dtype=torch.int64, device=device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            return tuple(int(v) for v in tensor.tolist())
        import numpy as np
        from jax.experimental import multihost_utils

        gathered = multihost_utils.process_allgather(np.asarray(values, np.int32))
        return tuple(int(v) for v in np.asarray(gathered).reshape(-1, len(values)).max(0))

    def barrier(self) -> None:
        """Wait until every rank is here (a collective; nothing with one process)."""
        self.any_rank(0)

    def main_first(self, fn, what: str):
        """Rank 0 runs ``fn`` (its result; None elsewhere) once every rank is here, while
        the others wait; if ``fn`` raises, they raise :class:`RankStoppedError` naming
        ``what`` rather than wait for a timeout."""
        if not self.distributed:
            return fn()
        self.barrier()
        result = None
        if self.is_main:
            try:
                with self.alone():
                    result = fn()
            except Exception:
                try:
                    self.any_rank(1)  # tell the others, then stop
                except Exception as err:  # noqa: BLE001 - the first error is the one raised
                    LOG.debug("rank 0 could not tell the others it stopped: %s", err)
                raise
        (failed,) = self.any_rank(0)
        if failed:
            raise RankStoppedError(f"rank 0 stopped while {what} (its output says why); "
                                   f"rank {self.rank} stops too")
        return result

    @contextlib.contextmanager
    def alone(self):
        """A block this rank runs alone (a checkpoint). Under JAX across processes, no
        Keras distribution meanwhile: a variable created in it (Keras's saving makes a
        throwaway optimizer) would ask every process to take part."""
        if not (self.distributed and self.backend == "jax"):
            yield
            return
        previous = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            yield
        finally:
            keras.distribution.set_distribution(previous)

    def local_model(self, model):
        """``model``, or under JAX across processes a copy on this process's devices, for
        work one rank does alone (an evaluation) without waiting for the others."""
        if not (self.distributed and self.backend == "jax"):
            return model
        import numpy as np

        with self.alone():
            copy = keras.models.clone_model(model)
            copy.set_weights([np.asarray(w) for w in model.get_weights()])
        return copy


_GROUP = ProcessGroup()


def current() -> ProcessGroup:
    """The group :func:`start` set up (one process before, or without, it)."""
    return _GROUP


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}: must be a whole number, "
                          f"received {value!r}") from None


def start(distribute=None, *, coordinator: str | None = None,
          num_processes: int | None = None, process_id: int | None = None) -> ProcessGroup:
    """Join the ranks of this run when a launcher started several; returns the group
    (the one already started, when called again).

    ``distribute``: ``training.distribute`` (its ``timeout_s``: how long a rank waits
    for the others). ``coordinator``, ``num_processes``, ``process_id``: JAX's
    (default: the ``JAX_*`` variables); PyTorch reads torchrun's environment. Raises
    :class:`~tfaploss.config.ConfigError` when the launch does not fit the backend.
    """
    global _GROUP
    if _GROUP.distributed:
        return _GROUP
    timeout = int(getattr(distribute, "timeout_s", None) or DEFAULT_TIMEOUT_S)
    backend = keras.backend.backend()
    world = _env_int("WORLD_SIZE")
    torchrun = world is not None and world > 1
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None:
        num_processes = _env_int("JAX_NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int("JAX_PROCESS_ID")
    if backend == "torch":
        if coordinator is not None:
            raise ConfigError(
                f"--coordinator {coordinator!r} starts JAX processes; under "
                "KERAS_BACKEND=torch launch the ranks with torchrun (docs/scale_out.md).")
        _GROUP = _start_torch(timeout, torchrun)
    elif backend == "jax":
        if torchrun:
            raise ConfigError(
                f"torchrun's environment (WORLD_SIZE={world}) under KERAS_BACKEND=jax: "
                "torchrun launches need KERAS_BACKEND=torch; start JAX processes with "
                "tfaploss train --coordinator HOST:PORT --num-processes N --process-id I "
                "(docs/scale_out.md).")
        _GROUP = _start_jax(timeout, coordinator, num_processes, process_id)
    elif torchrun or coordinator is not None:
        launched = f"WORLD_SIZE={world}" if torchrun else f"--coordinator {coordinator}"
        raise ConfigError(
            f"several processes ({launched}) under KERAS_BACKEND={backend}: tfaploss train "
            "runs across processes on torch (torchrun) and jax (--coordinator). "
            "TensorFlow's MultiWorkerMirroredStrategy stays library-level, since Keras's "
            "fit does not run under it (docs/scale_out.md).")
    else:
        _GROUP = ProcessGroup(timeout_s=timeout)
    if _GROUP.distributed:
        LOG.info("tfaploss train: %s", _GROUP.describe())
    return _GROUP


def _start_torch(timeout: int, torchrun: bool) -> ProcessGroup:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # the caller's own group
        return ProcessGroup("torch", dist.get_rank(), dist.get_world_size(),
                            _env_int("LOCAL_RANK") or 0, "user", timeout)
    if not torchrun:
        return ProcessGroup(timeout_s=timeout)
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local = _env_int("LOCAL_RANK") or 0
    missing = [n for n in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(n)]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch "
                          "the ranks with torchrun (python -m torch.distributed.run).")
    import torch

    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local)  # before Keras puts anything on "cuda"
        backend = "nccl"
    dist.init_process_group(backend, store=_torchrun_store(rank, world, timeout),
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    return ProcessGroup("torch", rank, world, local, "torchrun", timeout)


def _torchrun_store(rank: int, world: int, timeout: int):
    """torchrun's store, its keys under a prefix of the restart count: a restarted group
    would otherwise read the addresses its killed predecessor left there."""
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0, multi_tenant=True,
                          timeout=timedelta(seconds=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"tfaploss/attempt-{attempt}", store)


def _start_jax(timeout: int, coordinator, num_processes, process_id) -> ProcessGroup:
    import jax

    if jax.distributed.is_initialized():  # the caller's own
        return ProcessGroup("jax", jax.process_index(), jax.process_count(),
                            0, "user", timeout)
    if coordinator is None:
        if num_processes is not None or process_id is not None:
            raise ConfigError("--num-processes and --process-id go with --coordinator "
                              "HOST:PORT (rank 0's address), or --coordinator auto.")
        return ProcessGroup(timeout_s=timeout)
    kwargs = {"initialization_timeout": timeout, "shutdown_timeout_seconds": timeout,
              "heartbeat_timeout_seconds": min(timeout, _JAX_HEARTBEAT_S)}
    if coordinator == "auto":
        launcher = "cluster"
        if num_processes is not None:
            kwargs["num_processes"] = num_processes
        if process_id is not None:
            kwargs["process_id"] = process_id
    else:
        launcher = "coordinator"
        if num_processes is None or process_id is None:
            raise ConfigError(
                f"--coordinator {coordinator}: give --num-processes N and --process-id I "
                f"too (received {num_processes} and {process_id}), or --coordinator auto "
                "under a cluster launcher JAX knows (SLURM, Open MPI, Kubernetes).")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id must be in 0..{num_processes - 1} "
                              f"(--num-processes {num_processes}); received {process_id}")
        if num_processes == 1:
            return ProcessGroup(timeout_s=timeout)
        kwargs.update(coordinator_address=coordinator, num_processes=num_processes,
                      process_id=process_id)
    jax.distributed.initialize(**kwargs)
    return ProcessGroup("jax", jax.process_index(), jax.process_count(),
                        _env_int("LOCAL_RANK") or 0, launcher, timeout)


class GroupBackup(RunBackup):
    """The run's :class:`~tfaploss.durable.checkpoints.RunBackup`: rank 0 writes while
    the others wait, each record holding the world size and the global batch."""

    def __init__(self, directory, group: ProcessGroup, global_batch: int, log=None):
        super().__init__(directory, log)
        self.group = group
        self.global_batch = int(global_batch)

    def _extra(self, extra: dict | None) -> dict:
        return {**(extra or {}), "processes": self.group.world_size,
                "global_batch": self.global_batch}

    def save(self, model, epoch: int, extra: dict | None = None) -> Path:
        path = self.group.main_first(
            lambda: RunBackup.save(self, model, epoch, self._extra(extra)),
            f"writing the checkpoint of epoch {epoch}")
        return path or self.checkpoint_path(epoch)

    def save_step(self, model, epoch: int, step: int, extra: dict | None = None) -> Path:
        path = self.group.main_first(
            lambda: RunBackup.save_step(self, model, epoch, step, self._extra(extra)),
            f"writing the step checkpoint of epoch {epoch}, step {step}")
        return path or self.step_path(epoch, step)


def check_resume(backup: RunBackup, group: ProcessGroup, global_batch: int) -> None:
    """Refuse (:class:`~tfaploss.config.ConfigError`) to resume a checkpoint of another
    world size (none recorded: one) or global batch. Read only."""
    for index in (backup.index_path, backup.step_index_path):
        record = read_latest(index)  # a damaged index: the run directory's checks
        if record is None:
            continue
        processes, batch = record.get("processes", 1), record.get("global_batch")
        if type(processes) is not int or (batch is not None and type(batch) is not int):
            continue
        if processes == group.world_size and batch in (None, global_batch):
            continue
        was = f"a global batch of {batch}" if batch is not None else "its global batch"
        raise ConfigError(
            f"run_dir {str(backup.directory.parent)!r} holds a checkpoint "
            f"({index.parent.name}/{index.name}) of a run on {processes} process(es) with "
            f"{was}; this run has {group.world_size} process(es) with a global batch of "
            f"{global_batch}. A resumed run keeps both (each rank's share of the batch, "
            f"its multi-stage chunks and BatchNorm groups follow them): launch "
            f"{processes} process(es) with data.batch_size={batch or global_batch} again, "
            "use a new run_dir (--set run_dir=...), or start over here with --restart "
            "(the previous run's files are moved aside, not deleted).")


def check_shards(cfg, group: ProcessGroup) -> None:
    """Refuse (:class:`~tfaploss.config.ConfigError`) a global batch the ranks cannot
    share (``make_train_dataset``'s rule)."""
    if not group.distributed:
        return
    from tfaploss.run import build as B

    try:
        B.build_train_dataset(cfg, **group.shard())
    except ValueError as err:
        if not str(err).startswith("num_shards="):
            raise
        raise ConfigError(
            f"config keys 'data.batch_size' ({cfg.data.batch_size}) and 'data.m' "
            f"({cfg.data.m}) over {group.world_size} processes: {err}.") from None


class StopAgreement(keras.callbacks.Callback):
    """Make every rank stop after the same step: the flag that
    :class:`~tfaploss.training.preemption.PreemptionCheckpoint` reads under several
    processes (put it after every callback that may stop training, before that one).

    At each epoch's end and every :attr:`every`-th batch the ranks agree (one
    all-reduce) on the first signal of any rank's ``local`` flag (:attr:`signum`) and on
    any rank's ``stop_training``, held back until then. :attr:`every`: the fewest
    batches keeping the agreement under :data:`OVERHEAD` of the time, a signal waiting
    at most :data:`LATENCY_S` (docs/scale_out.md).
    """

    OVERHEAD = 0.01
    LATENCY_S = 2.0

    def __init__(self, local, group: ProcessGroup):
        super().__init__()
        self.local = local
        self.group = group
        self.signum: int | None = None
        self.every = 1
        self._since = 0            # batches since the last agreement
        self._held = False         # a stop of this rank's callbacks, not yet agreed on
        self._last = time.monotonic()
        self._cost_us = 0          # what the last agreement took here

    def seconds_since(self) -> float:
        return self.local.seconds_since()

    def _hold_stop(self) -> None:
        if getattr(self.model, "stop_training", False):
            self._held = True
            self.model.stop_training = False

    def _agree(self) -> None:
        start = time.monotonic()
        step_us = int(1e6 * (start - self._last) / self._since) if self._since else 0
        signum, stop, step_us, cost_us = self.group.any_rank(
            self.local.signum or 0, self._held, step_us, self._cost_us)
        end = time.monotonic()
        self._cost_us, self._last, self._since = int(1e6 * (end - start)), end, 0
        self._held = False
        if step_us:  # the slowest rank's steps and agreement: one interval for all
            wanted = -(-cost_us // max(1, int(self.OVERHEAD * step_us)))
            self.every = max(1, min(wanted, int(self.LATENCY_S * 1e6) // step_us))
        if signum and self.signum is None:
            self.signum = signum
            if self.local.signum is None:
                LOG.warning("rank %d: another rank received signal %d: stopping with it",
                            self.group.rank, signum)
        if stop:
            self.model.stop_training = True

    def on_train_begin(self, logs=None):
        self._since, self._last = 0, time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        self._hold_stop()
        self._since += 1
        if self._since >= self.every:
            self._agree()

    def on_epoch_end(self, epoch, logs=None):
        self._hold_stop()
        self._agree()


def agreed_stop(local) -> tuple[object, list]:
    """``(flag, callbacks)`` for a fit: ``(local, [])`` with one process, else a
    :class:`StopAgreement` as both."""
    group = current()
    if not group.distributed:
        return local, []
    agreement = StopAgreement(local, group)
    return agreement, [agreement]
