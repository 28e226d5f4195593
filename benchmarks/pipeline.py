"""Benchmark: the folder Beam job against the one-core floor, and the input pipeline.

1. Generates ``--num_images`` 800x600 JPEGs (smooth colour fields plus noise, so they
   compress like photos) in a class-per-folder tree of ``--num_classes`` classes, and
   reads them once so that every measurement finds them in the page cache.
2. **Floor**: one core running the bare PIL loop the job cannot avoid (decode with
   JPEG draft, RGB, BICUBIC resize to ``--max_side``, JPEG encode at quality 90), with
   the same settings as the job, so the same output bytes. Beside it, the two-core
   ceiling: the same loop in one process per core, all at once (what the cores give
   when nothing else runs).
3. **Job**: ``tfaploss.pipelines.folder --max_side 512`` with its defaults (the local
   DirectRunner in one process, image work in one forked process per core),
   in-process: images/s including start-up (planning, Beam set-up, the by_class
   layout, manifest, publish), start-up seconds (job start to the first image work),
   steady-state images/s (after the first batch) and finish seconds (last image to
   published), each rate with its ratio to the floor. Floor and job alternate for
   ``--rounds`` rounds (a shared machine's speed drifts by 20 % between minutes): each
   round's ratio pairs figures taken seconds apart, and the table shows every round
   and their median. Also the same job through ``python -m tfaploss.pipelines.folder`` (adds
   the interpreter and imports), and any extra ``--modes`` (``threads``: the image
   work on threads of the Beam process, ``--image_processes 1``; ``multi_processing:2``:
   Beam's own multi-process mode).
4. CPU-seconds per image of the job (its image processes included) against the
   floor: a figure a busy machine does not distort as much as wall-clock rates.
5. Optionally (``--input_pipeline``) batches per second of
   ``tfaploss.data.make_train_dataset(sampler="m_per_class")``.

Prints a table and writes ``benchmarks/results/pipeline.json``; its figures are the rows
measured beside the floor, with their ratio.

With ``--sizes`` (e.g. ``600,2400,20000``) it measures instead what a user waits for: the
job as a whole process (``python -m tfaploss.pipelines.folder``: interpreter, imports, start-up,
finish), its defaults against ``--peers`` (Beam's ``multi_processing:2`` unless told),
at each size, for ``--rounds`` rounds. The trees hard-link ``--unique_images`` generated
JPEGs, so 20,000 images cost the generation of 1,000. Before each job run the floor
runs on ``--floor_images`` of the same images, and the order of the modes rotates from
round to round; each cell gives images/s, its ratio to that floor and the load average,
and the table ends with the job's CPU-seconds per image (all its processes) beside the
floor's, a figure a busy machine distorts less.

    python benchmarks/pipeline.py --num_images 600
    python benchmarks/pipeline.py --quick       # 120 images, one round, no extra modes
    python benchmarks/pipeline.py --sizes 600,2400,20000 --workdir folder_bench
    python benchmarks/pipeline.py --sizes 600,2400 --quick  # 120 images at most, one round
"""

from __future__ import annotations

import argparse
import io
import math
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import harness

from tfaploss.pipelines import folder, images, runner


