"""Peak memory and time per step: plain backprop vs. multi-staged backpropagation.

For a ResNet-50 embedding model (random weights, frozen BatchNorm, GeM, linear head,
L2) trained with ``APLoss`` at 224x224, each batch size B is run twice, each time in a
fresh process: a plain ``keras.Model`` step on the whole batch, and a
``tfaploss.training.MultiStageModel`` step with ``--chunk`` images per chunk. Each
process traces ``train_step`` once for a dynamic batch size, warms up on one chunk,
runs ``--steps`` timed full-batch steps and reports its peak RSS. Expected shape: plain memory grows linearly in B, multi-stage memory stays
nearly flat, multi-stage time ~ (2 fwd + 1 bwd) / (1 fwd + 1 bwd) ~ 4/3 of plain.

The parent watches each child's RSS and stops it above ``--max-rss-gb`` (reported as
OOM), so that a plain step that would not fit does not take a shared machine down.

    python benchmarks/multistage.py                       # the issue's grid, CPU
    python benchmarks/multistage.py --batch-sizes 8,16 --chunk 8 --image-size 64 \
        --backbone small_cnn                              # a quick smoke run

Prints a table and writes JSON to ``benchmarks/results/multistage.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"


def _rss_gb(pid: int) -> float:
    """Resident set size of a process, GiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# -- one cell, in its own process ---------------------------------------------------


def _build_model(backbone: str, image_size: int, embedding_dim: int):
    import keras

    from tfaploss.training import freeze_batch_norm

    shape = (image_size, image_size, 3)
    try:
        from models import build_embedding_model
    except ImportError:  # models package unavailable: the same architecture by hand
        build_embedding_model = None
    if build_embedding_model is not None:
        model = build_embedding_model(backbone=backbone, pooling="gem",
                                      embedding_dim=embedding_dim, weights=None,
                                      input_shape=shape)
    else:
        from models.gem import GeM

        inputs = keras.Input(shape)
        features = keras.applications.ResNet50(weights=None, include_top=False)(inputs)
        x = keras.layers.Dense(embedding_dim)(GeM()(features))
        model = keras.Model(inputs, keras.layers.UnitNormalization()(x))
    return freeze_batch_norm(model)


