"""Transforms shared by every preprocessing job, and the job runner itself.

Plan in the driver, process in the workers: each job reads its annotation files in the
driver (cheap: ids, paths and labels only), remaps labels, finds duplicate ids and rows
that point nowhere, and writes the split's work list as JSON lines next to the output.
The Beam pipeline then reads that list (so its size never bloats the job graph, even
for GLDv2's 4.1 M rows on Dataflow) and, per image::

    read bytes -> decode and validate (RGB, EXIF orientation, size sanity)
      -> optional crop to a box -> optional resize (longer side <= --max_side)
      -> JPEG re-encode (--jpeg_quality) -> tf.train.Example

Examples go to ``<split>/images-SSSSS-of-NNNNN.tfrecord`` through ``WriteToTFRecord``;
train splits also get ``<split>/by_class/`` (one record per chunk of one class, see
:mod:`pipelines`). Anything that fails goes to a dead-letter output with its id, path
and reason; the driver merges those with its own (duplicates, bad rows), writes
``manifest.json`` and ``dead_letters.jsonl`` per split, and raises
:class:`TooManyFailuresError` when a split's failure fraction exceeds
``--max_failure_fraction``.

The Example protos are serialised by hand (:func:`serialize_example`, a few lines of
protobuf wire format) so that workers never import TensorFlow: it costs seconds per
worker process and nothing here needs it. Encoding is deterministic (sorted keys,
deterministic JPEG encoder), so re-running a job on the same input gives the same
records.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import math
import os
import struct
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
from PIL import Image, ImageFile, ImageOps

LOG = logging.getLogger("pipelines")

SCHEMA_VERSION = 1

IMAGE_FEATURES = {
    "image/encoded": ("bytes", "JPEG, RGB, EXIF orientation applied, resized to --max_side"),
    "image/format": ("bytes", "b'jpeg'"),
    "image/id": ("bytes", "dataset image id, unique within the split"),
    "image/path": ("bytes", "source path relative to --input_dir"),
    "image/index": ("int64", "position in the split's sorted listing (imlist index)"),
    "image/height": ("int64", "height of the encoded image"),
    "image/width": ("int64", "width of the encoded image"),
    "image/class/label": ("int64", "class label, contiguous 0..C-1 per split; -1 none"),
    "image/class/super_label": ("int64", "super-class label 0..S-1; -1 none"),
    "image/class/text": ("bytes", "class as the dataset names it"),
    "image/bbox": ("float[4]", "x0, y0, x1, y1 in source pixels (cropped images only)"),
}

CLASS_FEATURES = {
    "class/label": ("int64", "class label"),
    "class/super_label": ("int64", "super-class label; -1 none"),
    "class/num_images": ("int64", "images in the whole class"),
    "class/chunk": ("int64", "chunk index within the class"),
    "class/num_chunks": ("int64", "chunks of this class"),
    "image/encoded": ("bytes[N]", "the chunk's JPEGs"),
    "image/id": ("bytes[N]", "their ids"),
}

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")

# Failure codes used in dead letters and counted in the manifest.
MISSING_FILE = "missing_file"
EMPTY_FILE = "empty_file"
TRUNCATED = "truncated"
UNDECODABLE = "undecodable"
TOO_SMALL = "too_small"
TOO_LARGE = "too_large"
BAD_BOX = "bad_box"
DUPLICATE_ID = "duplicate_id"
BAD_ANNOTATION = "bad_annotation"


class TooManyFailuresError(RuntimeError):
    """A split's failure fraction exceeded ``--max_failure_fraction``.

    The outputs and manifests were written; ``manifests`` holds them.
    """

    def __init__(self, message: str, manifests: dict):
        super().__init__(message)
        self.manifests = manifests


class ImageError(Exception):
    """An input image that cannot be used; ``code`` is one of the failure codes."""

    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


# ----------------------------------------------------------------------------- images


def read_bytes(path: str) -> bytes:
    """Read a whole file from a local path or any Beam filesystem URL."""
    try:
        if "://" not in path:
            with open(path, "rb") as f:
                return f.read()
        from apache_beam.io.filesystem import CompressionTypes
        from apache_beam.io.filesystems import FileSystems

        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
        raise ImageError(MISSING_FILE, f"cannot read {path}: {e}") from e
    except OSError as e:
        # Beam filesystems raise their own IOError subclasses for missing objects.
        raise ImageError(MISSING_FILE, f"cannot read {path}: {e}") from e


def decode_image(data: bytes, *, min_side: int = 1, max_pixels: int = 100_000_000,
                 draft_side: int = 0) -> Image.Image:
    """Decode ``data`` into an RGB PIL image with its EXIF orientation applied.

    Grayscale, CMYK, palette, 16-bit and alpha images are converted to RGB (alpha is
    composited on white, as a viewer shows it). ``draft_side`` > 0 lets the JPEG decoder
    scale down by a power of two while staying at least that large (much faster when the
    image is resized afterwards anyway). Raises :class:`ImageError`.
    """
    if not data:
        raise ImageError(EMPTY_FILE, "file is empty (0 bytes)")
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > max_pixels:
                raise ImageError(TOO_LARGE, f"{w}x{h} has more than --max_pixels={max_pixels}")
            if draft_side and img.format == "JPEG" and max(w, h) > draft_side:
                scale = draft_side / max(w, h)
                img.draft("RGB", (max(1, math.ceil(w * scale)), max(1, math.ceil(h * scale))))
            img.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(TOO_LARGE, str(e)) from e
    except Image.UnidentifiedImageError as e:
        raise ImageError(UNDECODABLE, "not a recognised image format") from e
    except OSError as e:
        if "truncated" in str(e).lower():
            raise ImageError(TRUNCATED, str(e)) from e
        raise ImageError(UNDECODABLE, str(e)) from e
    except (SyntaxError, ValueError, EOFError) as e:
        raise ImageError(UNDECODABLE, str(e) or type(e).__name__) from e
    try:
        img = ImageOps.exif_transpose(img)
    except Exception as e:  # noqa: BLE001 - a broken EXIF block should not lose the image
        LOG.debug("ignoring unreadable EXIF orientation: %s", e)
    img = to_rgb(img)
    if min(img.size) < min_side:
        raise ImageError(TOO_SMALL, f"{img.size[0]}x{img.size[1]} is below --min_side={min_side}")
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB; transparent pixels become white."""
    if img.mode == "RGB":
        return img
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit grayscale: keep the top 8 bits instead of clipping at 255.
        img = img.point(lambda v: v / 256).convert("L")
    return img.convert("RGB")