def generate(root: str, num_images: int, num_classes: int, size=(800, 600)) -> None:
    rng = np.random.default_rng(0)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for i in range(num_images):
        k = i % num_classes
        base = rng.uniform(0, 255, size=(3,)).astype(np.float32)
        fx, fy = rng.uniform(0.002, 0.02, size=2)
        field = (np.sin(xx * fx + k)[..., None] * 60 + np.cos(yy * fy)[..., None] * 60 + base)
        noise = rng.normal(0, 12, size=(h // 4, w // 4, 3)).repeat(4, 0).repeat(4, 1)
        pixels = np.clip(field + noise, 0, 255).astype(np.uint8)
        os.makedirs(os.path.join(root, f"class{k:03d}"), exist_ok=True)
        Image.fromarray(pixels).save(os.path.join(root, f"class{k:03d}", f"{i:06d}.jpg"),
                                     quality=90)
        if (i + 1) % 250 == 0:
            print(f"  generated {i + 1}/{num_images}", flush=True)


def generate_sizes(work: str, sizes: list[int], num_classes: int, unique: int) -> dict:
    """One class-per-folder tree per size under ``work``, of hard links to ``unique``
    generated JPEGs (image ``i`` is unique image ``i % unique``): 20,000 images cost the
    generation of 1,000 and their page cache, and every tree holds distinct file names.
    Returns ``{size: tree}``; trees already there are reused."""
    pool = os.path.join(work, "unique")
    unique = min(unique, max(sizes))
    if not os.path.isdir(pool):
        print(f"generating {unique} 800x600 JPEGs in {pool}", flush=True)
        generate(pool + ".tmp", unique, 1)
        os.replace(pool + ".tmp", pool)
    sources = _files(pool)
    trees = {}
    for n in sizes:
        tree = trees[n] = os.path.join(work, f"tree{n}")
        if os.path.isdir(tree):
            continue
        tmp = tree + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for i in range(n):
            folder_ = os.path.join(tmp, f"class{i % num_classes:03d}")
            os.makedirs(folder_, exist_ok=True)
            target = os.path.join(folder_, f"{i:06d}.jpg")
            try:
                os.link(sources[i % len(sources)], target)
            except OSError:  # a file system without hard links
                shutil.copyfile(sources[i % len(sources)], target)
        os.replace(tmp, tree)
    return trees


def _files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def bare_image_work(path: str, max_side: int) -> bytes:
    """The floor's per-image work: what no job can skip."""
    with open(path, "rb") as f:
        img = Image.open(io.BytesIO(f.read()))
    w, h = img.size
    s = max_side / max(w, h)
    img.draft("RGB", (math.ceil(w * s), math.ceil(h * s)))
    img = img.convert("RGB")
    w, h = img.size
    s = max_side / max(w, h)
    img = img.resize((round(w * s), round(h * s)), Image.Resampling.BICUBIC, reducing_gap=3.0)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, optimize=False)
    return buf.getvalue()


def floor(files: list[str], max_side: int) -> tuple[float, float]:
    """(images/s, CPU-seconds per image) of the bare loop on one core."""
    for path in files[:20]:
        bare_image_work(path, max_side)  # warm-up: code paths, allocator
    t, c = time.perf_counter(), time.process_time()
    for path in files:
        bare_image_work(path, max_side)
    return len(files) / (time.perf_counter() - t), (time.process_time() - c) / len(files)


def two_core_ceiling(files: list[str], max_side: int) -> float:
    """images/s of the bare loop in one process per core, all at once."""
    cores = len(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=lambda part: [bare_image_work(p, max_side) for p in part],
                         args=(files[i::cores],)) for i in range(cores)]
    t = time.perf_counter()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return len(files) / (time.perf_counter() - t)


def _cpu_seconds() -> float:
    """CPU time of this process and of its reaped children (the image processes)."""
    return sum(r.ru_utime + r.ru_stime for r in (
        resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def job_in_process(root: str, out: str, max_side: int, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    c = _cpu_seconds()
    t = time.perf_counter()
    manifests = folder.run(["--input_dir", root, "--output_dir", out, "--max_side",
                            str(max_side), *extra])
    wall = time.perf_counter() - t
    n = manifests["train"]["num_images"]
    timing = dict(runner.LAST_TIMING)
    cpu = _cpu_seconds() - c
    return {"images": n, "wall": wall, "rate": n / wall, "startup": timing["startup_seconds"],
            "finish": timing["finish_seconds"],
            "steady": timing["steady_images_per_second"], "threads": timing["threads"],
            "processes": timing["processes"],
            "cpu_per_image": cpu / n}


def _workers(r: dict) -> str:
    if r["processes"] > 1:
        return f"1 Beam process, {r['processes']} image processes"
    return f"1 process, {r['threads']} image threads"


def _median_ratio(rounds, key: str) -> float:
    """Median over rounds of the job's ``key`` figure / that round's floor."""
    return statistics.median(r[key] / f for f, _, r in rounds)


def job_cli(root: str, out: str, max_side: int) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tfaploss.pipelines.folder", "--input_dir", root,
                           "--output_dir", out, "--max_side", str(max_side)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO}, capture_output=True,
                          text=True, check=True)
    wall = time.perf_counter() - t
    n = int(done.stdout.split()[1])
    return n / wall, n


MODES = {
    "default": [],
    "in_memory": ["--direct_running_mode", "in_memory", "--direct_num_workers", "1"],
    "threads": ["--image_processes", "1"],
}


def mode_args(mode: str) -> list[str]:
    """The job's extra arguments for ``mode``: a name of :data:`MODES`, or
    ``multi_processing:N`` (Beam's own mode, N workers)."""
    if mode in MODES:
        return MODES[mode]
    name, _, workers = mode.partition(":")
    if name == "batch" and workers.isdigit():
        return ["--images_per_batch", workers]
    if name != "multi_processing":
        raise ValueError(f"--peers: unknown mode {mode!r}; one of {sorted(MODES)}, "
                         "multi_processing:N or batch:N (--images_per_batch N)")
    return ["--direct_running_mode", name, "--direct_num_workers", workers or "2"]


def job_subprocess(root: str, out: str, max_side: int,
                   extra: list[str]) -> tuple[float, int, float]:
    """(images/s, images, CPU-seconds) of ``python -m tfaploss.pipelines.folder``: its wall time
    includes the interpreter, imports and start-up; its CPU time, every process it
    started (image processes, Beam's workers)."""
    shutil.rmtree(out, ignore_errors=True)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tfaploss.pipelines.folder", "--input_dir", root,
                           "--output_dir", out, "--max_side", str(max_side), *extra],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = r.ru_utime + r.ru_stime - c.ru_utime - c.ru_stime
    if done.returncode:
        raise SystemExit(f"the folder job failed ({' '.join(extra) or 'defaults'}):\n"
                         f"{done.stderr[-3000:]}")
    n = int(done.stdout.split()[1])
    shutil.rmtree(out, ignore_errors=True)
    return n / wall, n, cpu


