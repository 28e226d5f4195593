"""What counting lone queries costs a training step: the ``LoneQueryShare`` metric and
the ``LoneQueryMonitor`` callback against the same ``fit`` step without them.

A ``SmoothAPLoss`` step of a small model (64 -> 256 -> 128, ReLU) at ``--batch``
(labels: classes of 4 in every batch), timed per epoch of ``--steps`` steps inside
``fit`` (a callback's epoch begin to its end, so ``fit``'s own set-up is not counted),
the two models interleaved over ``--repeats`` epochs each (the order alternates, so a
drift of the machine's load hits both), after a warm-up epoch each (compilation).
Wall time and the process's CPU time (all its threads) are both kept: on a shared
machine the CPU time is the steadier of the two.
Three modes, each in a fresh process per backend: JAX (``jax.jit``), a TensorFlow graph
(``jit_compile=False``) and TensorFlow under XLA (``jit_compile=True``). Prints the
median time per step of each, the step without the count as the floor, and the
ratio: the median over the repeats of the two epochs' ratio (a repeat's two epochs run
back to back, so a drift of the load cancels), in wall and in CPU time; the goal is at
most 1.02.

    python benchmarks/lone_queries.py             # B=256, 100 steps an epoch, 15 repeats
    python benchmarks/lone_queries.py --quick     # B=256, 20 steps, 15 repeats
    python benchmarks/lone_queries.py --tiny      # B=32, 10 steps, 2 repeats (the suite's test)

The monitor reads the metric every ``--every`` steps (its default, 20) and at each
epoch's end. Its figures are each mode's step with the count beside the step without
it (the floor), in wall and in CPU time, written to
``benchmarks/results/lone_queries.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness

REPO_ROOT = Path(__file__).resolve().parents[1]
MODES = {"jax": ("jax jit",), "tensorflow": ("tf graph", "tf xla")}
FEATURES = 64


def _data(batch, steps):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, FEATURES)).astype("float32")
    per_batch = np.repeat(np.arange(batch // 4), 4)
    y = np.concatenate([rng.permutation(per_batch) + s * batch for s in range(steps)])
    return x, y.astype("int32")


def _model(counted: bool, jit_compile: bool):
    import keras

    from tfaploss.losses import SmoothAPLoss
    from tfaploss.training import LoneQueryShare

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(128)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=SmoothAPLoss(),
                  metrics=[LoneQueryShare()] if counted else None, jit_compile=jit_compile)
    return model


def run_mode(mode: str, batch: int, steps: int, repeats: int, every: int) -> dict:
    """Seconds per epoch of ``steps`` steps, with and without the count, interleaved."""
    import keras

    from tfaploss.training import LoneQueryMonitor

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = (time.perf_counter() - self.start[0],
                            time.process_time() - self.start[1])

    x, y = _data(batch, steps)
    jit = mode != "tf graph"
    models = {"without": _model(False, jit), "with": _model(True, jit)}
    times = {"without": [], "with": []}  # (wall, CPU) seconds per epoch

    def epoch(name):
        timer = EpochTimer()
        extra = [LoneQueryMonitor(every=every)] if name == "with" else []
        models[name].fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                         callbacks=[timer, *extra])
        return timer.seconds

    for name in models:  # warm-up: tracing and compilation
        epoch(name)
    for r in range(repeats):
        for name in (("without", "with") if r % 2 == 0 else ("with", "without")):
            times[name].append(epoch(name))
    wall = {k: statistics.median(w for w, _ in v) / steps for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) / steps for k, v in times.items()}
    # Each repeat's two epochs ran back to back: their ratio cancels the load's drift.
    pairs = list(zip(times["with"], times["without"]))
    return {"mode": mode, "batch": batch, "steps": steps, "repeats": repeats,
            "every": every, "epoch_wall_cpu_s": times,
            "without_step_s": wall["without"], "with_step_s": wall["with"],
            "ratio": statistics.median(w / w0 for (w, _), (w0, _) in pairs),
            "without_cpu_step_s": cpu["without"], "with_cpu_step_s": cpu["with"],
            "cpu_ratio": statistics.median(c / c0 for (_, c), (_, c0) in pairs),
            "ratio_of_medians": wall["with"] / wall["without"]}


def _spawn(backend: str, args) -> list[dict]:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    if backend == "jax":
        env.setdefault("JAX_PLATFORMS", "cpu")
    command = [sys.executable, os.path.abspath(__file__), "--backend", backend,
               "--batch", str(args.batch), "--steps", str(args.steps),
               "--repeats", str(args.repeats), "--every", str(args.every)]
    done = subprocess.run(command, capture_output=True, text=True, env=env,
                          timeout=args.timeout, check=False)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        return [{"mode": mode, "status": f"failed (exit {done.returncode})",
                 "error": done.stderr[-800:]} for mode in MODES[backend]]
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=100, help="steps per timed epoch")
    p.add_argument("--repeats", type=int, default=15, help="timed epochs of each model")
    p.add_argument("--every", type=int, default=20, help="the monitor's read interval")
    p.add_argument("--timeout", type=int, default=900, help="seconds per backend process")
    p.add_argument("--backend", choices=sorted(MODES), help=argparse.SUPPRESS)
    harness.add_arguments(p, harness.RESULTS_DIR / "lone_queries.json",
                          quick_help="B=256, 20 steps an epoch, 15 repeats",
                          tiny_help="B=32, 10 steps an epoch, 2 repeats")
    args = p.parse_args(argv)
    if args.quick and not args.tiny:
        args.steps, args.repeats = 20, 15
    if args.tiny:
        args.batch, args.steps, args.repeats, args.quick = 32, 10, 2, True
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.backend:  # a child: one backend's modes, one JSON line each
        for mode in MODES[args.backend]:
            print(json.dumps(run_mode(mode, args.batch, args.steps, args.repeats,
                                      args.every)), flush=True)
        return 0
    rows = []
    for backend, modes in MODES.items():
        print(f"{backend}: {', '.join(modes)} at B={args.batch}, {args.steps} "
              f"steps an epoch, {args.repeats} repeats ...", flush=True)
        rows += _spawn(backend, args)
    print(f"\n| mode | step without the count (floor) | with LoneQueryShare + "
          f"LoneQueryMonitor(every={args.every}) | ratio (median of pairs) | ratio of "
          "medians | CPU per step: without, with | CPU ratio (median of pairs) |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        if "ratio" not in r:
            print(f"| {r['mode']} | {r['status']} | - | - | - | - | - |")
            continue
        print(f"| {r['mode']} | {1e3 * r['without_step_s']:.2f} ms | "
              f"{1e3 * r['with_step_s']:.2f} ms | {r['ratio']:.3f} | {r['ratio_of_medians']:.3f} | "
              f"{1e3 * r['without_cpu_step_s']:.2f} ms, {1e3 * r['with_cpu_step_s']:.2f} ms | "
              f"{r['cpu_ratio']:.3f} |")
    figures = []
    for r in rows:
        what = (f"{r['mode']}: SmoothAPLoss fit step B={r.get('batch', args.batch)}, "
                "lone-query metric + monitor")
        paired = "median of paired ratios {:.3f}"
        figures += [
            harness.figure("lone_queries", what, r.get("with_step_s"), "s",
                           floor=r.get("without_step_s"),
                           floor_name="the same step without the count",
                           note=r.get("status") or paired.format(r["ratio"])),
            harness.figure("lone_queries", what + ", CPU time", r.get("with_cpu_step_s"),
                           "s", floor=r.get("without_cpu_step_s"),
                           floor_name="the same step without the count, CPU time",
                           note=r.get("status") or paired.format(r["cpu_ratio"]))]
    harness.write_results(args.out, "lone_queries", args, figures, rows=rows)
    print(harness.summary_table(figures))
    return 0 if all("ratio" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