def crop_box(img: Image.Image, bbox) -> Image.Image:
    """Crop to ``[x0, y0, x1, y1]`` (source pixels), clipped to the image."""
    x0, y0, x1, y1 = (float(v) for v in bbox)
    w, h = img.size
    left, top = max(0, math.floor(x0)), max(0, math.floor(y0))
    right, bottom = min(w, math.ceil(x1)), min(h, math.ceil(y1))
    if right <= left or bottom <= top:
        raise ImageError(BAD_BOX, f"box {list(bbox)} is empty inside a {w}x{h} image")
    return img.crop((left, top, right, bottom))


def resize_max_side(img: Image.Image, max_side: int) -> Image.Image:
    """Downscale so that the longer side is ``max_side`` (aspect kept; never upscales)."""
    w, h = img.size
    if not max_side or max(w, h) <= max_side:
        return img
    scale = max_side / max(w, h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return img.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)


def encode_jpeg(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality, optimize=False)
    return buf.getvalue()


def process_image_bytes(data: bytes, *, max_side: int = 0, jpeg_quality: int = 90,
                        min_side: int = 1, max_pixels: int = 100_000_000,
                        bbox=None) -> tuple[bytes, int, int]:
    """The whole per-image transform: returns ``(jpeg_bytes, height, width)``.

    Raises :class:`ImageError` for anything unusable.
    """
    # Decoding at reduced scale is only safe when no crop box needs full resolution.
    img = decode_image(data, min_side=min_side, max_pixels=max_pixels,
                       draft_side=max_side if bbox is None else 0)
    if bbox is not None:
        img = crop_box(img, bbox)
    img = resize_max_side(img, max_side)
    return encode_jpeg(img, jpeg_quality), img.size[1], img.size[0]


# ----------------------------------------------------------------------- tf.train.Example


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 -> two's complement, as protobuf does
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint((number << 3) | 2) + _varint(len(payload)) + payload


