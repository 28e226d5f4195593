"""Which devices a ``tfaploss train`` run uses (``training.distribute``): data
parallelism, the losses gathering every device's rows. :func:`plan_devices` must run
before TensorFlow initialises its devices (several CPU devices are set up before)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import keras

from tfaploss.config.schema import Config
from tfaploss.run import processes

LOG = logging.getLogger(__name__)


@dataclass
class DevicePlan:
    """The devices of a run and how the batch splits over them."""

    strategy: str                          # "none" or "data_parallel"
    devices: list[str] = field(default_factory=list)
    global_batch: int = 0
    backend: str = "tensorflow"
    processes: int = 1                     # JAX processes whose devices these are

    @property
    def per_device_batch(self) -> int:
        return self.global_batch // max(1, len(self.devices))

    def describe(self) -> str:
        names = ", ".join(self.devices)
        if self.strategy == "none":
            return f"one device ({names}), batch {self.global_batch}"
        how = "MirroredStrategy" if self.backend == "tensorflow" else "DataParallel"
        of = f" of {self.processes} processes" if self.processes > 1 else ""
        return (f"data_parallel ({how}) on {len(self.devices)} devices{of} ({names}): global "
                f"batch {self.global_batch}, {self.per_device_batch} per device")

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "devices": len(self.devices),
                "device_names": list(self.devices), "global_batch": self.global_batch,
                "per_device_batch": self.per_device_batch, "processes": self.processes}

    @contextlib.contextmanager
    def scope(self):
        """Build, compile and fit inside this block."""
        if self.strategy == "none":
            yield
            return
        if self.backend == "tensorflow":
            with mirrored_strategy(self.devices).scope():
                yield
            return
        import jax

        by_name = {str(d): d for d in jax.devices()}
        distribution = keras.distribution.DataParallel(
            devices=[by_name[n] for n in self.devices])
        if self.processes > 1:
            # Each process already reads its own rows (make_train_dataset's shards).
            distribution.auto_shard_dataset = False
        keras.distribution.set_distribution(distribution)
        try:
            yield
        finally:
            keras.distribution.set_distribution(None)


def mirrored_strategy(devices):
    """The ``tf.distribute.MirroredStrategy`` of a data-parallel run."""
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(devices)


def _available(backend: str, wanted: int | None) -> tuple[list[str], str]:
    """The devices a data-parallel run can use, and their kind ("GPU" or "CPU")."""
    if backend == "jax":
        import jax

        devices = jax.devices()
        return [str(d) for d in devices], "GPU" if devices[0].platform == "gpu" else "CPU"
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return [d.name for d in tf.config.list_logical_devices("GPU")], "GPU"
    if wanted and wanted > 1:
        # Several CPU devices share the same cores: for testing the distributed path
        # on a machine without GPUs, not for speed.
        with contextlib.suppress(RuntimeError):  # initialised: the caller checks the count
            tf.config.set_logical_device_configuration(
                tf.config.list_physical_devices("CPU")[0],
                [tf.config.LogicalDeviceConfiguration()] * wanted)
    return [d.name for d in tf.config.list_logical_devices("CPU")], "CPU"


def plan_devices(cfg: Config) -> DevicePlan:
    """The :class:`DevicePlan` of ``cfg.training.distribute`` here (under several JAX
    processes, over all their devices); a ``ValueError`` naming the key when it cannot."""
    dist = cfg.training.distribute
    backend = keras.backend.backend()
    batch = cfg.data.batch_size
    group = processes.current()
    if backend == "jax" and group.distributed:
        if dist.strategy == "none":
            raise ValueError(
                f"config key 'training.distribute.strategy': none, but {group.world_size} "
                "processes were launched; use auto or data_parallel (every process's "
                "devices), or launch one process.")
        if not cfg.training.jit_compile:
            raise ValueError(
                f"config key 'training.jit_compile': false, and {group.world_size} JAX "
                "processes were launched: an uncompiled step runs each of its operations "
                "as a program of every process, and a loss that reads values on the host "
                "(SmoothAPLoss's blocks of pairs) fails there; set it to true "
                "(--set training.jit_compile=true).")
        devices = _available(backend, None)[0]
        if dist.devices not in (None, len(devices)):
            raise ValueError(
                f"config key 'training.distribute.devices': {dist.devices} devices asked "
                f"for; {group.world_size} processes hold {len(devices)} devices, and a run "
                "across processes uses them all (null).")
        _check_split(batch, devices, dist)
        return DevicePlan("data_parallel", devices, batch, backend, group.world_size)
    if backend not in ("tensorflow", "jax"):
        if dist.strategy == "data_parallel":
            raise ValueError(
                f"config key 'training.distribute.strategy': data_parallel runs on the "
                f"tensorflow and jax backends; received KERAS_BACKEND={backend}. On "
                "PyTorch, train with torch.distributed (README, scale-out).")
        return DevicePlan("none", ["default"], batch, backend)
    if dist.strategy == "none":
        return DevicePlan("none", _available(backend, None)[0][:1], batch, backend)
    devices, kind = _available(backend, dist.devices)
    if dist.strategy == "auto" and (kind != "GPU" or len(devices) < 2):
        return DevicePlan("none", devices[:1], batch, backend)
    wanted = dist.devices or len(devices)
    if wanted > len(devices):
        raise ValueError(
            f"config key 'training.distribute.devices': {wanted} devices asked for, this "
            f"machine has {len(devices)} {kind} device(s) ({', '.join(devices)}).")
    chosen = devices[:wanted]
    _check_split(batch, chosen, dist)
    return DevicePlan("none" if len(chosen) == 1 else "data_parallel", chosen, batch, backend)


def _check_split(batch: int, devices: list[str], dist) -> None:
    if batch % len(devices):
        raise ValueError(
            f"config key 'data.batch_size': the global batch of {batch} does not split "
            f"evenly over {len(devices)} devices; use a multiple of {len(devices)} (received "
            f"training.distribute.devices={dist.devices}).")

