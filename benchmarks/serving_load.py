"""Serving under concurrent load: the ``serving_default`` signature (``image_bytes``)
called by 1, 4 and 16 threads at once, every request at the per-request pixel budget.

The export takes ``max_pixels`` per image (``--max-pixels``, default 1 MP) and the
default request budget, ``max_request_pixels`` = 4 x ``max_pixels``; every request
holds 4 noisy JPEGs of ``max_pixels`` each, so it costs the most the budget allows.
Each concurrency level runs in a fresh process (a process's allocator keeps what an
earlier level freed, which would hide the next level's growth), which:

1. loads the SavedModel and calls it once on 4 tiny images: ``loaded``, its resident
   memory after that call (the model, and the kernels and thread pools the first call
   starts), and ``forward``, what the call held at its peak beyond that (the forward
   pass's activations);
2. starts C caller threads, each sending its requests back to back, while one more
   thread sends refused requests (a PNG header declaring 100 MP, and 5 images at the
   limit: over ``max_request_pixels``) every 50 ms;
3. samples its resident memory every millisecond throughout.

Printed per level, beside the figure each is measured against in the same run:

* peak RSS above ``loaded`` against the bound docs/serving.md states,
  ``C x (DECODE_BYTES_PER_PIXEL x max_request_pixels + REQUEST_OVERHEAD_BYTES +
  forward)`` (:mod:`tfaploss.export.image_ops`: 20 bytes a pixel, 8 MB a request);
* the median and 95th-percentile latency against the 1-caller median (the floor);
  requests per second against C x the 1-caller rate (what perfect scaling gives);
* the refused requests: how many, their median latency against the accepted requests'
  (refused before decoding: a fraction of it), and that each said so.

    python benchmarks/serving_load.py            # 1, 4 and 16 callers, ~2-3 minutes
    python benchmarks/serving_load.py --quick    # fewer requests
    python benchmarks/serving_load.py --callers 4 --max-pixels 262144 --quick
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


class Peak:
    """The largest RSS while running (a sampling thread, every millisecond)."""

    def __init__(self):
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def noisy_jpeg(side: int, seed: int) -> bytes:
    """A ``side x side`` JPEG of noise (the slowest content to decode)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A 100 KB-class PNG whose header declares ``width x height`` (grey)."""
    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * (1 << 16), 9)) + chunk(b"IEND", b""))


# ------------------------------------------------------------------------ one level


def run_level(export: str, callers: int, requests: int, max_pixels: int,
              images: int) -> dict:
    """One concurrency level, in this (fresh) process: the figures of the docstring."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from tfaploss.export.image_ops import DECODE_BYTES_PER_PIXEL, REQUEST_OVERHEAD_BYTES

    side = int(max_pixels ** 0.5)
    budget = [noisy_jpeg(side, seed) for seed in range(images)]
    tiny = [noisy_jpeg(16, seed) for seed in range(images)]
    bomb = [png_declaring(10_000, 10_000)]
    too_many = [budget[0]] * (images + 1)

    started = _rss()
    fn = tf.saved_model.load(export).signatures["serving_default"]
    with Peak() as first:  # the first call: kernels and thread pools start, and stay
        fn(image_bytes=tf.constant(tiny))
    loaded = _rss()
    forward = max(0, first.peak - loaded)  # what the call held and gave back

    latencies, refusals, failures = [], [], []
    lock = threading.Lock()
    done = threading.Event()

    def caller():
        for _ in range(requests):
            t0 = time.perf_counter()
            try:
                out = fn(image_bytes=tf.constant(budget))["embedding"]
                assert out.shape[0] == images
            except Exception as err:  # noqa: BLE001 - a figure: any failure is counted
                with lock:
                    failures.append(f"{type(err).__name__}: {str(err)[:200]}")
                continue
            with lock:
                latencies.append(time.perf_counter() - t0)

    def refuser():
        k = 0
        while not done.is_set():
            request = bomb if k % 2 == 0 else too_many
            t0 = time.perf_counter()
            try:
                fn(image_bytes=tf.constant(request))
                outcome = "accepted"
            except tf.errors.InvalidArgumentError as err:
                outcome = ("before decoding" if "nothing was decoded" in err.message
                           or "] [declare]" in err.message else err.message[:120])
            with lock:
                refusals.append((time.perf_counter() - t0, outcome))
            k += 1
            done.wait(0.05)

    threads = [threading.Thread(target=caller) for _ in range(callers)]
    refusing = threading.Thread(target=refuser)
    with Peak() as peak:
        t0 = time.perf_counter()
        refusing.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        done.set()
        refusing.join()
    request_bytes = DECODE_BYTES_PER_PIXEL * images * side * side + REQUEST_OVERHEAD_BYTES
    return {
        "callers": callers, "requests": len(latencies), "failures": failures,
        "wall_s": wall, "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_p95_s": (sorted(latencies)[max(0, int(0.95 * len(latencies)) - 1)]
                          if latencies else None),
        "requests_per_s": len(latencies) / wall,
        "loaded_mb": loaded / MB, "import_mb": started / MB, "forward_mb": forward / MB,
        "request_budget_pixels": images * side * side, "request_bound_mb": request_bytes / MB,
        "peak_growth_mb": (peak.peak - loaded) / MB,
        "bound_mb": callers * (request_bytes + forward) / MB,
        "held_after_mb": (_rss() - loaded) / MB,
        "refused": sum(1 for _, o in refusals if o == "before decoding"),
        "refusals": len(refusals),
        "refusal_outcomes": sorted({o for _, o in refusals}),
        "refusal_p50_s": statistics.median([t for t, _ in refusals]) if refusals else None,
    }


# ------------------------------------------------------------------------ the driver


