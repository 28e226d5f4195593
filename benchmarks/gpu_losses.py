"""Losses and a multi-stage ResNet-50 step on the JAX backend, for GPUs (and CPUs).

Needs no TensorFlow: it runs Keras on JAX (``KERAS_BACKEND=jax`` is set here), as on
the GPU machines that carry JAX and PyTorch only.

Losses (default): every loss of ``tfaploss.losses`` under ``jax.jit``, float32, value
and gradient with respect to the embeddings, D=512, labels in classes of 4, for B in
``--sizes`` (default 4096, 16384, 65536). Each cell runs in a fresh process (so that
its peak device memory is its own, and an out-of-memory cell does not end the run);
the floor, the product X·Xᵀ alone, is measured the same way in the same run and
printed beside each figure, with the ratio. A reference row, a plain gathered
(B x m x B) Smooth-AP written with keras.ops, is the bar the losses must clear.

    python benchmarks/gpu_losses.py --device gpu                    # the GPU table
    python benchmarks/gpu_losses.py --device cpu --sizes 256,1024   # a quick CPU check

``--step``: one multi-stage ResNet-50 step (``MultiStageModel``, 224², mixed_bfloat16,
frozen BatchNorm, GeM, 512-d head) on a batch of ``--step-batch`` images in chunks of
``--chunk``, against its floor measured in the same run: a multi-stage step is one
forward plus one training step per image, so the floor is
``1 / (1 / forward images/s + 1 / plain-step images/s)`` with both measured at batch
``--chunk`` on the same model. Prints images/s, the floor, the ratio, peak device
memory and the chunk size.

    python benchmarks/gpu_losses.py --device gpu --step --step-batch 4096 --chunk 256
    python benchmarks/gpu_losses.py --device cpu --step --step-batch 8 --chunk 4 \\
        --image-size 64                                              # a CPU smoke run

Peak memory is the device's ``peak_bytes_in_use`` where JAX reports it (GPU), else the
process's peak RSS (CPU). Prints tables and writes JSON to ``benchmarks/results/``; its
figures are each loss's time beside the floor's at the same B, and the step's images/s
beside its floor. ``--quick``: B=4096 and five losses (with ``--step``: a batch of 1,024).

``make bench`` runs it only where ``nvidia-smi`` lists a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import harness

REPO_ROOT = Path(__file__).resolve().parents[1]
FLOOR = "X·Xᵀ (floor)"
REFERENCE = "reference: gathered Smooth-AP B×m×B"
CLASS_SIZE = 4
QUICK_LOSSES = "APLoss,FastAPLoss,SmoothAPLoss,ROADMAPLoss,TripletLoss"


def _setup_backend(device: str) -> None:
    """Select Keras-on-JAX and the JAX platform before anything imports them."""
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_PLATFORMS"] = "cuda" if device == "gpu" else "cpu"
    # Measure the real peak, not a preallocated pool.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def _peak_memory_gb() -> tuple[float, str]:
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**30, "device"
    return harness.peak_rss_gb(), "RSS"


def _time(fn, *args, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` (results waited for), after one warm-up call."""
    import jax

    return harness.time_calls(lambda: jax.block_until_ready(fn(*args)), repeats).median


