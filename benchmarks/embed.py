"""Throughput of an exported SavedModel on JPEG bytes (the TF Serving path).

Builds a ResNet-50 embedding model with random weights (nothing is downloaded),
exports it with ``tfaploss.export.export_saved_model``, reloads it with
``tf.saved_model.load`` and times ``serving_default`` on batches of JPEG bytes (two
real 427x640 photos shipped with scikit-learn, repeated). To split the cost, it also
times the decode + resize + crop alone and the ``embed_pixels`` signature (the model
alone) on the same batch. Runs on the CPU and, where one is visible, on the GPU.

    python benchmarks/embed.py [--batch 32] [--repeats 5] [--image-size 224]
    python benchmarks/embed.py --quick     # small_cnn at 64², batch 8

Prints a table (wall-clock and process-CPU time per batch) and writes
``benchmarks/results/embed.json``; its figure per device is ``serving_default`` beside
its floor, the decode and the model timed apart (the signature is those two and
nothing else).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sklearn.datasets
import tensorflow as tf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import harness

from tfaploss import models
from tfaploss.export import decode_images, export_saved_model


def _time(fn, repeats):
    """Median wall seconds and median process CPU seconds (all threads) per call.

    On a shared machine the wall time depends on the other processes; the CPU time
    (images per CPU-second) is the figure that compares across loads.
    """
    cpus = []

    def call():
        start_cpu = time.process_time()
        fn()
        cpus.append(time.process_time() - start_cpu)

    def progress(i, wall):
        print(f"    run {i + 1}/{repeats}: {wall:.3f} s wall, {cpus[-1]:.3f} s CPU",
              flush=True)

    # one warm-up call: tracing, allocation, autotuning
    timing = harness.time_calls(call, repeats, on_call=progress)
    return timing.median, statistics.median(cpus[1:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--backbone", default="resnet50")
    parser.add_argument("--pooling", default="gem")
    parser.add_argument("--embedding-dim", type=int, default=512)
    harness.add_arguments(parser, harness.RESULTS_DIR / "embed.json",
                          quick_help="small_cnn at 64x64, batch 8",
                          tiny_help="small_cnn at 32x32, batch 4, 32-d, 3 repeats")
    args = parser.parse_args(argv)
    if args.tiny:
        args.quick, args.image_size, args.batch = True, 32, 4
        args.embedding_dim, args.repeats = 32, 3
    if args.quick:
        args.backbone = "small_cnn"
        if not args.tiny:
            args.image_size, args.batch = 64, 8

    size = (args.image_size, args.image_size)
    photos = Path(sklearn.datasets.__file__).parent / "images"
    jpegs = [(photos / name).read_bytes() for name in ("china.jpg", "flower.jpg")]
    batch_bytes = tf.constant([jpegs[i % 2] for i in range(args.batch)])

    print(f"building {args.backbone}/{args.pooling}/{args.embedding_dim} (random weights) "
          f"and exporting at {size} ...", flush=True)
    model = models.build_embedding_model(args.backbone, pooling=args.pooling,
                                         embedding_dim=args.embedding_dim,
                                         input_shape=(*size, 3))
    with tempfile.TemporaryDirectory() as tmp:
        version_dir = export_saved_model(model, Path(tmp) / "model", image_size=size)
        loaded = tf.saved_model.load(version_dir)
        serve_bytes = loaded.signatures["serving_default"]
        serve_pixels = loaded.signatures["embed_pixels"]
        decode = tf.function(lambda b: decode_images(b, size))

        devices = ["CPU:0"] + (["GPU:0"] if tf.config.list_physical_devices("GPU") else [])
        rows = []
        for device in devices:
            with tf.device(device):
                pixels = decode(batch_bytes)
                cases = {
                    "serving_default (JPEG bytes)": lambda: serve_bytes(
                        image_bytes=batch_bytes)["embedding"].numpy(),
                    "decode + resize + crop only": lambda: decode(batch_bytes).numpy(),
                    "embed_pixels (model only)": lambda pixels=pixels: serve_pixels(
                        images=pixels)["embedding"].numpy(),
                }
                for name, fn in cases.items():
                    print(f"  {device} {name}", flush=True)
                    seconds, cpu_seconds = _time(fn, args.repeats)
                    rows.append({"device": device, "case": name, "batch": args.batch,
                                 "seconds_per_batch": seconds,
                                 "images_per_second": args.batch / seconds,
                                 "cpu_seconds_per_batch": cpu_seconds,
                                 "images_per_cpu_second": args.batch / cpu_seconds})

    header = (f"{'device':<7} {'case':<30} {'batch':>5} {'s/batch':>9} {'images/s':>9} "
              f"{'CPU s/batch':>11} {'images/CPU-s':>12}")
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(f"{r['device']:<7} {r['case']:<30} {r['batch']:>5} "
              f"{r['seconds_per_batch']:>9.3f} {r['images_per_second']:>9.1f} "
              f"{r['cpu_seconds_per_batch']:>11.3f} {r['images_per_cpu_second']:>12.1f}")

    figures = []
    for device in dict.fromkeys(r["device"] for r in rows):
        cell = {r["case"]: r["seconds_per_batch"] for r in rows if r["device"] == device}
        figures.append(harness.figure(
            "embed", f"{device} serving_default, batch {args.batch}",
            cell["serving_default (JPEG bytes)"], "s",
            floor=cell["decode + resize + crop only"] + cell["embed_pixels (model only)"],
            floor_name="decode alone + model alone"))
    result = {
        "model": f"{args.backbone}/{args.pooling}/{args.embedding_dim}, random weights",
        "image_size": list(size),
        "input": "JPEG 427x640 (scikit-learn sample photos)",
        "repeats": args.repeats,
        "statistic": "median wall / process-CPU seconds per batch after one warm-up call",
        "tf_threads": {"intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
                       "inter_op": tf.config.threading.get_inter_op_parallelism_threads()},
        "cpu_count": os.cpu_count(),
        "load_average_1min_at_end": os.getloadavg()[0],
        "tensorflow": tf.__version__,
        "platform": platform.platform(),
        "rows": rows,
    }
    harness.write_results(args.out, "embed", args, figures, **result)
    return result


if __name__ == "__main__":
    main()