def export_model(folder: str, image_size: int, max_pixels: int) -> str:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    from tfaploss import models
    from tfaploss.export import export_saved_model

    keras.utils.set_random_seed(0)
    model = models.build_embedding_model("small_cnn", pooling="gem", embedding_dim=64,
                                         input_shape=(image_size, image_size, 3))
    return export_saved_model(model, os.path.join(folder, "model"),
                              image_size=(image_size, image_size), max_pixels=max_pixels)


def _child(export, callers, requests, max_pixels, images) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "level.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--level", str(callers),
               "--export", export, "--requests", str(requests), "--max-pixels",
               str(max_pixels), "--images", str(images), "--level-out", out]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            # A level that died (the OOM killer's SIGKILL is -9) is itself a figure.
            return {"callers": callers, "exit": proc.returncode,
                    "error": proc.stderr.strip().splitlines()[-1:] or ["no output"]}
        with open(out, encoding="utf-8") as f:
            return {**json.load(f), "exit": 0}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_arguments(parser, harness.RESULTS_DIR / "serving_load.json")
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 4, 16],
                        help="concurrency levels (1 is always run: the floor)")
    parser.add_argument("--max-pixels", type=int, default=1 << 20,
                        help="the export's max_pixels; requests hold 4 images of it")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--requests", type=int, default=32,
                        help="requests per level, shared by its callers (at least 2 each)")
    parser.add_argument("--level", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--export", help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--level-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.level is not None:  # a child: one level
        result = run_level(args.export, args.level, args.requests, args.max_pixels,
                           args.images)
        harness.write_json(args.level_out, result)
        return result
    if args.quick:
        args.requests = min(args.requests, 12)
    if args.tiny:
        args.requests, args.max_pixels, args.image_size = 4, 1 << 16, 32
    from tfaploss.export.image_ops import REQUEST_PIXELS_PER_MAX_PIXELS

    images = REQUEST_PIXELS_PER_MAX_PIXELS
    levels = sorted({1, *args.callers})
    with tempfile.TemporaryDirectory() as tmp:
        export = export_model(tmp, args.image_size, args.max_pixels)
        rows = [_child(export, c, max(2, args.requests // c), args.max_pixels, images)
                for c in levels]
    figures = _figures(rows)
    print(_table(rows))
    print(harness.summary_table(figures))
    harness.write_results(args.out, "serving_load", args, figures, rows=rows)
    return {"rows": rows, "figures": figures}


def _figures(rows: list[dict]) -> list[dict]:
    floor = next(r for r in rows if r["callers"] == 1)
    figures = []
    for r in rows:
        if r.get("exit"):
            figures.append(harness.figure("serving_load", f"{r['callers']} callers", None,
                                          "MB", note=f"level died: exit {r['exit']}"))
            continue
        c = r["callers"]
        figures += [
            harness.figure("serving_load", f"{c} callers: peak RSS growth",
                           r["peak_growth_mb"], "MB", floor=r["bound_mb"],
                           floor_name=f"bound {c} x (20 B x request pixels + 8 MB + forward)",
                           note="held" if r["peak_growth_mb"] <= r["bound_mb"] else "OVER"),
            harness.figure("serving_load", f"{c} callers: median latency",
                           r["latency_p50_s"], "s", floor=floor["latency_p50_s"],
                           floor_name="1-caller median"),
            harness.figure("serving_load", f"{c} callers: throughput", r["requests_per_s"],
                           "requests/s", floor=c * floor["requests_per_s"],
                           floor_name=f"{c} x the 1-caller rate", higher_is_better=True),
            harness.figure("serving_load", f"{c} callers: refusal latency",
                           r["refusal_p50_s"], "s", floor=r["latency_p50_s"],
                           floor_name="an accepted request's median",
                           note=f"{r['refused']}/{r['refusals']} refused before decoding"),
        ]
    return figures


def _table(rows: list[dict]) -> str:
    head = (f"{'callers':>7} {'requests':>8} {'p50 s':>7} {'p95 s':>7} {'x floor':>7} "
            f"{'req/s':>6} {'peak +MB':>9} {'bound MB':>9} {'held':>5} {'refused':>9} "
            f"{'refusal s':>9} {'kept +MB':>8}")
    lines = [head]
    floor = next((r for r in rows if r["callers"] == 1 and not r.get("exit")), None)
    for r in rows:
        if r.get("exit"):
            lines.append(f"{r['callers']:>7} died: exit {r['exit']} {r.get('error')}")
            continue
        ratio = r["latency_p50_s"] / floor["latency_p50_s"] if floor else float("nan")
        lines.append(
            f"{r['callers']:>7} {r['requests']:>8} {r['latency_p50_s']:>7.3f} "
            f"{r['latency_p95_s']:>7.3f} {ratio:>7.2f} {r['requests_per_s']:>6.2f} "
            f"{r['peak_growth_mb']:>9.0f} {r['bound_mb']:>9.0f} "
            f"{'yes' if r['peak_growth_mb'] <= r['bound_mb'] else 'NO':>5} "
            f"{r['refused']:>4}/{r['refusals']:<4} {r['refusal_p50_s'] or 0:>9.3f} "
            f"{r['held_after_mb']:>8.0f}")
        if r["failures"]:
            lines.append(f"        failures: {r['failures'][:3]}")
    r0 = rows[0]
    lines.append(f"loaded model: {r0.get('loaded_mb', 0):.0f} MB resident "
                 f"({r0.get('import_mb', 0):.0f} MB before loading); one forward pass "
                 f"+{r0.get('forward_mb', 0):.0f} MB; a request at the budget: "
                 f"{r0.get('request_budget_pixels', 0):,} pixels, bound "
                 f"{r0.get('request_bound_mb', 0):.0f} MB")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
