"""A data-parallel training step on the JAX backend, against the same step on one device.

``keras.distribution.DataParallel`` hands the train step the global batch, sharded
along the batch over the devices, and XLA inserts the communication, so a ranking loss
ranks the global batch (``tests/distribute/test_jax.py`` pins that it equals one
device). This measures what it costs: an ``APLoss`` step of ``small_cnn`` (widths 64,
128, 256; 32² images; 128-d) at ``--batch``, plain ``fit`` and ``MultiStageModel``
(``--chunk`` rows per device per chunk), each with and without the distribution, in
the same process. Prints the device count, the global and per-device batch, ms per
step, images/s, and the first step's loss of each distributed run beside the one-device
loss. The plain step's must agree. ``small_cnn``'s BatchNorm normalises on batch
statistics, so the multi-stage step's differs by design: each chunk of ``--chunk``
rows per device is normalised as one group of ``--chunk`` x D images
(``tests/distribute/test_jax.py`` pins that it equals one device with chunks of that
size holding the same rows).

    python benchmarks/data_parallel.py --device gpu                  # every GPU
    python benchmarks/data_parallel.py --device cpu --cpu-devices 4 --batch 256 --chunk 32
    python benchmarks/data_parallel.py --device cpu --quick          # B=128, 2 devices

Its figures are each distributed step's time beside the same step on one device (the
peer), written with the rows to ``benchmarks/results/data_parallel.json``.

CPU devices share the same cores, so a CPU run shows correctness and overhead, not
speed-up.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import harness


def build_model(seed):
    """The GPU batch sweep's wider small_cnn (``experiments/batch_sweep/batch_sweep.py
    --backend jax``): widths 64, 128, 256, 32² images, GeM, 128-d."""
    import keras

    from tfaploss.models.embedding import build_embedding_model

    keras.utils.set_random_seed(seed)
    return build_embedding_model(
        backbone="small_cnn", input_shape=(32, 32, 3), embedding_dim=128, pooling="gem",
        weights=None, backbone_kwargs={"widths": (64, 128, 256)})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--cpu-devices", type=int, default=4,
                   help="host devices for --device cpu (XLA_FLAGS)")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512, help="MultiStageModel rows per device")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up)")
    harness.add_arguments(p, harness.RESULTS_DIR / "data_parallel.json", out_aliases=("--json",),
                          quick_help="B=128, chunk 16, 3 timed steps (on CPU: 2 devices)",
                          tiny_help="B=16, chunk 4, 2 timed steps (on CPU: 2 devices)")
    args = p.parse_args(argv)
    if args.quick or args.tiny:
        args.batch, args.chunk, args.steps = (16, 4, 2) if args.tiny else (128, 16, 3)
        args.cpu_devices = min(args.cpu_devices, 2)
        args.quick = True
    return args


def _setup(args) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_PLATFORMS"] = "cuda" if args.device == "gpu" else "cpu"
    if args.device == "cpu":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.cpu_devices}")


def measure(args, distributed: bool, multistage: bool, x, y) -> dict:
    import jax
    import keras

    from tfaploss.losses import APLoss
    from tfaploss.training import MultiStageModel

    devices = jax.devices()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices) if distributed else None)
    try:
        model = build_model(0)   # the GPU sweep's wider small_cnn
        if multistage:
            model = MultiStageModel(model, chunk_size=args.chunk)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=APLoss())
        losses = []

        def step():
            logs = model.train_on_batch(x, y, return_dict=True)
            losses.append(float(logs["loss"]))  # a host copy: the step has finished

        timing = harness.time_calls(step, args.steps, warmup=2)
    finally:
        keras.distribution.set_distribution(None)
    shards = len(devices) if distributed else 1
    step_s = sorted(timing.times)[len(timing.times) // 2]
    return {"step": "MultiStageModel" if multistage else "plain fit",
            "distribution": f"DataParallel({len(devices)})" if distributed else "none",
            "devices": shards, "global_batch": args.batch,
            "per_device_batch": args.batch // shards,
            "chunk_per_device": args.chunk if multistage else None,
            "ms_per_step": 1000 * step_s, "images_per_s": args.batch / step_s,
            "first_loss": losses[0], "device": str(devices[0].device_kind)}


def main(argv=None) -> None:
    args = parse_args(argv)
    _setup(args)
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, size=(args.batch, 32, 32, 3)).astype("float32")
    y = np.repeat(np.arange(args.batch // 4), 4).astype("int32")
    print(f"{len(jax.devices())} {jax.devices()[0].platform} device(s): "
          f"{jax.devices()[0].device_kind}; global batch {args.batch}, per device "
          f"{args.batch // len(jax.devices())}", flush=True)
    rows = []
    for multistage in (False, True):
        base = measure(args, False, multistage, x, y)
        dist = measure(args, True, multistage, x, y)
        dist["vs_one_device"] = base["ms_per_step"] / dist["ms_per_step"]
        dist["loss_gap"] = abs(dist["first_loss"] - base["first_loss"])
        rows += [base, dist]
    print(f"{'step':>16s} {'distribution':>16s} {'global B':>9s} {'per device':>10s} "
          f"{'ms/step':>9s} {'images/s':>10s} {'first loss':>11s}  vs one device")
    for r in rows:
        extra = (f"{r['vs_one_device']:.2f}x speed, loss gap {r['loss_gap']:.1e}"
                 if "vs_one_device" in r else "(the peer)")
        print(f"{r['step']:>16s} {r['distribution']:>16s} {r['global_batch']:>9d} "
              f"{r['per_device_batch']:>10d} {r['ms_per_step']:>9.1f} "
              f"{r['images_per_s']:>10.0f} {r['first_loss']:>11.6f}  {extra}", flush=True)
    figures = [harness.figure(
        "data_parallel", f"{r['step']}, {r['distribution']}, global B={r['global_batch']}",
        r["ms_per_step"] / 1000, "s", floor=base["ms_per_step"] / 1000, peer=True,
        floor_name="the same step on one device",
        note=f"first-loss gap {r['loss_gap']:.1e}")
        for base, r in zip(rows[::2], rows[1::2])]
    harness.write_results(args.out, "data_parallel", args, figures, rows=rows)


if __name__ == "__main__":
    main()
