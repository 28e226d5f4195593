"""Input work under data parallelism: W local rank processes, each feeding its shard of
one global batch, decoding only its own rows against decoding the whole batch.

    python benchmarks/sharded_input.py                 # 600 JPEGs, B=64, W = 2 and 4
    python benchmarks/sharded_input.py --quick         # 240 JPEGs, B=32, one round

1. Generates ``--num_images`` photo-like JPEGs (``input_pipeline.generate_jpegs``) and
   writes them with the folder job, as a user would before training.
2. For each W of ``--ranks``, starts W processes at once; rank r builds
   * ``own``: ``make_train_dataset(..., num_shards=W, shard_index=r)`` (decodes its
     B / W rows), or
   * ``all``: ``shard_batches(make_train_dataset(...), W, r)`` (decodes all B rows and
     keeps B / W, the old route),
   both in the same process. In each of ``--rounds`` rounds the two routes take turns:
   every rank waits for the others, drains what its prefetch buffers filled while it
   waited (``--warmup`` batches), then counts the batches of a ``--seconds`` window, so
   the W ranks' windows overlap. One process drawing the whole batch (W = 1) runs the
   same way before and after them. The best round of each is kept.
3. Each rank counts the images it decoded (the decode-and-augment function wrapped
   with a counter), so the decodes per global batch are measured, not assumed.

Figures: each rank's images/s (its shard's rows) decoding its own rows beside the old
route in the same run (the peer), and the global batch rate (W x the slowest rank's
rows/s, as synchronous training runs at the slowest rank) beside the one-process
full-batch rate (the floor: the same images decoded with the whole machine).

W processes on fewer than W cores share them: decoding only one's rows can at best
give back the factor W the old route wasted; it cannot make W ranks faster than one
process using every core. Writes ``benchmarks/results/sharded_input.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, HERE)

import harness
import input_pipeline


def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.005)


def _touch(path: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write("x")


def worker(args) -> int:
    """One rank: build both routes' datasets, warm them up, then for each round and
    route wait for the other ranks, drain what was prefetched meanwhile, and count the
    batches and decodes of a ``--seconds`` window; write them as JSON."""
    import tensorflow as tf

    from tfaploss.data import datasets
    from tfaploss.data.samplers import shard_batches

    real = datasets._augment_fn

    def counting(decoded):  # counts each decode-and-augment call, i.e. each JPEG decode
        def make(*a, **k):
            inner = real(*a, **k)

            def fn(encoded, seed):
                def bump():
                    decoded[0] += 1
                    return 0
                seen = tf.py_function(bump, [], tf.int64)
                with tf.control_dependencies([seen]):
                    return inner(encoded, seed)
            return fn
        return make

    kw = {"batch_size": args.batch, "m": args.m, "image_size": args.image_size,
          "seed": args.seed}
    w, r = args.num_shards, args.shard_index
    modes = args.modes.split(",")
    iters, decoded = {}, {}
    for mode in modes:
        decoded[mode] = [0]
        datasets._augment_fn = counting(decoded[mode])
        if mode == "own":
            ds = datasets.make_train_dataset(args.split, num_shards=w, shard_index=r, **kw)
        elif mode == "choose":  # one class per shard: m decodes per global batch
            ds = datasets.make_train_dataset(args.split, num_shards=args.batch // args.m,
                                             shard_index=0, **kw)
        else:
            ds = shard_batches(datasets.make_train_dataset(args.split, **kw), w, r)
        iters[mode] = iter(ds)
        for _ in range(args.warmup):
            next(iters[mode])[0].numpy()

    def settle():
        """Waits until no pipeline decodes any more: an idle pipeline refills the
        prefetch buffers its last window drained, which must not run in the next one."""
        last = None
        while True:
            now = tuple(d[0] for d in decoded.values())
            if now == last:
                return
            last = now
            time.sleep(0.3)

    phases = []
    for rnd in range(args.rounds):
        for mode in modes:
            k = len(phases)
            settle()
            _touch(f"{args.prefix}.{r}.ready{k}")
            _wait_for(f"{args.prefix}.go{k}")
            it = iters[mode]
            for _ in range(args.warmup):  # what its prefetch buffers filled while idle
                next(it)[0].numpy()
            count = decoded[mode]
            start_decodes, t0, batches, rows = count[0], time.perf_counter(), 0, 0
            while time.perf_counter() - t0 < args.seconds:
                rows += next(it)[0].numpy().shape[0]
                batches += 1
            seconds = time.perf_counter() - t0
            phases.append({"round": rnd, "mode": mode, "batches": batches,
                           "rows_per_s": rows / seconds,
                           "decodes_per_batch": (count[0] - start_decodes) / batches})
    harness.write_json(f"{args.prefix}.{r}.json", {"phases": phases})
    return 0


def run_config(args, split: str, work: str, w: int, modes: list[str]) -> list[dict]:
    """W rank processes at once, their windows in step; every phase's results, each
    with the slowest rank's images/s and the most decodes per batch of any rank."""
    prefix = os.path.join(work, f"w{w}-{time.monotonic_ns()}")
    procs = []
    for r in range(w):
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--modes",
                   ",".join(modes), "--num_shards", str(w), "--shard_index", str(r),
                   "--split", split, "--prefix", prefix, "--batch", str(args.batch),
                   "--m", str(args.m), "--image_size", str(args.image_size),
                   "--seconds", str(args.seconds), "--rounds", str(args.rounds),
                   "--warmup", str(args.warmup), "--seed", str(args.seed)]
        procs.append(subprocess.Popen(command, cwd=REPO_ROOT))
    for k in range(args.rounds * len(modes)):
        while not all(os.path.exists(f"{prefix}.{r}.ready{k}") for r in range(w)):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.01)
        _touch(f"{prefix}.go{k}")
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"a rank of W={w} failed with exit {p.returncode}")
    ranks = []
    for r in range(w):
        with open(f"{prefix}.{r}.json", encoding="utf-8") as f:
            ranks.append(json.load(f)["phases"])
    phases = []
    for k, phase in enumerate(ranks[0]):
        per_rank = [ranks[r][k] for r in range(w)]
        phases.append({"round": phase["round"], "mode": phase["mode"],
                       "per_rank": min(x["rows_per_s"] for x in per_rank),
                       "decodes": max(x["decodes_per_batch"] for x in per_rank),
                       "ranks": per_rank})
    return phases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="comma-separated W (local processes)")
    p.add_argument("--batch", type=int, default=64, help="global batch B")
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--image_size", type=int, default=128)
    p.add_argument("--seconds", type=float, default=6.0, help="timed window per phase")
    p.add_argument("--warmup", type=int, default=3, help="batches before each window")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    input_pipeline.add_data_arguments(p, num_images=600, num_classes=50)
    harness.add_arguments(p, harness.RESULTS_DIR / "sharded_input.json",
                          quick_help="240 JPEGs of 30 classes, B=32, 3 s windows, one round, "
                                     "the one-process run only before the ranks",
                          tiny_help="64 small JPEGs of 8 classes, B=16, 1 s windows, "
                                    "2 ranks")
    # A rank process (started by main, not by hand).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("modes", "split", "prefix"):
        p.add_argument(f"--{name}", help=argparse.SUPPRESS)
    p.add_argument("--num_shards", type=int, help=argparse.SUPPRESS)
    p.add_argument("--shard_index", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.batch, args.seconds, args.rounds = 32, 3.0, 1
        args.num_images, args.num_classes = min(args.num_images, 240), min(args.num_classes, 30)
    if args.tiny:
        args.batch, args.seconds, args.warmup = 16, 1.0, 1
        args.num_images, args.num_classes = 64, 8
        args.image_size_on_disk, args.ranks = "96x72", "2"
    ranks = [int(w) for w in args.ranks.split(",") if w]
    for w in ranks:
        if args.batch % w or (args.batch // w) % args.m:
            p.error(f"--batch {args.batch} must split into {w} shards of a multiple of "
                    f"m={args.m} images")

    work = args.workdir or tempfile.mkdtemp(prefix="tfaploss_sharded_")
    try:
        split = input_pipeline.prepare_split(args, work)
        load_before = os.getloadavg()
        print(f"B={args.batch}, m={args.m}, {args.image_size}² crops of "
              f"{args.image_size_on_disk} JPEGs; {os.cpu_count()} CPUs; load average "
              f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)

        best: dict = {}
        # One process drawing the whole batch, before and after the ranks: the best of both.
        # "choose": one process decoding one class (m images) of each global batch, i.e.
        # about what choosing the batch costs every rank, whatever W.
        after = [] if args.quick else [(1, ["own", "choose"])]
        for w, modes in ([(1, ["own", "choose"])] + [(w, ["all", "own"]) for w in ranks]
                         + after):
            for phase in run_config(args, split, work, w, modes):
                print(f"  W={w} {phase['mode']:>3}, round {phase['round'] + 1}: slowest "
                      f"rank {phase['per_rank']:7.1f} images/s of its shard, global batch "
                      f"{phase['per_rank'] * w:7.1f} images/s, decodes per rank per batch "
                      f"{phase['decodes']:.1f}", flush=True)
                key = (w, phase["mode"])
                if phase["per_rank"] > best.get(key, {}).get("per_rank", 0.0):
                    best[key] = phase
        load_after = os.getloadavg()
        full = best[(1, "own")]["per_rank"]
        choose = best[(1, "choose")]["per_rank"] / args.m * args.batch
        print(f"\nload average after: {load_after[0]:.2f} {load_after[1]:.2f} "
              f"{load_after[2]:.2f}\n")
        print("| W | route | decodes per rank per global batch | images/s per rank "
              "| global batch images/s | vs one process |\n|---:|---|---:|---:|---:|---:|")
        print(f"| 1 | whole batch | {best[(1, 'own')]['decodes']:.1f} | {full:.1f} | "
              f"{full:.1f} | 1.00 |")
        print(f"| 1 | choose the batch, decode one class | {best[(1, 'choose')]['decodes']:.1f} "
              f"| - | {choose:.1f} (global batches/s x B) | {choose / full:.2f} |")
        figures = []
        for w in ranks:
            for mode, route in (("all", "decode all, keep B/W"), ("own", "decode own B/W")):
                b = best[(w, mode)]
                print(f"| {w} | {route} | {b['decodes']:.1f} | {b['per_rank']:.1f} | "
                      f"{b['per_rank'] * w:.1f} | {b['per_rank'] * w / full:.2f} |")
            own, old = best[(w, "own")], best[(w, "all")]
            figures += [
                harness.figure("sharded_input", f"W={w} ranks, B={args.batch}: images/s per "
                               "rank, decoding its own rows", own["per_rank"], "images/s",
                               floor=old["per_rank"], floor_name="decoding the whole batch",
                               peer=True, higher_is_better=True,
                               note=f"decodes/rank/batch {own['decodes']:.1f} vs "
                                    f"{old['decodes']:.1f}"),
                harness.figure("sharded_input", f"W={w} ranks, B={args.batch}: global batch "
                               "images/s (W x slowest rank)", own["per_rank"] * w,
                               "images/s", floor=full,
                               floor_name="one process drawing the whole batch",
                               higher_is_better=True),
            ]
        print()
        print(harness.summary_table(figures))
        harness.write_results(args.out, "sharded_input", args, figures,
                              load_average_before=load_before, load_average_after=load_after,
                              configs={f"W={w} {mode}": v for (w, mode), v in best.items()})
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