def sizes_table(args, work: str) -> tuple[list[dict], list[dict]]:
    """The job's default against ``--peers`` at each of ``--sizes``, whole processes
    (start-up included), beside the one-core floor measured just before each job run.

    Each round visits every size; within a size the floor runs first, then the modes in
    an order that rotates from round to round, so no mode always runs on the warmest or
    the coldest minute. Returns (rows, figures).
    """
    sizes = [int(n) for n in args.sizes.split(",") if n.strip()]
    modes = ["default", *filter(None, args.peers.split(","))]
    for mode in modes:
        mode_args(mode)  # a bad name fails before the long part
    trees = generate_sizes(work, sizes, args.num_classes, args.unique_images)
    for tree in trees.values():
        for path in _files(tree):  # page cache
            with open(path, "rb") as f:
                f.read()
    rows = []
    for k in range(args.rounds):
        for n in sizes:
            files = _files(trees[n])[:args.floor_images]
            order = modes[k % len(modes):] + modes[:k % len(modes)]
            for mode in order:
                load = os.getloadavg()[0]
                floor_rate, floor_cpu = floor(files, args.max_side)
                print(f"round {k + 1}/{args.rounds}, {n} images, {mode}...", flush=True)
                rate, done, cpu = job_subprocess(trees[n], os.path.join(work, "out"),
                                            args.max_side, mode_args(mode))
                if done != n:
                    raise SystemExit(f"{mode} wrote {done} of {n} images")
                rows.append({"round": k + 1, "images": n, "mode": mode, "rate": rate,
                             "floor": floor_rate, "ratio": rate / floor_rate,
                             "load_average": load, "cpu_ms_per_image": 1000 * cpu / n,
                             "floor_cpu_ms_per_image": 1000 * floor_cpu})
                print(f"  {rate:7.1f} images/s, floor {floor_rate:6.1f}, "
                      f"x{rate / floor_rate:.2f}, load {load:.1f}; CPU per image "
                      f"{1000 * cpu / n:.1f} ms (floor {1000 * floor_cpu:.1f} ms)", flush=True)
    figures = []
    for n in sizes:
        for mode in modes:
            mine = [r for r in rows if r["images"] == n and r["mode"] == mode]
            ratio = statistics.median(r["ratio"] for r in mine)
            floor_rate = statistics.median(r["floor"] for r in mine)
            figures.append(harness.figure(
                "pipeline", f"folder job, {mode}, {n} images, whole process", ratio * floor_rate,
                "images/s", floor=floor_rate, higher_is_better=True,
                floor_name="one core, bare PIL loop"))
    return rows, figures


def print_sizes(rows: list[dict], max_side: int) -> None:
    """The sizes table in Markdown: per size and mode, each round's images/s, its ratio
    to that round's floor and the load average, then the range of the ratios."""
    print(f"\n800x600 JPEGs -> --max_side {max_side}, {os.cpu_count()} CPUs; each cell: "
          "images/s (x one-core floor measured just before, load average)")
    rounds = sorted({r["round"] for r in rows})
    print("| images | mode | " + " | ".join(f"round {k}" for k in rounds) +
          " | x floor | CPU ms/image (floor) |")
    print("|---|---|" + "---|" * len(rounds) + "---|---|")
    for n in sorted({r["images"] for r in rows}):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = {r["round"]: r for r in rows if r["images"] == n and r["mode"] == mode}
            cells = [f"{mine[k]['rate']:.0f} ({mine[k]['ratio']:.2f}, "
                     f"{mine[k]['load_average']:.1f})" if k in mine else "-" for k in rounds]
            ratios = [r["ratio"] for r in mine.values()]
            cpu = statistics.median(r["cpu_ms_per_image"] for r in mine.values())
            floor_cpu = statistics.median(r["floor_cpu_ms_per_image"] for r in mine.values())
            print(f"| {n:,} | {mode} | " + " | ".join(cells) +
                  f" | {min(ratios):.2f}–{max(ratios):.2f} | {cpu:.1f} ({floor_cpu:.1f}) |")


