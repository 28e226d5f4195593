"""Latency and memory of the exported ``retrieve`` signature, per index size, on the CPU.

For each index size N (synthetic unit-norm embeddings, N x 128, keys like
``img/0001234.jpg``), a small embedding model (16x16 pixels -> 128-d, so that the
search dominates) is exported with the index (``tfaploss.export.export_saved_model``,
brute force, float32). A fresh process then loads the version with
``tf.saved_model.load`` only, as a server would, and times, for batch 1 and batch 32:

* ``retrieve_pixels`` (pixels in, keys out) and ``retrieve`` (PNG bytes in);
* beside them, the floor: the bare ``tf.matmul`` + ``tf.math.top_k`` of the same size on
  the same variable, in the same process (what no exact search can beat), and
  ``embed_pixels`` (the model alone, which ``retrieve_pixels`` runs first);
* the bare bfloat16 product + top_k of the same size (a bfloat16 index with float32
  re-scoring of candidates costs at least this, so it can only pay where this is
  clearly below the float32 floor).

Memory (resident set, from /proc): after ``import tensorflow``, after loading the
version and one request of each kind, and the peak (loading included); the process
serving an export without an index is the baseline, so "index memory" is what the
index costs a server, beside its raw size (rows + keys + labels).

    nice python benchmarks/serving.py                    # 10k, 100k, 1M x 128
    nice python benchmarks/serving.py --quick            # 10k, 100k; 3 repeats
    nice python benchmarks/serving.py --sizes 50000 --batches 1,8

Writes ``benchmarks/results/serving.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import harness

IMAGE = 16
DIM_DEFAULT = 128


def _export(folder: Path, size: int, dim: int, k: int) -> str:
    """Export the small model with ``size`` synthetic rows (0: no index)."""
    import keras
    import numpy as np

    from tfaploss.export import RetrievalIndex, export_saved_model, model_fingerprint

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((IMAGE, IMAGE, 3)), keras.layers.Flatten(),
                              keras.layers.Dense(dim)])
    index = None
    if size:
        rng = np.random.default_rng(0)
        rows = rng.standard_normal((size, dim), dtype=np.float32)
        rows /= np.linalg.norm(rows, axis=1, keepdims=True)
        keys = np.char.add("img/", np.char.zfill(np.arange(size).astype(str), 7))
        index = RetrievalIndex(rows, np.char.add(keys, ".jpg"), np.arange(size) % 1000,
                               model_fingerprint(model), source=f"synthetic {size}x{dim}")
    return export_saved_model(model, folder, image_size=(IMAGE, IMAGE), index=index, k=k)


def _peak() -> float:
    # VmHWM of this process's own memory map: getrusage's ru_maxrss survives exec, so in a
    # child it would report the parent's resident set at the fork (the 1M export's GBs).
    return harness.peak_rss_gb(os.getpid())


def _child(version: str, batches: list[int], k: int, repeats: int, indexed: bool) -> dict:
    """Runs in a fresh process: load, memory, timings."""
    import tensorflow as tf

    out = {"rss_import_gb": harness.rss_gb()}
    loaded = tf.saved_model.load(version)
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    pixels = rng.uniform(0, 255, (max(batches), IMAGE, IMAGE, 3)).astype("float32")
    pngs = []
    for image in pixels.astype(np.uint8):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    signatures = loaded.signatures
    if not indexed:
        signatures["serving_default"](image_bytes=tf.constant(pngs[:1]))
        out.update(rss_loaded_gb=harness.rss_gb(), peak_gb=_peak())
        return out
    kk = tf.constant(k)
    signatures["retrieve"](image_bytes=tf.constant(pngs[:1]), k=kk)
    signatures["retrieve_pixels"](images=tf.constant(pixels[:1]), k=kk)
    out.update(rss_loaded_gb=harness.rss_gb(), peak_load_gb=_peak())

    index = loaded.retrieval_index[0]  # the served variable itself: no copy

    @tf.function
    def floor(q):
        return tf.math.top_k(tf.matmul(q, index, transpose_b=True), k=k)

    queries = tf.random.normal([max(batches), index.shape[1]])
    rows = {}
    for batch in batches:
        px, by = tf.constant(pixels[:batch]), tf.constant(pngs[:batch])
        q = queries[:batch]
        runs = {
            "retrieve_pixels": lambda px=px: signatures["retrieve_pixels"](
                images=px, k=kk)["keys"].numpy(),
            "retrieve": lambda by=by: signatures["retrieve"](
                image_bytes=by, k=kk)["keys"].numpy(),
            "floor": lambda q=q: floor(q)[1].numpy(),
            "embed_pixels": lambda px=px: signatures["embed_pixels"](
                images=px)["embedding"].numpy(),
        }
        rows[batch] = {name: harness.time_calls(fn, repeats).as_dict()
                       for name, fn in runs.items()}
    out["peak_gb"] = _peak()
    # After the memory figures: the bfloat16 copy is not part of the served model.
    index16 = tf.cast(index, tf.bfloat16)

    @tf.function
    def floor16(q):
        return tf.math.top_k(tf.cast(tf.matmul(q, index16, transpose_b=True), tf.float32),
                             k=k)

    for batch in batches:
        q16 = tf.cast(queries[:batch], tf.bfloat16)
        rows[batch]["floor_bfloat16"] = harness.time_calls(
            lambda q16=q16: floor16(q16)[1].numpy(), max(2, repeats // 2)).as_dict()
    out["timings"] = rows
    return out


def _run_child(version: str, args, indexed: bool) -> dict:
    argv = [sys.executable, __file__, "--child", version, "--batches", args.batches,
            "--k", str(args.k), "--repeats", str(args.repeats)]
    if not indexed:
        argv.append("--no-index")
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--dim", type=int, default=DIM_DEFAULT)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-index", action="store_true", help=argparse.SUPPRESS)
    harness.add_arguments(parser, harness.RESULTS_DIR / "serving.json",
                          quick_help="10k and 100k x 128, 3 repeats",
                          tiny_help="2,000 x 16, 2 repeats")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(_child(args.child, batches, args.k, args.repeats,
                                not args.no_index)))
        return 0
    if args.tiny:
        args.sizes, args.dim, args.repeats = "2000", 16, 2
    elif args.quick:
        args.sizes, args.repeats = "10000,100000", 3
    sizes = [int(s) for s in args.sizes.split(",")]

    work = Path(tempfile.mkdtemp(prefix="tfaploss-serving-"))
    figures, results = [], {}
    try:
        print(f"baseline: the same model exported without an index ({args.dim}-d)",
              flush=True)
        base = _run_child(_export(work / "none", 0, args.dim, args.k), args, indexed=False)
        results["baseline"] = base
        print(f"  resident after import {base['rss_import_gb']:.3f} GB, after load "
              f"{base['rss_loaded_gb']:.3f} GB, peak {base['peak_gb']:.3f} GB")
        header = (f"{'index':>10} {'batch':>5} {'retrieve_pixels ms':>19} "
                  f"{'retrieve ms':>12} {'floor f32 ms':>13} {'ratio':>6} "
                  f"{'model alone ms':>15} {'floor bf16 ms':>14}")
        for size in sizes:
            print(f"\nindex {size} x {args.dim}: exporting", flush=True)
            version = _export(work / str(size), size, args.dim, args.k)
            raw = size * args.dim * 4 + size * (len("img/0000000.jpg") + 8)
            out = _run_child(version, args, indexed=True)
            shutil.rmtree(work / str(size), ignore_errors=True)
            results[size] = out
            held = out["rss_loaded_gb"] - base["rss_loaded_gb"]
            peak = out["peak_gb"] - base["rss_import_gb"]
            print(f"  memory: index held {held:.3f} GB (raw rows + keys + labels "
                  f"{raw / 2**30:.3f} GB), peak above import {peak:.3f} GB, resident "
                  f"{out['rss_loaded_gb']:.3f} GB")
            print(header)
            for batch in batches:
                row = out["timings"][str(batch)]
                med = {name: t["median_s"] for name, t in row.items()}
                print(f"{size:>10} {batch:>5} {_ms(med['retrieve_pixels']):>19} "
                      f"{_ms(med['retrieve']):>12} {_ms(med['floor']):>13} "
                      f"{med['retrieve_pixels'] / med['floor']:>6.2f} "
                      f"{_ms(med['embed_pixels']):>15} {_ms(med['floor_bfloat16']):>14}")
                name = f"{size}x{args.dim} batch {batch}"
                figures += [
                    harness.figure("serving", f"retrieve_pixels {name}",
                                   med["retrieve_pixels"], "s", floor=med["floor"],
                                   floor_name="bare f32 matmul + top_k"),
                    harness.figure("serving", f"bf16 product {name}",
                                   med["floor_bfloat16"], "s", floor=med["floor"],
                                   floor_name="bare f32 matmul + top_k", peer=True),
                ]
            figures.append(harness.figure(
                "serving", f"index memory {size}x{args.dim}", held, "GB",
                floor=raw / 2**30, floor_name="raw rows + keys + labels"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = harness.write_results(args.out, "serving", args, figures, results=results)
    print()
    print(harness.summary_table(figures))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
