"""Benchmark: the folder Beam job and the m_per_class input pipeline.

1. Generates ``--num_images`` 800x600 JPEGs (smooth colour fields plus noise, so they
   compress like photos) in a class-per-folder tree of ``--num_classes`` classes.
2. Images per second of a plain single-process Python loop doing the job's per-image
   work (read, decode, RGB, EXIF, resize to ``--max_side``, JPEG encode, Example): the
   speed limit of one core.
3. Images per second of ``python -m pipelines.folder --max_side 512`` on the local
   DirectRunner (multi_processing) with 1 and 2 workers, wall clock including Beam's
   start-up, the by_class layout and the manifest.
4. Batches per second of ``tfaploss.data.make_train_dataset(sampler="m_per_class")``
   feeding 224x224 RandomResizedCrop + flip images from those TFRecords.

Prints a table and writes ``benchmarks/results/pipeline.json``.

    python benchmarks/pipeline.py --num_images 2000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipelines import folder
from pipelines import transforms as T


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


def plain_loop(root: str, max_side: int) -> float:
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
    t = time.perf_counter()
    for i, path in enumerate(files):
        jpeg, hh, ww = T.process_image_bytes(T.read_bytes(path), max_side=max_side,
                                             jpeg_quality=90)
        T.image_example({"id": path, "path": path, "label": 0}, jpeg, hh, ww)
    return len(files) / (time.perf_counter() - t)


def beam_job(root: str, out: str, max_side: int, workers: int) -> tuple[float, dict]:
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    manifests = folder.run(["--input_dir", root, "--output_dir", out, "--max_side",
                            str(max_side), "--direct_running_mode", "multi_processing",
                            "--direct_num_workers", str(workers)])
    elapsed = time.perf_counter() - t
    return manifests["train"]["num_images"] / elapsed, manifests["train"]


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
    p.add_argument("--num_images", type=int, default=2000)
    p.add_argument("--num_classes", type=int, default=50)
    p.add_argument("--max_side", type=int, default=512)
    p.add_argument("--workers", default="1,2", help="DirectRunner worker counts to time")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--workdir", default=None, help="keep generated data here")
    p.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)

    work = args.workdir or tempfile.mkdtemp(prefix="tfaploss_bench_")
    root = os.path.join(work, "images")
    rows = []
    try:
        if not os.path.isdir(root):
            print(f"generating {args.num_images} 800x600 JPEGs in {root}", flush=True)
            generate(root, args.num_images, args.num_classes)
        print("plain Python loop...", flush=True)
        rate = plain_loop(root, args.max_side)
        rows.append(("plain Python loop (1 process)", "images/s", rate))
        manifest = None
        for workers in [int(w) for w in args.workers.split(",")]:
            print(f"folder job, DirectRunner multi_processing, {workers} worker(s)...",
                  flush=True)
            rate, manifest = beam_job(root, os.path.join(work, f"out{workers}"),
                                      args.max_side, workers)
            rows.append((f"folder job, DirectRunner, {workers} worker(s)", "images/s", rate))
        print("m_per_class input pipeline...", flush=True)
        last = os.path.join(work, f"out{args.workers.split(',')[-1]}", "train")
        bps = input_pipeline(last, args.batch_size, args.m, args.batches)
        name = f"m_per_class sampler, B={args.batch_size} (m={args.m}), 224x224 augmented"
        rows.append((name, "batches/s", bps))
        rows.append(("  same, in images", "images/s", bps * args.batch_size))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    width = max(len(r[0]) for r in rows)
    print(f"\n{args.num_images} images 800x600 -> --max_side {args.max_side}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'measurement'.ljust(width)}  {'value':>9}  unit")
    for name, unit, value in rows:
        print(f"{name.ljust(width)}  {value:9.2f}  {unit}")
    os.makedirs(args.results, exist_ok=True)
    result = {"args": vars(args), "cpus": os.cpu_count(), "machine": platform.platform(),
              "num_images_written": manifest["num_images"] if manifest else None,
              "rows": [{"measurement": n, "unit": u, "value": v} for n, u, v in rows]}
    with open(os.path.join(args.results, "pipeline.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