def _feature(values) -> bytes:
    """Serialise one ``tf.train.Feature`` from a list of bytes, ints or floats."""
    if not isinstance(values, (list, tuple)):
        values = [values]
    if values and isinstance(values[0], (bytes, str)):
        items = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
        return _field(1, b"".join(_field(1, v) for v in items))
    if values and isinstance(values[0], float):
        packed = struct.pack(f"<{len(values)}f", *values)
        return _field(2, _field(1, packed))
    packed = b"".join(_varint(int(v)) for v in values)
    return _field(3, _field(1, packed) if values else b"")


def serialize_example(features: dict[str, Any]) -> bytes:
    """Serialise ``{key: value or list}`` as a ``tf.train.Example`` (wire format).

    bytes/str values become a BytesList, floats a FloatList, ints an Int64List. Keys are
    written sorted, so the bytes are deterministic.
    """
    entries = b"".join(
        _field(1, _field(1, key.encode("utf-8")) + _field(2, _feature(features[key])))
        for key in sorted(features)
    )
    return _field(1, entries)


def image_example(record: dict, jpeg: bytes, height: int, width: int) -> bytes:
    """The per-image Example for a work-list ``record`` (see :mod:`pipelines`)."""
    features = {
        "image/encoded": jpeg,
        "image/format": b"jpeg",
        "image/id": record["id"],
        "image/path": record.get("relpath", record["path"]),
        "image/index": int(record.get("index", -1)),
        "image/height": int(height),
        "image/width": int(width),
        "image/class/label": int(record.get("label", -1)),
        "image/class/super_label": int(record.get("super_label", -1)),
        "image/class/text": str(record.get("class_text", "")),
    }
    if record.get("bbox") is not None:
        features["image/bbox"] = [float(v) for v in record["bbox"]]
    return serialize_example(features)