def _labels(batch: int):
    import numpy as np

    return (np.arange(batch) // CLASS_SIZE).astype("int32")


def reference_smooth_ap():
    """The bar: Smooth-AP gathered over the positives, B x m x B, keras.ops.

    For query i with positives P(i) (the other m = CLASS_SIZE - 1 items of its class,
    which are contiguous here), ``rank(p) = 1 + sum_{j != i} sigmoid((s_ij - s_ip)/t)``
    over all items and over positives; ``AP_i = mean_p rank_pos(p) / rank(p)``.
    """
    import keras
    from keras import ops

    class GatheredSmoothAP(keras.losses.Loss):
        def __init__(self, temperature=0.01):
            super().__init__(name="gathered_smooth_ap")
            self.temperature = temperature

        def call(self, y_true, y_pred):
            batch = ops.shape(y_pred)[0]
            scores = ops.matmul(y_pred, ops.transpose(y_pred))
            rows = ops.arange(batch)
            base = (rows // CLASS_SIZE) * CLASS_SIZE
            offsets = ops.arange(1, CLASS_SIZE)
            positives = base[:, None] + (rows[:, None] - base[:, None] + offsets) % CLASS_SIZE
            pos_scores = ops.take_along_axis(scores, positives, axis=1)  # (B, m)
            diff = (scores[:, None, :] - pos_scores[:, :, None]) / self.temperature
            sig = ops.sigmoid(diff)  # (B, m, B)
            not_self = ops.cast(rows[None, None, :] != rows[:, None, None], sig.dtype)
            same = ops.cast(base[None, None, :] == base[:, None, None], sig.dtype)
            rank_all = 1.0 + ops.sum(sig * not_self, axis=-1) - 0.5  # minus sig(0) of p
            rank_pos = 1.0 + ops.sum(sig * not_self * same, axis=-1) - 0.5
            ap = ops.mean(rank_pos / rank_all, axis=-1)
            return 1.0 - ap

    return GatheredSmoothAP()


def loss_names() -> list[str]:
    from tfaploss import losses
    from tfaploss.losses.base import RetrievalLoss

    return [n for n in losses.__all__
            if isinstance(getattr(losses, n), type) and issubclass(getattr(losses, n),
                                                                   RetrievalLoss)
            and getattr(losses, n) is not RetrievalLoss]


# -- one loss cell, in its own process -----------------------------------------------------


def run_cell(args) -> dict:
    _setup_backend(args.device)
    import jax
    import jax.numpy as jnp
    import numpy as np

    batch, dim = args.size, args.dim
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, dim)).astype("float32")
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    x, y = jnp.asarray(x), jnp.asarray(_labels(batch))
    result = {"loss": args.cell, "batch": batch, "device": str(jax.devices()[0])}
    if args.cell == FLOOR:
        fn = jax.jit(lambda e: e @ e.T)
        seconds = _time(fn, x, repeats=args.repeats)
    else:
        if args.cell == REFERENCE:
            loss = reference_smooth_ap()
        else:
            from tfaploss import losses

            loss = getattr(losses, args.cell)()
        fn = jax.jit(jax.value_and_grad(lambda e: loss(y, e)))
        start = time.perf_counter()
        value, grad = jax.block_until_ready(fn(x))
        result["compile_s"] = time.perf_counter() - start
        if not (np.isfinite(float(value)) and bool(jnp.all(jnp.isfinite(grad)))):
            raise FloatingPointError(f"{args.cell}: non-finite value or gradient")
        seconds = _time(fn, x, repeats=args.repeats)
    peak, kind = _peak_memory_gb()
    result.update(status="ok", seconds=seconds, peak_gb=peak, memory=kind)
    return result


