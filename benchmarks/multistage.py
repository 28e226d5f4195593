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

    python benchmarks/multistage.py                       # the full grid, CPU
    python benchmarks/multistage.py --batch-sizes 8,16 --chunk 8 --image-size 64 \
        --backbone small_cnn                              # a smoke run
    python benchmarks/multistage.py --quick               # small_cnn, 32², B=128

Prints a table and writes JSON to ``benchmarks/results/multistage.json``; its figures
are the multi-stage step's time and peak RSS beside the plain step's (the peer).

``--stages`` instead times, in ONE process and interleaved (so that a shared machine
disturbs them alike), what a multi-stage step is made of, beside the plain step:

    python benchmarks/multistage.py --stages --batch 32 --chunk 16      # ResNet-50 224²
    python benchmarks/multistage.py --stages --backbone small_cnn --image-size 32 \
        --batch 256 --chunk 64

It prints the forward of the whole batch, the plain step, stage 1 (embed in chunks),
stage 2 (loss and G), stage 3 (re-embed and backprop each chunk) and the whole
multi-stage step, each as a multiple of the plain step, and the floor a multi-stage
step cannot beat: one forward more than the plain step (forward + plain step).
``--dynamic-batch`` traces the steps for any batch size (what the grid above does);
``--unroll-chunks 0`` forces the ``tf.while_loop`` path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import harness

REPO_ROOT = Path(__file__).resolve().parents[1]
# --quick: the grid's shape on a model small enough for a few seconds per cell
QUICK = {"batch_sizes": "128", "chunk": 32, "image_size": 32, "backbone": "small_cnn"}
# --tiny: the same on a toy batch (the cells' time is then mostly their imports)
TINY = {"batch_sizes": "16", "chunk": 8, "image_size": 16, "backbone": "small_cnn",
        "embedding_dim": 32}

# -- one cell, in its own process ---------------------------------------------------


def _build_model(backbone: str, image_size: int, embedding_dim: int):
    import keras

    from tfaploss.training import freeze_batch_norm

    shape = (image_size, image_size, 3)
    try:
        from tfaploss.models import build_embedding_model
    except ImportError:  # models package unavailable: the same architecture by hand
        build_embedding_model = None
    if build_embedding_model is not None:
        model = build_embedding_model(backbone=backbone, pooling="gem",
                                      embedding_dim=embedding_dim, weights=None,
                                      input_shape=shape)
    else:
        from tfaploss.models.gem import GeM

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
        "baseline_rss_gb": harness.peak_rss_gb(),
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
                  peak_rss_gb=harness.peak_rss_gb())
    print(json.dumps(result), flush=True)

    last = {}
    timing = harness.time_calls(
        lambda: last.update(loss=float(function(images, labels)["loss"])), args.steps,
        warmup=0)  # warmed up above, on one chunk
    result.update(status="ok", step_s=timing.median, peak_rss_gb=harness.peak_rss_gb(),
                  loss=last["loss"])
    print(json.dumps(result), flush=True)


# -- per-stage timing, one process --------------------------------------------------------