def class_chunks(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """Split ``n`` items into ``ceil(n / chunk_size)`` balanced ``(start, stop)`` chunks.

    Balanced chunks all hold at least ``floor(chunk_size / 2)`` items when ``n`` exceeds
    ``chunk_size``, so a sampler drawing m <= chunk_size / 2 images from one chunk can use
    every chunk of every class that has at least m images.
    """
    num = max(1, math.ceil(n / chunk_size))
    bounds = [round(i * n / num) for i in range(num + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(num)]


def class_chunk_examples(label: int, items: Iterable[tuple], chunk_size: int) -> list[bytes]:
    """By-class records for one class; ``items`` are ``(id, super_label, jpeg)``."""
    items = sorted(items, key=lambda t: t[0])
    super_label = items[0][1] if items else -1
    chunks = class_chunks(len(items), chunk_size)
    out = []
    for i, (start, stop) in enumerate(chunks):
        part = items[start:stop]
        out.append(serialize_example({
            "class/label": int(label),
            "class/super_label": int(super_label),
            "class/num_images": len(items),
            "class/chunk": i,
            "class/num_chunks": len(chunks),
            "image/encoded": [t[2] for t in part],
            "image/id": [t[0] for t in part],
        }))
    return out


def dead_letter(record: dict, code: str, detail: str) -> dict:
    return {"id": record.get("id", ""), "path": record.get("relpath", record.get("path", "")),
            "reason": code, "detail": detail}


class ProcessImageDoFn(beam.DoFn):
    """Work-list record (dict) -> ``{split, label, super_label, id, example, jpeg}``.

    Failures go to the ``dead`` tagged output as ``{id, path, reason, detail}``.
    """

    DEAD = "dead"

    def __init__(self, max_side: int, jpeg_quality: int, min_side: int, max_pixels: int,
                 keep_jpeg: dict[str, bool]):
        self.max_side = max_side
        self.jpeg_quality = jpeg_quality
        self.min_side = min_side
        self.max_pixels = max_pixels
        self.keep_jpeg = keep_jpeg
        self.ok = beam.metrics.Metrics.counter("pipelines", "images_written")
        self.failed = beam.metrics.Metrics.counter("pipelines", "images_failed")

    def process(self, record: dict):
        try:
            data = record.pop("_bytes", None)
            if data is None:
                data = read_bytes(record["path"])
            jpeg, h, w = process_image_bytes(
                data, max_side=self.max_side, jpeg_quality=self.jpeg_quality,
                min_side=self.min_side, max_pixels=self.max_pixels, bbox=record.get("bbox"))
        except ImageError as e:
            self.failed.inc()
            yield beam.pvalue.TaggedOutput(
                self.DEAD, {**dead_letter(record, e.code, e.detail), "split": record["split"]})
            return
        except Exception as e:  # noqa: BLE001 - one odd file must not stop the job
            self.failed.inc()
            yield beam.pvalue.TaggedOutput(self.DEAD, {
                **dead_letter(record, UNDECODABLE, f"{type(e).__name__}: {e}"),
                "split": record["split"]})
            return
        self.ok.inc()
        yield {
            "split": record["split"],
            "label": int(record.get("label", -1)),
            "super_label": int(record.get("super_label", -1)),
            "id": record["id"],
            "example": image_example(record, jpeg, h, w),
            "jpeg": jpeg if self.keep_jpeg.get(record["split"]) else b"",
        }


# ------------------------------------------------------------------------------ planning


@dataclass
class SplitPlan:
    """What the driver decided for one split before any image is read.

    ``records``: work-list dicts with ``id``, ``path`` (full), ``relpath``, ``label``,
    ``super_label``, ``class_text`` and optionally ``bbox``; ``failures``: dead letters
    found while planning; ``label_map`` / ``super_label_map``: label -> dataset name;
    ``extra``: more manifest entries; ``by_class``: whether to write the per-class layout
    (``None``: decided by ``--by_class``); ``source``: instead of a work list, a function
    ``(pipeline, step_prefix) -> PCollection`` of records carrying their image bytes under
    ``"_bytes"`` (TFDS), with ``num_records_hint`` records expected.
    """

    name: str
    records: list[dict]
    failures: list[dict] = field(default_factory=list)
    label_map: dict[int, str] = field(default_factory=dict)
    super_label_map: dict[int, str] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    by_class: bool | None = None
    source: Callable | None = None
    num_records_hint: int | None = None


def dedupe_and_index(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """Sort records by id, drop repeated ids into dead letters, set ``index``."""
    seen: dict[str, dict] = {}
    failures = []
    for r in records:
        if r["id"] in seen:
            failures.append(dead_letter(
                r, DUPLICATE_ID, f"id already used by {seen[r['id']].get('relpath', '')}"))
        else:
            seen[r["id"]] = r
    kept = sorted(seen.values(), key=lambda r: r["id"])
    for i, r in enumerate(kept):
        r.setdefault("index", i)
    return kept, failures


def contiguous_labels(keys: Iterable, *, sort_key=None) -> dict:
    """Map the distinct ``keys`` (sorted) to ``0..C-1``."""
    return {k: i for i, k in enumerate(sorted(set(keys), key=sort_key))}


def join(root: str, *parts: str) -> str:
    if "://" in root:
        return "/".join([root.rstrip("/"), *parts])
    return os.path.join(root, *parts)


# ------------------------------------------------------------------------------- running


def _gfile():
    import tensorflow as tf  # the driver only; workers never import TensorFlow

    return tf.io.gfile


def _num_shards(args, n: int) -> int:
    if args.num_shards:
        return args.num_shards
    return max(1, math.ceil(n / args.records_per_shard))


def _tag(record: dict, split: str) -> dict:
    return {**record, "split": split}


def _wants_by_class(args, plan: SplitPlan) -> bool:
    if plan.by_class is not None:
        return plan.by_class
    return args.by_class == "all" or (args.by_class == "train" and plan.name == "train")


def _to_json_lines(rows: Iterable[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def _read_json_lines(gfile, pattern: str) -> list[dict]:
    rows = []
    for path in sorted(gfile.glob(pattern)):
        with gfile.GFile(path, "r") as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows


def run_job(job: str, plans: list[SplitPlan], args, options) -> dict[str, dict]:
    """Run the Beam pipeline for all ``plans`` and write manifests and dead letters.

    Returns ``{split: manifest}``. Raises :class:`TooManyFailuresError` (after writing
    everything) when a split's failure fraction exceeds ``args.max_failure_fraction``.
    """
    gfile = _gfile()
    out = args.output_dir
    work = join(out, "_work")
    for old in gfile.glob(join(work, "*")):
        gfile.remove(old)
    gfile.makedirs(work)
    started = time.time()
    for plan in plans:
        split_dir = join(out, plan.name)
        # Old shards would mix with new ones when the shard count changes.
        for old in gfile.glob(join(split_dir, "images-*.tfrecord")) + gfile.glob(
                join(split_dir, "by_class", "classes-*.tfrecord")):
            gfile.remove(old)
        gfile.makedirs(split_dir)
        with gfile.GFile(join(work, f"{plan.name}-records.jsonl"), "w") as f:
            f.write(_to_json_lines({**r, "split": plan.name} for r in plan.records))
        LOG.info("%s/%s: %d images to process, %d rejected while planning",
                 job, plan.name, len(plan.records), len(plan.failures))

    # Few, shared transforms: Beam's per-transform set-up cost dominates small jobs.
    names = [plan.name for plan in plans]
    listed = [plan for plan in plans if plan.source is None]
    with beam.Pipeline(options=options) as p:
        inputs = []
        if listed:
            inputs.append(
                p
                | "ReadWorkLists" >> beam.io.ReadFromText(join(work, "*-records.jsonl"))
                | "Parse" >> beam.Map(json.loads))
        for plan in plans:
            if plan.source is not None:
                inputs.append(plan.source(p, plan.name)
                              | f"{plan.name}/Tag" >> beam.Map(_tag, plan.name))
        records = inputs[0] if len(inputs) == 1 else tuple(inputs) | "Inputs" >> beam.Flatten()
        wants_jpeg = {plan.name: _wants_by_class(args, plan) for plan in plans}
        results = records | "Process" >> beam.ParDo(ProcessImageDoFn(
            args.max_side, args.jpeg_quality, args.min_side, args.max_pixels,
            keep_jpeg=wants_jpeg)).with_outputs(ProcessImageDoFn.DEAD, main="ok")
        ok, dead = results.ok, results[ProcessImageDoFn.DEAD]
        per_split = ok | "BySplit" >> beam.Partition(
            lambda r, n, order=tuple(names): order.index(r["split"]), len(names))
        for plan, images in zip(plans, per_split):
            s = plan.name
            num_shards = _num_shards(args, plan.num_records_hint or len(plan.records))
            _ = (images
                 | f"{s}/Examples" >> beam.Map(lambda r: r["example"])
                 | f"{s}/WriteImages" >> beam.io.WriteToTFRecord(
                     join(out, s, "images"), file_name_suffix=".tfrecord",
                     num_shards=num_shards))
            if wants_jpeg[s]:
                chunk = args.class_chunk_size
                _ = (images
                     | f"{s}/KeyByClass" >> beam.Map(
                         lambda r: (r["label"], (r["id"], r["super_label"], r["jpeg"])))
                     | f"{s}/GroupByClass" >> beam.GroupByKey()
                     | f"{s}/Chunk" >> beam.FlatMap(
                         lambda kv, c=chunk: class_chunk_examples(kv[0], kv[1], c))
                     | f"{s}/WriteByClass" >> beam.io.WriteToTFRecord(
                         join(out, s, "by_class", "classes"), file_name_suffix=".tfrecord",
                         num_shards=max(1, min(num_shards, len(plan.label_map) or 1))))
        counts = (ok
                  | "KeyCounts" >> beam.Map(
                      lambda r: ((r["split"], r["label"], r["super_label"]), 1))
                  | "Count" >> beam.CombinePerKey(sum)
                  | "CountRows" >> beam.Map(lambda kv: {"kind": "count", "split": kv[0][0],
                                                        "label": kv[0][1], "super": kv[0][2],
                                                        "n": kv[1]}))
        dead_rows = dead | "DeadRows" >> beam.Map(lambda d: {"kind": "dead", **d})
        _ = ((counts, dead_rows)
             | "Report" >> beam.Flatten()
             | "ReportJson" >> beam.Map(lambda r: json.dumps(r, sort_keys=True))
             | "WriteReport" >> beam.io.WriteToText(join(work, "report"),
                                                     file_name_suffix=".jsonl", num_shards=1))

    report = _read_json_lines(gfile, join(work, "report*.jsonl"))
    manifests = {}
    too_many = []
    for plan in plans:
        rows = [r for r in report if r.get("split") == plan.name]
        manifests[plan.name] = _finish_split(gfile, job, plan, args, rows, started)
        m = manifests[plan.name]
        if m["failure_fraction"] > args.max_failure_fraction:
            too_many.append(f"{plan.name}: {m['num_failures']} of {m['num_inputs']} inputs "
                            f"failed ({m['failure_fraction']:.2%})")
    for path in gfile.glob(join(work, "*")):
        gfile.remove(path)
    gfile.rmtree(work) if gfile.exists(work) else None
    if too_many:
        raise TooManyFailuresError(
            "more failures than --max_failure_fraction="
            f"{args.max_failure_fraction}: " + "; ".join(too_many)
            + ". See dead_letters.jsonl in each split folder.", manifests)
    return manifests


def _finish_split(gfile, job: str, plan: SplitPlan, args, report: list[dict],
                  started: float) -> dict:
    split_dir = join(args.output_dir, plan.name)
    counts, supers = {}, {}
    for r in report:
        if r["kind"] == "count":
            counts[int(r["label"])] = counts.get(int(r["label"]), 0) + int(r["n"])
            supers[int(r["label"])] = int(r["super"])
    dead = plan.failures + [{k: v for k, v in r.items() if k not in ("kind", "split")}
                            for r in report if r["kind"] == "dead"]
    dead.sort(key=lambda d: (d["reason"], d["id"], d["path"]))
    with gfile.GFile(join(split_dir, "dead_letters.jsonl"), "w") as f:
        f.write(_to_json_lines(dead))
    shards = sorted(os.path.basename(p) for p in gfile.glob(join(split_dir, "images-*.tfrecord")))
    by_class = sorted(os.path.basename(p)
                      for p in gfile.glob(join(split_dir, "by_class", "classes-*.tfrecord")))
    num_images = sum(counts.values())
    num_inputs = num_images + len(dead)
    option_names = sorted(vars(args))
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "job": f"pipelines.{job}",
        "split": plan.name,
        "num_images": num_images,
        "num_classes": len([c for c, n in counts.items() if n > 0 and c >= 0]),
        "num_inputs": num_inputs,
        "num_failures": len(dead),
        "failure_fraction": (len(dead) / num_inputs) if num_inputs else 0.0,
        "failures_by_reason": dict(sorted(collections.Counter(d["reason"] for d in dead).items())),
        "class_counts": {str(k): counts[k] for k in sorted(counts)},
        "label_map": {str(k): v for k, v in sorted(plan.label_map.items())},
        "super_label_map": {str(k): v for k, v in sorted(plan.super_label_map.items())},
        "class_super_labels": ({str(k): supers[k] for k in sorted(supers)}
                               if any(v >= 0 for v in supers.values()) else {}),
        "shards": shards,
        "by_class": ({"shards": [f"by_class/{b}" for b in by_class],
                      "chunk_size": args.class_chunk_size} if by_class else None),
        "dead_letters": "dead_letters.jsonl",
        "features": {k: v[0] for k, v in IMAGE_FEATURES.items()},
        "options": {k: getattr(args, k) for k in option_names},
        **plan.extra,
    }
    with gfile.GFile(join(split_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    LOG.info("%s/%s: wrote %d images of %d classes in %d shards, %d failures (%.1f s)",
             job, plan.name, num_images, manifest["num_classes"], len(shards), len(dead),
             time.time() - started)
    return manifest


def describe_manifests(manifests: dict[str, dict]) -> str:
    """One line per split of a job's ``{split: manifest}`` result."""
    return "\n".join(
        f"{split}: {m['num_images']} images, {m['num_classes']} classes, "
        f"{m['num_failures']} failures -> {m['shards'][:1]}..."
        for split, m in manifests.items()
    )


def main_wrapper(run_fn, argv: list[str] | None = None, describe=describe_manifests) -> int:
    """Shared ``__main__``: logging on, exit 1 on too many failures or bad arguments.

    ``describe`` turns what ``run_fn`` returned into the summary printed on success.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        result = run_fn(argv)
    except TooManyFailuresError as e:
        LOG.error("%s", e)
        return 1
    except (ValueError, FileNotFoundError) as e:
        LOG.error("%s", e)
        return 2
    print(describe(result))
    return 0