def input_pipeline(split_dir: str, batch_size: int, m: int, batches: int) -> float:
    import tfaploss.data as D

    ds = D.make_train_dataset(split_dir, sampler="m_per_class", batch_size=batch_size, m=m,
                              image_size=224, augment=True, seed=0)
    it = iter(ds)
    for _ in range(3):  # warm-up: graph building, AUTOTUNE ramp-up, file opening
        next(it)
    t = time.perf_counter()
    for _ in range(batches):
        images, _ = next(it)
    images.numpy()
    return batches / (time.perf_counter() - t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num_images", type=int, default=600)
    p.add_argument("--num_classes", type=int, default=50)
    p.add_argument("--max_side", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating (floor, job) rounds; the table shows their median")
    p.add_argument("--modes", default="threads,multi_processing:2",
                   help="extra ways to run the job: threads (--image_processes 1), "
                        "multi_processing:N (Beam's own); '' none")
    p.add_argument("--input_pipeline", action="store_true",
                   help="also time the m_per_class input pipeline (imports TensorFlow)")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--workdir", default=None, help="keep generated data here")
    p.add_argument("--sizes", default="",
                   help="instead of the rounds above: the job as a whole process (start-up "
                        "included) at each of these image counts, e.g. 600,2400,20000, "
                        "default against --peers, each beside the floor")
    p.add_argument("--peers", default="multi_processing:2",
                   help="with --sizes: the modes the default is compared with "
                        "(multi_processing:N, batch:N, in_memory, threads)")
    p.add_argument("--unique_images", type=int, default=1000,
                   help="with --sizes: distinct generated images; the trees hard-link them")
    p.add_argument("--floor_images", type=int, default=600,
                   help="with --sizes: images of the floor loop before each job run")
    harness.add_arguments(p, harness.RESULTS_DIR / "pipeline.json",
                          quick_help="120 images, one round, no extra --modes",
                          tiny_help="24 images in batches of 4, one round, no extra --modes")
    p.add_argument("--images_per_batch", type=int, default=None,
                   help="the job's --images_per_batch (default: the job's own)")
    args = p.parse_args(argv)
    if args.sizes:
        return main_sizes(args)
    if args.quick or args.tiny:
        cap_images, cap_classes = (24, 4) if args.tiny else (120, 20)
        args.num_images = min(args.num_images, cap_images)
        args.num_classes = min(args.num_classes, cap_classes)
        args.rounds, args.modes, args.quick = 1, "", True
        if args.tiny and args.images_per_batch is None:
            # more than one batch, or the job has no steady state to report
            args.images_per_batch = 4
    job_extra = ([] if args.images_per_batch is None
                 else ["--images_per_batch", str(args.images_per_batch)])

    work = args.workdir or tempfile.mkdtemp(prefix="tfaploss_bench_")
    root = os.path.join(work, "images")
    rows = []  # (measurement, value, unit, floor or None)
    try:
        if not os.path.isdir(root):
            print(f"generating {args.num_images} 800x600 JPEGs in {root}", flush=True)
            generate(root, args.num_images, args.num_classes)
        files = _files(root)
        for path in files:  # page cache
            with open(path, "rb") as f:
                f.read()
        for path in files[:20]:  # the floor does the job's work, byte for byte
            with open(path, "rb") as f:
                job_jpeg = images.process_image_bytes(f.read(), max_side=args.max_side)[0]
            if job_jpeg != bare_image_work(path, args.max_side):
                raise SystemExit(f"the floor loop and the job encode {path} differently")
        rounds = []
        for k in range(args.rounds):
            print(f"round {k + 1}/{args.rounds}: one-core floor, then the folder job...",
                  flush=True)
            floor_rate, floor_cpu = floor(files, args.max_side)
            r = job_in_process(root, os.path.join(work, "out"), args.max_side, job_extra)
            rounds.append((floor_rate, floor_cpu, r))
        ceiling = two_core_ceiling(files, args.max_side)
        floor_rate = statistics.median(f for f, _, _ in rounds)
        floor_cpu = statistics.median(c for _, c, _ in rounds)
        r = rounds[-1][2]
        label = f"folder job ({_workers(r)})"
        # A job of one batch (the quick mode's 120 images in batches of 128) has no
        # steady state: its rate is left out rather than shown as 0.
        steady = all(jr["steady"] > 0 for *_, jr in rounds)
        for k, (f, _, jr) in enumerate(rounds):
            rows += [(f"round {k + 1}: one-core floor", f, "images/s", None),
                     (f"round {k + 1}: {label}, incl. start-up", jr["rate"], "images/s", f)]
            if steady:
                rows.append((f"round {k + 1}: {label}, steady state", jr["steady"],
                             "images/s", f))
        rows += [
            ("median one-core floor: PIL decode+RGB+resize+JPEG encode", floor_rate,
             "images/s", None),
            ("two-core ceiling: the floor loop in a process per core", ceiling, "images/s",
             floor_rate),
            (f"median {label}, incl. start-up", _median_ratio(rounds, "rate") * floor_rate,
             "images/s", floor_rate)]
        if steady:
            rows.append((f"median {label}, steady state",
                         _median_ratio(rounds, "steady") * floor_rate, "images/s", floor_rate))
        rows += [
            (f"median {label}, start-up", statistics.median(x["startup"] for *_, x in rounds),
             "s", None),
            (f"median {label}, finish (write shards, manifest, publish)",
             statistics.median(x["finish"] for *_, x in rounds), "s", None),
            (f"median {label}, CPU per image (floor: {1000 * floor_cpu:.1f} ms)",
             1000 * statistics.median(x["cpu_per_image"] for *_, x in rounds), "ms", None)]
        print("folder job, defaults, python -m tfaploss.pipelines.folder...", flush=True)
        rate, _ = job_cli(root, os.path.join(work, "out_cli"), args.max_side)
        rows.append(("python -m tfaploss.pipelines.folder, incl. interpreter and imports", rate,
                     "images/s", floor_rate))
        for mode in filter(None, args.modes.split(",")):
            name, _, workers = mode.partition(":")
            if name == "threads":
                extra = ["--image_processes", "1"]
            else:
                extra = ["--direct_running_mode", name]
                if workers:
                    extra += ["--direct_num_workers", workers]
            print(f"folder job, {mode}...", flush=True)
            r = job_in_process(root, os.path.join(work, f"out_{name}"), args.max_side,
                               job_extra + extra)
            label = (f"folder job ({_workers(r)})" if name == "threads" else
                     f"folder job ({name}, {workers or 1} workers x {r['threads']} threads)")
            rows += [(f"{label}, incl. start-up", r["rate"], "images/s", floor_rate),
                     *([(f"{label}, steady state", r["steady"], "images/s", floor_rate)]
                       if r["steady"] > 0 else []),
                     (f"{label}, start-up", r["startup"], "s", None)]
        if args.input_pipeline:
            print("m_per_class input pipeline...", flush=True)
            bps = input_pipeline(os.path.join(work, "out", "train"), args.batch_size, args.m,
                                 args.batches)
            name = f"m_per_class sampler, B={args.batch_size} (m={args.m}), 224x224 augmented"
            rows.append((name, bps, "batches/s", None))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    width = max(len(r[0]) for r in rows)
    print(f"\n{len(files)} images 800x600 -> --max_side {args.max_side}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'measurement'.ljust(width)}  {'value':>8}  {'unit':8}  x floor")
    for name, value, unit, base in rows:
        ratio = f"{value / base:6.2f}" if base else ""
        print(f"{name.ljust(width)}  {value:8.2f}  {unit:8}  {ratio}")
    figures = [harness.figure("pipeline", n, v, u, floor=b, higher_is_better=True,
                              floor_name="one core, bare PIL loop")
               for n, v, u, b in rows if b and not n.startswith("round ")]
    harness.write_results(args.out, "pipeline", args, figures, num_images=len(files),
                          rows=[{"measurement": n, "value": v, "unit": u,
                                 "ratio_to_floor": (v / b if b else None)}
                                for n, v, u, b in rows])
    return 0


def main_sizes(args) -> int:
    if args.quick:
        args.sizes = ",".join(str(min(int(n), 120)) for n in args.sizes.split(","))
        args.rounds, args.unique_images, args.floor_images = 1, 60, 60
    work = args.workdir or tempfile.mkdtemp(prefix="tfaploss_bench_")
    try:
        rows, figures = sizes_table(args, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print_sizes(rows, args.max_side)
    harness.write_results(args.out, "pipeline", args, figures, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