def run_stages(args) -> dict:
    """Time the stages of a multi-stage step beside the plain step (see module doc)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    from tfaploss.losses import APLoss
    from tfaploss.training import MultiStageModel, multistage_tf

    if args.unroll_chunks is not None:
        multistage_tf.UNROLL_CHUNKS = args.unroll_chunks
    size, batch, chunk = args.image_size, args.batch, args.chunk
    keras.utils.set_random_seed(0)
    plain = _build_model(args.backbone, size, args.embedding_dim)
    keras.utils.set_random_seed(0)
    multi = MultiStageModel(_build_model(args.backbone, size, args.embedding_dim),
                            chunk_size=chunk)
    for model in (plain, multi):
        model.compile(optimizer=keras.optimizers.SGD(1e-6), loss=APLoss())
        model.optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    images = tf.constant(rng.uniform(0, 255, (batch, size, size, 3)).astype("float32"))
    labels = tf.constant((np.arange(batch) // 4).astype("int32"))
    variables = multi.trainable_variables
    rows = None if args.dynamic_batch else batch
    x_spec = tf.TensorSpec((rows, size, size, 3), "float32")
    y_spec = tf.TensorSpec((rows,), "int32")
    e_spec = tf.TensorSpec((rows, args.embedding_dim), "float32")

    def function(fn, *specs):
        return tf.function(fn, input_signature=specs, jit_compile=args.jit_compile)

    steps = {
        "forward of the batch (no tape)": (
            function(lambda x: plain.embedding_model(x, training=True)
                     if hasattr(plain, "embedding_model") else plain(x, training=True),
                     x_spec), (images,)),
        "plain step": (function(lambda x, y: plain.train_step((x, y))["loss"],
                                x_spec, y_spec), (images, labels)),
        "stage 1: embed in chunks": (function(multi._embed_in_chunks, x_spec), (images,)),
    }
    embeddings = steps["stage 1: embed in chunks"][0](images)
    grad = tf.random.normal(embeddings.shape) * 1e-3
    steps["stage 2: loss and G"] = (
        function(lambda y, e: multi._loss_and_output_gradient(y, e, None, variables)[2],
                 y_spec, e_spec), (labels, embeddings))
    steps["stage 3: re-embed + backprop"] = (
        function(lambda x, g, e: multi._backprop_in_chunks(x, g, e, variables)[0],
                 x_spec, e_spec, e_spec), (images, grad, embeddings))
    steps["multi-stage step"] = (function(lambda x, y: multi.train_step((x, y))["loss"],
                                          x_spec, y_spec), (images, labels))

    def run(fn, inputs):
        start = time.perf_counter()
        tree_out = fn(*inputs)
        tf.nest.map_structure(lambda t: t.numpy(), tree_out)
        return time.perf_counter() - start

    first = {name: run(fn, inputs) for name, (fn, inputs) in steps.items()}  # trace + warm
    times = {name: [] for name in steps}
    for _ in range(args.steps):  # interleaved: a disturbance hits every row alike
        for name, (fn, inputs) in steps.items():
            times[name].append(run(fn, inputs))
    best = {name: min(ts) for name, ts in times.items()}
    plain_s = best["plain step"]
    floor = best["forward of the batch (no tape)"] + plain_s
    stage_sum = sum(best[n] for n in best if n.startswith("stage"))
    print(f"\n{args.backbone} {size}x{size}, B={batch}, chunk={chunk} "
          f"({-(-batch // chunk)} chunks), {'dynamic' if args.dynamic_batch else 'static'} "
          f"batch, jit_compile={args.jit_compile}, best of {args.steps} (first call incl. "
          "tracing in brackets)")
    print(f"{'':34s} {'s':>8s} {'x plain step':>13s}")
    for name, value in best.items():
        print(f"{name:34s} {value:8.3f} {value / plain_s:13.2f}   ({first[name]:.1f} s)")
    print(f"{'sum of stages 1-3':34s} {stage_sum:8.3f} {stage_sum / plain_s:13.2f}")
    print(f"{'floor: forward + plain step':34s} {floor:8.3f} {floor / plain_s:13.2f}")
    ratio = best["multi-stage step"] / plain_s
    print(f"multi-stage / plain = {ratio:.2f}   (floor {floor / plain_s:.2f}, "
          f"target <= 1.40)")
    return {"config": {k: v for k, v in vars(args).items() if k not in ("cell", "mode")},
            "best_s": best, "first_call_s": first, "ratio": ratio,
            "floor_ratio": floor / plain_s}


# -- the grid, one child process per cell ----------------------------------------------


def run_child(args, mode: str, batch: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--cell", "--mode", mode,
               "--batch", str(batch),
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
        watched_peak = max(watched_peak, harness.rss_gb(child.pid))
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


def grid_figures(results: list[dict], batch_sizes: list[int]) -> list[dict]:
    by = {(r["mode"], r["batch"]): r for r in results}
    out = []
    for b in batch_sizes:
        p, m = by.get(("plain", b), {}), by.get(("multistage", b), {})
        if not m:
            continue
        ok, peer_ok = m.get("status") == "ok", p.get("status") == "ok"
        for key, what, unit in (("step_s", "time per step", "s"),
                                ("peak_rss_gb", "peak RSS", "GB")):
            out.append(harness.figure(
                "multistage", f"B={b} chunk {m.get('chunk')}: multi-stage {what}",
                m.get(key) if ok else None, unit, floor=p.get(key) if peer_ok else None,
                floor_name="plain step", peer=True,
                note="" if ok and peer_ok else f"plain {p.get('status', 'not run')}, "
                                              f"multi-stage {m.get('status', 'not run')}"))
    return out


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
    parser.add_argument("--stages", action="store_true",
                        help="time the stages of one multi-stage step beside the plain "
                        "step, in this process (uses --batch, --chunk)")
    parser.add_argument("--dynamic-batch", action="store_true",
                        help="--stages: trace for any batch size (None) instead of --batch")
    parser.add_argument("--unroll-chunks", type=int, default=None,
                        help="--stages: unroll at most this many chunks (0: tf.while_loop)")
    harness.add_arguments(parser, harness.RESULTS_DIR / "multistage.json",
                          out_aliases=("--output",),
                          quick_help="small_cnn at 32², B=128, chunk 32 (with --stages: "
                                     "small_cnn at 32², --batch 128)",
                          tiny_help="small_cnn at 16², B=16, chunk 8, 32-d")
    # Internal: run one cell in this process and print its JSON.
    parser.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["plain", "multistage"], help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=32,
                        help="--stages: batch size (the grid uses --batch-sizes)")
    args = parser.parse_args(argv)
    if (args.quick or args.tiny) and not args.cell:
        args.quick = True
        for key, value in (TINY if args.tiny else QUICK).items():
            setattr(args, key, value)
        args.batch = int(args.batch_sizes)

    if args.stages:
        result = run_stages(args)
        best = result["best_s"]
        floor = best["forward of the batch (no tape)"] + best["plain step"]
        figures = [harness.figure(
            "multistage", f"stages B={args.batch} chunk {args.chunk}: multi-stage step",
            best["multi-stage step"], "s", floor=floor,
            floor_name="one forward + the plain step")]
        out = Path(args.out).with_name("multistage_stages.json")
        harness.write_results(out, "multistage", args, figures, **result)
        return

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
    harness.write_results(args.out, "multistage", args, grid_figures(results, batch_sizes),
                          results=results, table=table)


if __name__ == "__main__":
    main()