def run_cell(args) -> None:
    """Trace once for any batch size, warm up on a few images, then time full steps.

    The step is ``model.train_step`` (what ``fit`` runs) in a ``tf.function`` traced
    for a dynamic batch size, so the warm-up needs no full-size step. Prints one JSON
    line after the warm-up and one after the timed steps.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    from tfaploss.losses import APLoss
    from tfaploss.training import MultiStageModel

    keras.utils.set_random_seed(0)
    model = _build_model(args.backbone, args.image_size, args.embedding_dim)
    rng = np.random.default_rng(0)
    size = args.image_size
    images = tf.constant(rng.uniform(0, 255, size=(args.batch, size, size, 3)).astype("float32"))
    labels = tf.constant((np.arange(args.batch) // 4).astype("int32"))  # 4 images per class
    if args.mode == "multistage":
        model = MultiStageModel(model, chunk_size=args.chunk)
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=APLoss())
    model.optimizer.build(model.trainable_variables)
    step = tf.function(lambda x, y: model.train_step((x, y)), jit_compile=args.jit_compile)
    result = {
        "mode": args.mode, "batch": args.batch, "chunk": args.chunk, "image_size": size,
        "backbone": args.backbone, "jit_compile": args.jit_compile,
        "baseline_rss_gb": _peak_rss_gb(),
    }
    start = time.perf_counter()
    if args.jit_compile:  # XLA compiles per shape: warm up at full size
        function = step
        warm_x, warm_y = images, labels
    else:
        function = step.get_concrete_function(
            tf.TensorSpec((None, size, size, 3), "float32"), tf.TensorSpec((None,), "int32"))
        # One chunk's worth: runs every op of the step once at the timed shapes.
        warm = min(args.batch, args.chunk)
        warm_x, warm_y = images[:warm], labels[:warm]
    result["trace_s"] = time.perf_counter() - start
    start = time.perf_counter()
    float(function(warm_x, warm_y)["loss"])
    result.update(warmup_s=time.perf_counter() - start, status="warm-up only",
                  peak_rss_gb=_peak_rss_gb())
    print(json.dumps(result), flush=True)

    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = float(function(images, labels)["loss"])
        times.append(time.perf_counter() - start)
    result.update(status="ok", step_s=float(np.median(times)), peak_rss_gb=_peak_rss_gb(),
                  loss=loss)
    print(json.dumps(result), flush=True)


# -- the grid, one child process per cell ----------------------------------------------


def run_child(args, mode: str, batch: int) -> dict:
    command = [sys.executable, __file__, "--cell", "--mode", mode, "--batch", str(batch),
               "--chunk", str(args.chunk), "--image-size", str(args.image_size),
               "--steps", str(args.steps), "--backbone", args.backbone,
               "--embedding-dim", str(args.embedding_dim)]
    if args.jit_compile:
        command.append("--jit-compile")
    env = dict(os.environ, PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    base = {"mode": mode, "batch": batch, "chunk": args.chunk}
    start = time.monotonic()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=REPO_ROOT)
    watched_peak, status = 0.0, None
    while child.poll() is None:
        watched_peak = max(watched_peak, _rss_gb(child.pid))
        if watched_peak > args.max_rss_gb:
            status = f"OOM (RSS > {args.max_rss_gb:g} GiB cap)"
        elif time.monotonic() - start > args.timeout:
            status = f"timeout ({args.timeout:g} s)"
        if status:
            child.kill()
            break
        time.sleep(0.2)
    stdout, stderr = child.communicate()
    reports = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if status:  # keep what the cell measured before it was stopped (e.g. its warm-up)
        partial = reports[-1] if reports else base
        return {**partial, "status": status,
                "peak_rss_gb": max(watched_peak, partial.get("peak_rss_gb", 0.0))}
    if reports and reports[-1]["status"] == "ok":
        return reports[-1]
    memory_error = any(s in stderr for s in ("ResourceExhausted", "MemoryError", "OOM"))
    if child.returncode in (-9, 137) or memory_error:
        return {**base, "status": "OOM", "peak_rss_gb": watched_peak}
    tail = stderr.strip().splitlines()[-1:] or [f"exit code {child.returncode}"]
    return {**base, "status": f"error: {tail[0][:200]}", "peak_rss_gb": watched_peak}


def _format(results: list[dict], batch_sizes: list[int]) -> str:
    by = {(r["mode"], r["batch"]): r for r in results}
    header = (f"{'B':>5} | {'plain s/step':>12} {'plain RSS GiB':>13} | "
              f"{'multi s/step':>12} {'multi RSS GiB':>13} | {'time ratio':>10} {'RSS ratio':>9}")
    lines = [header, "-" * len(header)]
    for b in batch_sizes:
        p, m = by.get(("plain", b), {}), by.get(("multistage", b), {})

        def cells(r):
            if r.get("status") != "ok":
                return f"{r.get('status', 'not run')[:26]:>26}"
            return f"{r['step_s']:12.2f} {r['peak_rss_gb']:13.2f}"

        ratio = ""
        if p.get("status") == "ok" and m.get("status") == "ok":
            ratio = f"{m['step_s'] / p['step_s']:10.2f} {m['peak_rss_gb'] / p['peak_rss_gb']:9.2f}"
        lines.append(f"{b:>5} | {cells(p)} | {cells(m)} | {ratio}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="32,64,128,256")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--backbone", default="resnet50")
    parser.add_argument("--embedding-dim", type=int, default=512)
    parser.add_argument("--steps", type=int, default=1, help="timed steps after the warm-up")
    parser.add_argument("--modes", default="plain,multistage")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    parser.add_argument("--max-rss-gb", type=float, default=15.0,
                        help="stop a cell above this RSS and report it as OOM")
    parser.add_argument("--jit-compile", action="store_true")
    parser.add_argument("--output", default=str(RESULTS / "multistage.json"))
    # Internal: run one cell in this process and print its JSON.
    parser.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["plain", "multistage"], help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.cell:
        run_cell(args)
        return

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.modes.split(",")
    results = []
    for batch in batch_sizes:
        for mode in modes:
            print(f"[multistage benchmark] {mode} B={batch} ...", flush=True)
            result = run_child(args, mode, batch)
            print(f"    {json.dumps(result)}", flush=True)
            results.append(result)
    table = _format(results, batch_sizes)
    print(table)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "config": {k: v for k, v in vars(args).items() if k not in ("cell", "mode", "batch")},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "results": results, "table": table,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