def run_child(args, cell: str, size: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--cell", cell,
               "--size", str(size), "--dim", str(args.dim), "--repeats", str(args.repeats)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                              check=False, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {"loss": cell, "batch": size, "status": f"timeout ({args.timeout:g} s)"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    err = done.stderr.strip().splitlines()
    oom = any(s in done.stderr for s in ("RESOURCE_EXHAUSTED", "Out of memory", "MemoryError"))
    last = next((line for line in reversed(err) if re.match(r"^[\w.]+(Error|Exception)\b", line)),
                err[-1] if err else "")
    return {"loss": cell, "batch": size,
            "status": "out of memory" if oom or done.returncode in (-9, 137)
            else f"error: {last[:160]}"}


def _cell_text(r: dict, floor: dict | None) -> str:
    if r.get("status") != "ok":
        return r.get("status", "not run")[:40]
    text = f"{r['seconds'] * 1e3:9.2f} ms {r['peak_gb']:6.2f} GB"
    if floor and floor.get("status") == "ok" and r["loss"] != FLOOR:
        text += f" ({r['seconds'] / floor['seconds']:6.1f}x floor)"
    return text


def run_losses(args) -> dict:
    sizes = [int(s) for s in args.sizes.split(",")]
    names = args.losses.split(",") if args.losses else [REFERENCE] + loss_names()
    names = [n for n in names if n != FLOOR]
    rows = [FLOOR] + names
    results = {}
    for name in rows:
        for size in sizes:
            print(f"[gpu_losses] {name} B={size} ...", flush=True)
            results[(name, size)] = run_child(args, name, size)
            print(f"    {json.dumps(results[(name, size)])}", flush=True)
    width = max(len(n) for n in rows)
    memory = next((r.get("memory") for r in results.values() if r.get("memory")), "?")
    print(f"\nJAX {args.device}, jit, float32, value+grad w.r.t. embeddings, D={args.dim}, "
          f"classes of {CLASS_SIZE}; median of {args.repeats}; peak memory = {memory}")
    print(f"{'loss':{width}s} | " + " | ".join(f"B={s:<36d}" for s in sizes))
    print("-" * (width + 41 * len(sizes)))
    for name in rows:
        cells = [_cell_text(results[(name, s)], results[(FLOOR, s)]) for s in sizes]
        print(f"{name:{width}s} | " + " | ".join(f"{c:38s}" for c in cells))
    figures = []
    for name in names:
        for size in sizes:
            cell, floor = results[(name, size)], results[(FLOOR, size)]
            ok, floor_ok = cell.get("status") == "ok", floor.get("status") == "ok"
            figures.append(harness.figure(
                "gpu_losses", f"{name} B={size} ({args.device})",
                cell["seconds"] if ok else None, "s",
                floor=floor["seconds"] if floor_ok else None, floor_name=FLOOR,
                note="" if ok else cell.get("status", "not run")))
    return {"losses": [results[(n, s)] for n in rows for s in sizes], "figures": figures}


# -- the multi-stage ResNet-50 step --------------------------------------------------------


def run_step(args) -> dict:
    _setup_backend(args.device)
    import jax
    import keras
    import numpy as np

    from tfaploss import models
    from tfaploss.training import MultiStageModel

    keras.config.set_dtype_policy(args.policy)
    shape = (args.image_size, args.image_size, 3)

    def build():
        keras.utils.set_random_seed(0)
        return models.build_embedding_model(args.backbone, pooling="gem", embedding_dim=512,
                                            weights=None, input_shape=shape, freeze_bn=True)

    loss = _step_loss(args.step_loss)
    rng = np.random.default_rng(0)

    def batch_of(n):
        x = jax.device_put(rng.uniform(0, 255, (n,) + shape).astype("float32"))
        return x, jax.device_put(_labels(n))

    def compiled_step(model, batch):
        """``model.train_step`` jitted on device-resident state, as ``fit`` runs it."""
        model.compile(optimizer=keras.optimizers.SGD(1e-4), loss=loss)
        model.optimizer.build(model.trainable_variables)
        state = [[v.value for v in vs] for vs in (model.trainable_variables,
                                                   model.non_trainable_variables,
                                                   model.optimizer.variables,
                                                   model.metrics_variables)]
        step = jax.jit(model.train_step, donate_argnums=0)
        holder = {"state": tuple(state)}

        def run(data):
            logs, holder["state"] = step(holder["state"], data)
            return logs

        return run

    # Multi-stage first, so that the peak memory read after it is its own.
    x, y = batch_of(args.step_batch)
    multi = MultiStageModel(build(), chunk_size=args.chunk)
    step = compiled_step(multi, args.step_batch)
    start = time.perf_counter()
    jax.block_until_ready(step((x, y)))
    compile_s = time.perf_counter() - start
    multi_s = _time(step, (x, y), repeats=args.repeats)
    peak, kind = _peak_memory_gb()
    del x, y, step, multi

    # The floor, at batch = chunk on the same model: a forward and a plain step.
    model = build()
    xc, yc = batch_of(args.chunk)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    forward = jax.jit(lambda t, n, x: model.stateless_call(t, n, x, training=True)[0])
    forward_s = _time(forward, trainable, non_trainable, xc, repeats=args.repeats)
    plain_s = _time(compiled_step(model, args.chunk), (xc, yc), repeats=args.repeats)

    forward_rate, plain_rate = args.chunk / forward_s, args.chunk / plain_s
    floor_rate = 1.0 / (1.0 / forward_rate + 1.0 / plain_rate)
    rate = args.step_batch / multi_s
    result = {
        "backbone": args.backbone, "image_size": args.image_size, "policy": args.policy,
        "batch": args.step_batch, "chunk": args.chunk, "loss": type(loss).__name__,
        "device": str(jax.devices()[0]), "compile_s": compile_s, "step_s": multi_s,
        "images_per_s": rate, "forward_images_per_s": forward_rate,
        "plain_step_images_per_s": plain_rate, "floor_images_per_s": floor_rate,
        "ratio_to_floor": rate / floor_rate, "peak_gb": peak, "memory": kind,
    }
    print(f"\nMulti-stage {args.backbone} {args.image_size}², {args.policy}, JAX "
          f"{args.device} ({result['device']}), loss {result['loss']}")
    print(f"  step: B={args.step_batch} in chunks of {args.chunk}: {multi_s:.3f} s = "
          f"{rate:,.0f} images/s (compile {compile_s:.0f} s), peak memory {peak:.2f} GB "
          f"({kind})")
    print(f"  floor, same run, batch {args.chunk}: forward {forward_rate:,.0f} images/s, "
          f"plain step {plain_rate:,.0f} images/s -> 1 fwd + 1 step per image: "
          f"{floor_rate:,.0f} images/s")
    print(f"  ratio to the floor: {rate / floor_rate:.2f}")
    figures = [harness.figure(
        "gpu_losses", f"multi-stage {args.backbone} step B={args.step_batch} chunk "
        f"{args.chunk} ({args.device})", rate, "images/s", floor=floor_rate,
        floor_name="1 forward + 1 plain step per image", higher_is_better=True)]
    return {"step": result, "figures": figures}


def _step_loss(name: str):
    """The step's loss: a tfaploss loss by name, or the keras.ops reference Smooth-AP."""
    if name == "reference":
        return reference_smooth_ap()
    from tfaploss import losses

    return getattr(losses, name)()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="gpu")
    parser.add_argument("--sizes", default="4096,16384,65536")
    parser.add_argument("--losses", default="",
                        help="comma-separated loss names (default: all, with the reference)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
    parser.add_argument("--step", action="store_true",
                        help="time a multi-stage ResNet-50 step instead of the losses")
    parser.add_argument("--step-batch", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--backbone", default="resnet50")
    parser.add_argument("--policy", default="mixed_bfloat16")
    parser.add_argument("--step-loss", default="SmoothAPLoss",
                        help="a tfaploss.losses name, or 'reference' (keras.ops Smooth-AP)")
    harness.add_arguments(parser, "", out_aliases=("--output",),
                          quick_help=f"B=4096, {QUICK_LOSSES} (--step: batch 1024)",
                          tiny_help="B=256, FastAPLoss (--step: small_cnn at 32², batch 8, "
                                    "chunk 4)")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny and not args.cell:
        args.quick = True
        args.sizes, args.losses = "256", args.losses or "FastAPLoss"
        args.step_batch, args.chunk, args.image_size = 8, 4, 32
        args.backbone = "small_cnn"
    elif args.quick and not args.cell:
        args.sizes, args.losses = "4096", args.losses or QUICK_LOSSES
        args.step_batch = min(args.step_batch, 1024)

    if args.cell:
        print(json.dumps(run_cell(args)), flush=True)
        return
    if args.step:
        _setup_backend(args.device)
        result = run_step(args)
    else:
        result = run_losses(args)
    kind = "step" if args.step else "losses"
    out = args.out or harness.RESULTS_DIR / f"gpu_{kind}_{args.device}.json"
    harness.write_results(out, "gpu_losses", args, result.pop("figures"), **result)


if __name__ == "__main__":
    main()
