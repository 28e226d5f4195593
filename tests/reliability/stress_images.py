"""Stress: images whose headers lie, through the serving signature and
through a job: the worst time and the peak memory each can provoke.

Inputs: every crafted input of :mod:`tests.reliability.hostile_images` in its ~1 MB variant (frame
headers hidden in JPEG segments, floods of tiny segments, BMP/PNG/GIF/WebP headers that
disagree with their data), plus the inputs that cost the most *within* the limits:

* a PNG and a GIF of 40 MP (the serving limit) that compress to kilobytes;
* a progressive JPEG of 40 MP at the scan caps (25 scans: scans x pixels = 1e9), and a
  progressive CMYK one without subsampling (libjpeg keeps every coefficient of a
  progressive image: 2 bytes x 4 components per pixel);
* a PNG of 1000x1000 whose deflate stream goes on past the image for 1 GB (libpng,
  in TensorFlow, inflates a stream to its end; PIL stops at the image);
* a JPEG and a PNG of 88 MP, under the jobs' limit (100 MP; PIL's own bomb check
  stops at 89 MP).

Each input goes, one at a time, through

1. **serving**: ``serving_default`` of an exported SavedModel (224x224, a pooling
   model: the preprocessing is the real one) in a fresh process; limit: 40 MP;
2. **job**: ``tfaploss.pipelines.images.process_image_bytes`` with the folder job's settings
   (``--max_side 512``, ``--max_pixels`` 100 MP) in a fresh process;

and the whole set through one **folder job** (``python -m tfaploss.pipelines.folder``) whose
dead letters must hold every refused input with its reason.

Peak RSS is sampled every millisecond from ``/proc/self/statm`` while an input is in
flight; ``+MB`` is the peak above the process's RSS just before it. Prints a table and
writes ``benchmarks/results/hostile_images.json``.

    python tests/reliability/stress_images.py           # ~1 MB inputs + the at-limit ones
    python tests/reliability/stress_images.py --quick   # the small test inputs only
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import re
import resource
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

SERVING_LIMIT = 40_000_000
JOB_LIMIT = 100_000_000
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Peak:
    """The largest RSS seen while the block runs (a sampling thread, 1 ms)."""

    def __enter__(self):
        self.before = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


# ------------------------------------------------------------------------ the inputs

def _at_limit_inputs() -> list[tuple[str, bytes]]:
    from PIL import Image

    out = []
    side = 6324  # 6324² = 39.99 MP
    buffer = io.BytesIO()
    Image.new("L", (side, side), 90).save(buffer, "PNG", compress_level=9)
    out.append((f"PNG: {side}x{side} gray, 40 MP (the serving limit)", buffer.getvalue()))
    half = 4471  # screen + frame: 2 x 4471² = 39.98 MP as the serving walk counts them
    buffer = io.BytesIO()
    Image.new("P", (half, half), 1).save(buffer, "GIF")
    out.append((f"GIF: {half}x{half} screen and frame (40 MP counted)", buffer.getvalue()))
    out.append((f"JPEG: progressive {side}x{side}, 25 scans (the scan caps)",
                _scans(side, 25)))
    buffer = io.BytesIO()
    Image.new("CMYK", (side, side), (10, 20, 30, 40)).save(buffer, "JPEG", progressive=True,
                                                          subsampling=0)
    out.append((f"JPEG: progressive CMYK 4:4:4:4 {side}x{side} (40 MP)", buffer.getvalue()))
    out.append(("PNG: 1000x1000 RGB, stream inflating 1 GB past the image",
                _png_padded(1000, 1000, 1 << 30)))
    big = 9400  # 88.4 MP: under the jobs' 100 MP and PIL's 89.5 MP
    out.append((f"JPEG: progressive {big}x{big}, 11 scans (88 MP, jobs' limit)",
                _scans(big, 11)))
    buffer = io.BytesIO()
    Image.new("L", (big, big), 90).save(buffer, "PNG", compress_level=9)
    out.append((f"PNG: {big}x{big} gray (88 MP, jobs' limit)", buffer.getvalue()))
    return out


def _scans(side: int, total: int) -> bytes:
    from tests.reliability import hostile_images as H

    data = H.repeated_scans(side, side, total - 10)  # libjpeg's progression: 10 scans
    assert data.count(b"\xff\xda") == total
    return data


def _png_padded(width: int, height: int, extra: int) -> bytes:
    from tests.reliability import hostile_images as H

    packer = zlib.compressobj(9)
    parts = [packer.compress(b"\0" * (height * (1 + 3 * width)))]
    block = b"\0" * (1 << 24)
    parts += [packer.compress(block) for _ in range(extra // len(block))]
    parts.append(packer.flush())
    return H.png(H.chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)),
                 H.chunk(b"IDAT", b"".join(parts)))


def write_inputs(folder: str, quick: bool) -> list[dict]:
    from tests.reliability import hostile_images as H

    inputs = [(c.name, c.data) for c in H.cases(big=not quick)]
    if not quick:
        inputs += _at_limit_inputs()
    out = []
    for i, (name, data) in enumerate(inputs):
        ext = {"JPEG": "jpg", "BMP": "bmp", "PNG": "png", "APNG": "png", "GIF": "gif",
               "WebP": "webp"}[name.split(":")[0]]
        path = os.path.join(folder, "hostile", f"{i:03d}.{ext}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        out.append({"name": name, "path": path, "bytes": len(data)})
    return out


# ------------------------------------------------------------- the two interfaces

def _short(message: str) -> str:
    found = re.search(r"(declare|decode to)\W+(\d+)", message)
    if found:
        return f"refused: {found.group(1)} {int(found.group(2)):,} px"
    if "could not decode" in message:
        return "refused: could not decode"
    return "refused: " + " ".join(message.split())[:60]


def measure_serving(inputs: list[dict]) -> list[dict]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    from tfaploss.export import export_saved_model

    model = keras.Sequential([keras.Input((224, 224, 3)), keras.layers.GlobalAveragePooling2D()])
    with tempfile.TemporaryDirectory() as tmp:
        version = export_saved_model(model, os.path.join(tmp, "m"), image_size=(224, 224),
                                     max_pixels=SERVING_LIMIT)
        fn = tf.saved_model.load(version).signatures["serving_default"]
        from tests.reliability import hostile_images as H
        good = H.encode("JPEG", 640, 427)
        for _ in range(3):
            fn(image_bytes=tf.constant([good]))
        def serve(data):
            try:
                fn(image_bytes=tf.constant([data]))
                return "decoded"
            except tf.errors.InvalidArgumentError as e:
                return _short(e.message)

        return _measure(inputs, serve)


def measure_job(inputs: list[dict]) -> list[dict]:
    from tfaploss.pipelines import images as I

    def process(data):
        try:
            I.process_image_bytes(data, max_side=512, max_pixels=JOB_LIMIT)
            return "decoded"
        except I.ImageError as e:
            return f"dead letter: {e.code}"

    return _measure(inputs, process)


def _measure(inputs: list[dict], outcome_of) -> list[dict]:
    """Each input file through ``outcome_of(bytes) -> str``: its outcome, seconds and
    peak memory."""
    rows = []
    for item in inputs:
        with open(item["path"], "rb") as f:
            data = f.read()
        start = time.perf_counter()
        with Peak() as peak:
            outcome = outcome_of(data)
        rows.append({**item, "outcome": outcome, "seconds": time.perf_counter() - start,
                     "peak_rss_mb": peak.peak / 2**20,
                     "over_idle_mb": (peak.peak - peak.before) / 2**20})
    return rows


def _run_folder_job(root: str, out: str, report: str) -> None:
    """In a process of its own, so that its largest child is the job (or one of its
    image processes, which the job waits for)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "tfaploss.pipelines.folder", "--input_dir", root, "--output_dir", out,
         "--max_side", "512", "--max_failure_fraction", "1"],
        cwd=REPO, capture_output=True, text=True, check=False)
    with open(report, "w") as f:
        json.dump({"returncode": proc.returncode, "seconds": time.perf_counter() - start,
                   "maxrss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                   "stderr": proc.stderr[-2000:]}, f)


def folder_job(root: str, inputs: list[dict]) -> dict:
    out = os.path.join(os.path.dirname(root), "out")
    report = os.path.join(os.path.dirname(root), "folder.json")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "folder",
                    "--inputs", root, "--out", report], check=True, cwd=REPO)
    with open(report) as f:
        run = json.load(f)
    dead = {}
    path = os.path.join(out, "train", "dead_letters.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                entry = json.loads(line)
                dead[entry["path"]] = entry
    letters = {}
    for item in inputs:
        rel = os.path.relpath(item["path"], root)
        if rel in dead:
            letters[item["name"]] = f"{dead[rel]['reason']}: {dead[rel]['detail'][:70]}"
    return {"returncode": run["returncode"], "seconds": run["seconds"],
            "peak_rss_mb": run["maxrss_kb"] / 1024, "dead_letters": letters,
            "stderr_tail": run["stderr"]}


# --------------------------------------------------------------------------- main

def _child(mode: str, inputs_json: str, out_json: str) -> None:
    if mode == "folder":
        _run_folder_job(inputs_json, os.path.join(os.path.dirname(inputs_json), "out"), out_json)
        return
    with open(inputs_json) as f:
        inputs = json.load(f)
    rows = measure_serving(inputs) if mode == "serving" else measure_job(inputs)
    with open(out_json, "w") as f:
        json.dump(rows, f)


def _table(title: str, rows: list[dict], limit: str) -> None:
    print(f"\n{title}")
    print(f"{'input class':64s} {'bytes':>9s}  {'outcome':34s} {'seconds':>8s} "
          f"{'peak RSS MB':>11s} {'+MB':>7s}  limit")
    for r in rows:
        print(f"{r['name'][:64]:64s} {r['bytes']:9d}  {r['outcome'][:34]:34s} "
              f"{r['seconds']:8.3f} {r['peak_rss_mb']:11.0f} {r['over_idle_mb']:7.0f}  {limit}")
    worst_t = max(rows, key=lambda r: r["seconds"])
    worst_m = max(rows, key=lambda r: r["over_idle_mb"])
    print(f"worst time: {worst_t['seconds']:.2f} s ({worst_t['name']}); worst memory: "
          f"+{worst_m['over_idle_mb']:.0f} MB ({worst_m['name']})")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small test inputs only")
    parser.add_argument("--skip_folder_job", action="store_true")
    parser.add_argument("--child", choices=["serving", "job", "folder"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--inputs", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.inputs, args.out)
        return {}

    with tempfile.TemporaryDirectory(prefix="hostile-images-") as tmp:
        root = os.path.join(tmp, "in")
        inputs = write_inputs(root, args.quick)
        # a class of good images beside the hostile ones, for the folder job
        from tests.reliability import hostile_images as H
        os.makedirs(os.path.join(root, "good"))
        for k in range(3):
            with open(os.path.join(root, "good", f"{k}.jpg"), "wb") as f:
                f.write(H.encode("JPEG", 320, 240, seed=k))
        listing = os.path.join(tmp, "inputs.json")
        with open(listing, "w") as f:
            json.dump(inputs, f)
        results = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load "
                              f"{os.getloadavg()[0]:.1f} at the start",
                   "serving_limit_pixels": SERVING_LIMIT, "job_limit_pixels": JOB_LIMIT}
        for mode in ("serving", "job"):
            out = os.path.join(tmp, f"{mode}.json")
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2"}
            subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode,
                            "--inputs", listing, "--out", out], check=True, env=env, cwd=REPO)
            with open(out) as f:
                results[mode] = json.load(f)
        if not args.skip_folder_job:
            results["folder_job"] = folder_job(root, inputs)

    for row in results["serving"] + results["job"]:
        row.pop("path", None)
    _table("serving_default (SavedModel, 224x224)", results["serving"], "40 MP")
    _table("job: process_image_bytes (--max_side 512)", results["job"], "100 MP")
    job = results.get("folder_job")
    if job:
        print(f"\nfolder job over all {len(inputs)} inputs + 3 good images: exit "
              f"{job['returncode']}, {job['seconds']:.1f} s, peak RSS {job['peak_rss_mb']:.0f} "
              f"MB (job and image processes), {len(job['dead_letters'])} dead letters")
        for name, letter in job["dead_letters"].items():
            print(f"  {name[:60]:60s} {letter}")
    os.makedirs(os.path.join(REPO, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(REPO, "benchmarks", "results", "hostile_images.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
