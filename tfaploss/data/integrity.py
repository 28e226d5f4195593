"""Damaged TFRecord shards: checksums, checks against the manifest, and one message.

A shard damaged on disk (a flipped byte, a truncated copy, another file under its name)
makes TensorFlow's reader raise ``DataLossError: corrupted record at N`` from deep inside
``tf.data``, naming neither the file nor what to do; a copy truncated exactly between two
records, or a zero-length one, is not noticed at all. This module turns every such case
into one :class:`DamagedDataError` whose message names the file, the byte offset and the
record, the job and split that wrote it (from ``manifest.json``) and the command that
writes it again:

* :func:`file_checksum` - the whole-file CRC-32C the pipelines record per shard in the
  manifest's ``checksums`` (with its size in bytes and its number of records).
* :func:`scan_shard` - one pass over a file's TFRecord framing (each record's length
  and data CRC-32C, as TensorFlow checks them, and a partial last record, which
  TensorFlow ignores), optionally parsing every record and checking its features
  (present, of the schema's type, label in the manifest's class list, image non-empty).
* :func:`check_split` - a split's files against its manifest: ``"sizes"`` (sizes and
  file names; no read: what ``tfaploss train`` does at start-up), ``"full"`` (also each
  file's checksum, or its framing when the manifest records none) or ``"records"``
  (also parse every record).
* :func:`reading` - a context around anything that iterates a split's records: a
  ``DataLossError``, or an ``InvalidArgumentError`` a record's content caused, becomes
  a :class:`DamagedDataError` after a scan has found the damaged file.

Why CRC-32C rather than SHA-256: the checksum is there to catch storage damage (bit rot,
truncated or swapped copies), not tampering, and CRC-32C is what TFRecord frames
already use and what Google Cloud Storage reports for every object; with google-crc32c
(hardware CRC instructions) it runs at several GB/s, faster than the disk, where
hashlib's SHA-256 is several times slower.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import mmap
import os
import re
import shlex
import struct
from dataclasses import dataclass, field

LOG = logging.getLogger(__name__)

ALGORITHM = "crc32c"
_HEADER = 12  # uint64 length + masked CRC-32C of the length
_FOOTER = 4   # masked CRC-32C of the data
_CHUNK = 8 << 20  # bytes per read when checksumming a whole file


def _crc32c_functions():
    """``(value(data) -> int, extend(crc, data) -> int)`` of the fastest CRC-32C at hand:
    google-crc32c (the pipelines extra), crc32c, crcmod (a Beam dependency), else a
    table in Python (correct, about 10 MB/s)."""
    try:
        import google_crc32c

        return (lambda d: google_crc32c.value(bytes(d)),
                lambda c, d: google_crc32c.extend(c, bytes(d)))
    except ImportError:
        pass
    try:
        import crc32c

        return crc32c.crc32c, lambda c, d: crc32c.crc32c(d, c)
    except ImportError:
        pass
    try:
        import crcmod.predefined

        fn = crcmod.predefined.mkPredefinedCrcFun("crc-32c")
        return fn, lambda c, d: fn(d, c)
    except ImportError:
        pass
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)

    def extend(crc, data):
        crc ^= 0xFFFFFFFF
        for b in bytes(data):
            crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
        return crc ^ 0xFFFFFFFF

    return (lambda d: extend(0, d)), extend


_crc_value, _crc_extend = _crc32c_functions()


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class DamagedDataError(ValueError):
    """A record file that cannot be read as what its manifest says it is.

    ``path``: the file; ``offset``: byte offset of the damaged record (or None);
    ``record``: its index in the file (or None); ``problem``: what is wrong, in words.
    ``str(err)`` is the one message a user reads: file, where, who wrote it, how to
    write it again. A ``ValueError``, so that the Beam jobs' ``__main__`` exits 2 on it.
    """

    def __init__(self, message: str, *, path: str = "", offset: int | None = None,
                 record: int | None = None, problem: str = ""):
        super().__init__(message)
        self.path, self.offset, self.record, self.problem = path, offset, record, problem


@dataclass
class Damage:
    """One damaged file of a split: ``problem`` in words, where in the file, when known."""

    path: str
    problem: str
    offset: int | None = None
    record: int | None = None

    def where(self) -> str:
        parts = []
        if self.record is not None:
            parts.append(f"record {self.record}")
        if self.offset is not None:
            parts.append(f"byte {self.offset}")
        return f" at {', '.join(parts)}" if parts else ""

    def line(self) -> str:
        return f"{self.path}{self.where()}: {self.problem}"


@dataclass
class SplitReport:
    """What :func:`check_split` found: ``damaged`` files, ``checked`` files and bytes,
    ``notes`` (e.g. no checksums recorded)."""

    split_dir: str
    manifest: dict | None
    checked: list[str] = field(default_factory=list)
    bytes: int = 0
    damaged: list[Damage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # by-class files read at level "records": {path: {label: images of its largest
    # record}}, what the samplers can draw (m images of a class come from one record)
    class_records: dict[str, dict[int, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.damaged


# ------------------------------------------------------------------------ the manifest


def file_checksum(path: str) -> dict:
    """``{"bytes": size, "crc32c": 8 hex digits, "records": n}`` of a TFRecord file (one
    read; ``records`` counts the framing's records, without checking their CRCs)."""
    size = os.path.getsize(path)
    crc, records, offset = 0, 0, 0
    if size:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for start in range(0, size, _CHUNK):
                crc = _crc_extend(crc, mm[start:start + _CHUNK])
            while offset + _HEADER <= size:
                (length,) = struct.unpack_from("<Q", mm, offset)
                offset += _HEADER + length + _FOOTER
                records += 1
    return {"bytes": size, ALGORITHM: f"{crc:08x}", "records": records}


def manifest_checksums(split_dir: str, files: list[str]) -> dict:
    """The manifest's ``checksums`` entry for ``files`` (paths relative to
    ``split_dir``): ``{"algorithm": "crc32c", "files": {name: file_checksum}}``."""
    return {"algorithm": ALGORITHM,
            "files": {name: file_checksum(os.path.join(split_dir, name))
                      for name in sorted(files)}}


def job_module(manifest: dict) -> str:
    """The module that runs the manifest's job. Splits written before the jobs moved
    into the ``tfaploss`` namespace name them ``pipelines.<job>``."""
    job = manifest.get("job") or "tfaploss.pipelines.<job>"
    return f"tfaploss.{job}" if job.startswith("pipelines.") else job


def describe_source(manifest: dict | None, split_dir: str) -> str:
    """``written by tfaploss.pipelines.folder (split train)`` and the command that writes it
    again, from the manifest's ``job``, ``split`` and ``options``."""
    if not manifest or not manifest.get("job"):
        return ("no manifest.json names the job that wrote it; write the split again "
                "with the tfaploss.pipelines job that made it")
    job, split = job_module(manifest), manifest.get("split", os.path.basename(split_dir))
    return f"written by {job} (split {split}); rebuild it: {rebuild_command(manifest)}"


def rebuild_command(manifest: dict) -> str:
    """``python -m tfaploss.pipelines.<job> --flag value ...`` from the manifest's options (the
    options left at their off value are left out)."""
    words = ["python", "-m", job_module(manifest)]
    for key, value in sorted((manifest.get("options") or {}).items()):
        if value is None or value is False or value == "" or key == "verbose":
            continue
        words.append(f"--{key}")
        if value is not True:
            words.append(str(value) if not isinstance(value, (list, dict))
                         else json.dumps(value))
    return " ".join(shlex.quote(w) for w in words)


def _classes(manifest: dict | None) -> set[int] | None:
    """The labels a record may carry (the manifest's class list), or None if unknown."""
    if not manifest:
        return None
    keys = set((manifest.get("class_counts") or {}).keys())
    keys |= set((manifest.get("label_map") or {}).keys())
    labels = {int(k) for k in keys if str(k).lstrip("-").isdigit() and int(k) >= 0}
    return labels or None


def label_table(manifest: dict | None) -> list[bool] | None:
    """``table[label]`` is True for a label of the manifest's class list (for the
    in-graph check of :mod:`tfaploss.data.records`); None when the manifest has none."""
    classes = _classes(manifest)
    if not classes:
        return None
    table = [False] * (max(classes) + 1)
    for c in classes:
        table[c] = True
    return table


# ------------------------------------------------------------------------ the framing


_MAGIC = ((b"\xff\xd8\xff", "a JPEG image"), (b"\x89PNG", "a PNG image"),
          (b"\x1f\x8b", "gzip-compressed (the readers take uncompressed TFRecords)"),
          (b"PK\x03\x04", "a zip archive"), (b"GIF8", "a GIF image"),
          (b"{", "text (JSON?)"), (b"\x89HDF", "an HDF5 file"))


def _foreign(head: bytes) -> str | None:
    """What a file that is not a TFRecord file looks like it is, from its first bytes."""
    for magic, what in _MAGIC:
        if head.startswith(magic):
            return what
    if head and all(32 <= b < 127 or b in b"\t\r\n" for b in head[:64]):
        return "text"
    return None


def scan_shard(path: str, *, layout: str | None = None, classes: set[int] | None = None,
               expect: dict | None = None, tally: dict[int, int] | None = None,
               decode: bool = False) -> tuple[int, Damage | None]:
    """One pass over a TFRecord file: ``(records read, first Damage or None)``.

    Checks each record's length and data CRC-32C (what TensorFlow's reader checks) and
    a last record cut short (which TensorFlow's reader takes for the end of the file).
    With ``layout`` ("images" or "by_class") every record is also parsed and its
    features checked (:func:`check_example`). ``expect``: the manifest's entry of this
    file (``bytes``, ``records``), compared too. ``tally`` (by-class records): filled
    as in :func:`check_example`. ``decode``: also decode every image (with ``layout``).
    """
    size = os.path.getsize(path)
    if expect and "bytes" in expect and size != expect["bytes"]:
        problem = (f"{size} bytes, the manifest says {expect['bytes']}"
                   + (" (an empty file)" if size == 0 else
                      " (truncated copy?)" if size < expect["bytes"] else ""))
        return 0, Damage(path, problem)
    if size == 0:
        return 0, None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        offset, n = 0, 0
        while offset < size:
            if offset + _HEADER > size:
                return n, Damage(path, f"a record header cut short after {size - offset} "
                                 "of 12 bytes (truncated file)", offset, n)
            head = mm[offset:offset + _HEADER]
            (length,) = struct.unpack_from("<Q", head)
            if _masked(_crc_value(head[:8])) != struct.unpack_from("<I", head, 8)[0]:
                what = _foreign(bytes(mm[:16])) if n == 0 else None
                problem = (f"not a TFRecord file: it looks like {what}" if what else
                           "corrupted record (its length fails its CRC)")
                return n, Damage(path, problem, offset, n)
            end = offset + _HEADER + length + _FOOTER
            if end > size:
                return n, Damage(path, f"a record of {length} bytes cut short after "
                                 f"{size - offset - _HEADER} (truncated file)", offset, n)
            data = mm[offset + _HEADER:offset + _HEADER + length]
            if _masked(_crc_value(data)) != struct.unpack_from("<I", mm, end - _FOOTER)[0]:
                return n, Damage(path, "corrupted record (its data fail their CRC)",
                                 offset, n)
            if layout is not None:
                problem = check_example(data, layout, classes, tally, decode=decode)
                if problem:
                    return n, Damage(path, f"invalid record: {problem}", offset, n)
            offset, n = end, n + 1
    if expect and "records" in expect and n != expect["records"]:
        return n, Damage(path, f"{n} records, the manifest says {expect['records']}")
    return n, None


_IMAGE_KINDS = {"image/encoded": "bytes_list", "image/id": "bytes_list",
                "image/index": "int64_list", "image/height": "int64_list",
                "image/width": "int64_list", "image/class/label": "int64_list",
                "image/class/super_label": "int64_list", "image/bbox": "float_list"}
_CLASS_KINDS = {"class/label": "int64_list", "class/super_label": "int64_list",
                "class/num_images": "int64_list", "image/encoded": "bytes_list",
                "image/id": "bytes_list"}
_REQUIRED = {"images": ("image/encoded", "image/id"),
             "by_class": ("class/label", "class/num_images")}
_LISTS = ("image/bbox",)  # variable length; every other feature holds one value
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM", b"RIFF")


def check_example(data: bytes, layout: str, classes: set[int] | None = None,
                  tally: dict[int, int] | None = None, decode: bool = False) -> str | None:
    """What is wrong with one serialized Example of ``layout`` ("images" or
    "by_class"), in words, or None: unparsable, a feature missing or of another type,
    a label negative (below -1 for images) or outside ``classes``, an empty or
    non-image ``image/encoded``, a by-class record whose ``image/id`` does not hold one
    id per image. ``tally``: for a sound by-class record, ``tally[label]`` becomes the
    most images one record of that class holds. ``decode``: also decode each image with
    the decoder the readers use (costs a decode per image; what :func:`reading` runs
    to find an image the reader could not decode)."""
    from tensorflow.core.example import example_pb2

    try:
        features = example_pb2.Example.FromString(bytes(data)).features.feature
    except Exception:  # noqa: BLE001 - any protobuf decode error means the same here
        return "not a tf.train.Example"
    kinds = _IMAGE_KINDS if layout == "images" else _CLASS_KINDS
    for key in _REQUIRED[layout]:
        if key not in features:
            return f"feature {key} is missing"
    for key, kind in kinds.items():
        if key not in features:
            continue
        found = features[key].WhichOneof("kind")
        if found != kind:
            return f"feature {key} holds {found or 'nothing'}, not {kind}"
        values = getattr(features[key], kind).value
        if layout == "images" and key not in _LISTS and len(values) != 1:
            return f"feature {key} holds {len(values)} values, not 1"
        if layout == "by_class" and key.startswith("class/") and len(values) != 1:
            return f"feature {key} holds {len(values)} values, not 1"
    label_key = "image/class/label" if layout == "images" else "class/label"
    if label_key in features:
        label = features[label_key].int64_list.value[0]
        lowest = -1 if layout == "images" else 0  # -1: an image without a class
        if label < lowest:
            return f"{label_key} is {label}, below {lowest}"
        if label >= 0 and classes is not None and label not in classes:
            return f"{label_key} {label} is not among the manifest's {len(classes)} classes"
    encoded = list(features["image/encoded"].bytes_list.value) if "image/encoded" in \
        features else []
    if layout == "by_class":
        n = features["class/num_images"].int64_list.value[0]
        # num_images counts the whole class; a record holds one chunk of it
        if not encoded or n < len(encoded):
            return f"class/num_images is {n} but the record holds {len(encoded)} images"
    for jpeg in encoded:
        if not jpeg:
            return "image/encoded is empty"
        if not jpeg.startswith(_IMAGE_MAGIC):
            return "image/encoded is not a JPEG, PNG, GIF, BMP or WebP image"
    if layout == "by_class":
        # The samplers draw an image and its id with one index.
        ids = len(features["image/id"].bytes_list.value) if "image/id" in features else 0
        if ids != len(encoded):
            return f"image/id holds {ids} ids for {len(encoded)} images"
    if decode:
        for k, image in enumerate(encoded):
            problem = _undecodable(image)
            if problem:
                which = f" (image {k + 1} of {len(encoded)})" if len(encoded) > 1 else ""
                return f"image/encoded{which} does not decode: {problem}"
    if tally is not None and layout == "by_class":
        label = features["class/label"].int64_list.value[0]
        tally[label] = max(tally.get(label, 0), len(encoded))
    return None


def _undecodable(image: bytes) -> str | None:
    """Why TensorFlow's decoder (the readers': ``decode_image``, and libjpeg's own header
    read that the training crops start with) refuses ``image``, or None."""
    import tensorflow as tf

    try:
        data = tf.constant(image)
        if tf.io.is_jpeg(data):
            tf.io.extract_jpeg_shape(data)
        tf.io.decode_image(data, channels=3, expand_animations=False)
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as err:
        return _first_line(err)
    return None


# ------------------------------------------------------------------------ a split


def _read_manifest(split_dir: str) -> dict | None:
    path = os.path.join(split_dir, "manifest.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def layout_files(split_dir: str, layout: str) -> list[str]:
    import glob

    pattern = ("images-*.tfrecord" if layout == "images"
               else os.path.join("by_class", "classes-*.tfrecord"))
    return sorted(os.path.relpath(p, split_dir)
                  for p in glob.glob(os.path.join(split_dir, pattern)))


def check_split(split_dir: str, level: str = "sizes", *, layouts=("images", "by_class"),
                progress=None, skip_missing_layouts: bool = True) -> SplitReport:
    """Check a split folder's record files against its ``manifest.json``.

    Args:
        split_dir: a split folder written by a pipelines job.
        level: ``"sizes"`` (each file's size and the list of files, no read),
            ``"full"`` (also each file's CRC-32C; a manifest without checksums: each
            record's own CRCs), ``"records"`` (also parse every record and check
            its features) or ``"decode"`` (also decode every image: a decode per
            image, what :func:`reading` runs when the reader could not decode one).
        layouts: which files: ``"images"`` (``images-*``), ``"by_class"``.
        progress: called with ``(file, bytes)`` after each file, for a progress bar.
        skip_missing_layouts: unused layouts (no such files, none in the manifest) are
            not an error.

    Returns:
        A :class:`SplitReport`; ``report.damaged`` lists one :class:`Damage` per file.

    Example:

    >>> report = check_split("out/train", "full")  # doctest: +SKIP
    >>> [d.line() for d in report.damaged]  # doctest: +SKIP
    """
    if level not in ("sizes", "full", "records", "decode"):
        raise ValueError(f"level must be 'sizes', 'full', 'records' or 'decode', got "
                         f"{level!r}")
    manifest = _read_manifest(split_dir)
    report = SplitReport(split_dir, manifest)
    recorded = ((manifest or {}).get("checksums") or {}).get("files")
    if recorded is None:
        report.notes.append("no checksums recorded in manifest.json (an older pipelines "
                            "version wrote it): checked each record's own CRC instead"
                            if level != "sizes" else "no checksums recorded")
    classes = _classes(manifest)
    for layout in layouts:
        on_disk = layout_files(split_dir, layout)
        if recorded is not None:
            prefix = "by_class/" if layout == "by_class" else "images-"
            listed = sorted(k for k in recorded if k.startswith(prefix))
            for name in sorted(set(listed) - set(on_disk)):
                report.damaged.append(Damage(os.path.join(split_dir, name),
                                             "missing (the manifest lists it)"))
            for name in sorted(set(on_disk) - set(listed)):
                report.damaged.append(Damage(os.path.join(split_dir, name),
                                             "not written with this manifest (it lists "
                                             f"{len(listed)} {layout} files, not this one)"))
        for name in on_disk:
            if recorded is not None and name not in recorded:
                continue
            path = os.path.join(split_dir, name)
            expect = (recorded or {}).get(name)
            tally = {} if level in ("records", "decode") and layout == "by_class" else None
            damage = _check_file(path, level, expect, layout, classes, tally)
            if tally is not None:
                report.class_records[path] = tally
            report.checked.append(path)
            size = os.path.getsize(path)
            report.bytes += size
            if damage is not None:
                report.damaged.append(damage)
            if progress is not None:
                progress(path, size)
    return report


def _check_file(path, level, expect, layout, classes, tally=None) -> Damage | None:
    size = os.path.getsize(path)
    wrong_size = None
    if expect is not None and size != expect.get("bytes", size):
        wrong_size = Damage(path, f"{size} bytes, the manifest says {expect['bytes']}"
                            + (" (an empty file)" if size == 0 else
                               " (truncated copy?)" if size < expect["bytes"] else ""))
    if level == "sizes":
        return wrong_size
    if level == "full" and wrong_size is None and expect is not None and ALGORITHM in expect:
        found = file_checksum(path)[ALGORITHM]
        if found == expect[ALGORITHM]:
            return None
        # Locate the damage for the message; the checksum alone says only "somewhere".
        _, damage = scan_shard(path)
        return damage or _changed(path, found, expect)
    # The record that fails says most; then the size, then the number of records.
    records = (expect or {}).get("records")
    parse = level in ("records", "decode")
    n, damage = scan_shard(path, layout=layout if parse else None, classes=classes,
                           tally=tally, decode=level == "decode")
    if damage is not None or wrong_size is not None:
        return damage or wrong_size
    if records is not None and n != records:
        return Damage(path, f"{n} records, the manifest says {records} (truncated copy?)")
    if parse and expect is not None and ALGORITHM in expect:
        # Every record sound, the file not the one written: "records" checks all that
        # "full" does (records reordered or rewritten with valid framing).
        found = file_checksum(path)[ALGORITHM]
        if found != expect[ALGORITHM]:
            return _changed(path, found, expect)
    return None


def _changed(path, found: str, expect: dict) -> Damage:
    return Damage(path, f"CRC-32C {found}, the manifest says {expect[ALGORITHM]} (a "
                  "changed or swapped file)")


def damaged_error(split_dir: str, damage: Damage, manifest: dict | None = None,
                  what: str = "") -> DamagedDataError:
    """The one message of a damaged file: where, who wrote it, how to rebuild it."""
    manifest = manifest if manifest is not None else _read_manifest(split_dir)
    reading = f" while {what}" if what else ""
    return DamagedDataError(
        f"damaged data{reading}: {damage.line()}. It was {describe_source(manifest, split_dir)}",
        path=damage.path, offset=damage.offset, record=damage.record,
        problem=damage.problem)


def split_dir_of(path_or_glob: str) -> str:
    """The split folder of a split folder, a glob of its files, or one of its files."""
    if os.path.isdir(path_or_glob):
        return path_or_glob
    base = os.path.dirname(path_or_glob)
    return os.path.dirname(base) if os.path.basename(base) == "by_class" else base


def check_or_raise(path: str, level: str = "sizes", *, layouts=("images", "by_class"),
                   what: str = "") -> SplitReport:
    """:func:`check_split`, raising :class:`DamagedDataError` for its first damaged file
    (the others are logged as warnings first)."""
    split_dir = split_dir_of(path)
    report = check_split(split_dir, level, layouts=layouts)
    for damage in report.damaged[1:]:
        LOG.warning("also damaged: %s", damage.line())
    if report.damaged:
        raise damaged_error(split_dir, report.damaged[0], report.manifest, what)
    return report


# ------------------------------------------------------------------------ reading


# What TensorFlow says when a record's bytes are at fault: the reader's framing errors,
# the Example parser's and the image decoders' (by message, or by the op's node name in
# a tf.data function).
_DECODE_MESSAGES = ("Unknown image file format", "Invalid JPEG data", "jpeg::",
                    "Invalid PNG data", "Input is empty", "DecodeImage", "DecodeJpeg",
                    "DecodeAndCropJpeg", "ExtractJpegShape", "DecodePng", "DecodeGif",
                    "DecodeBmp", "DecodeWebP")
_DATA_MESSAGES = ("damaged record", "corrupted record", "truncated record",
                  "Can't read a negative number of bytes", "Could not parse example",
                  "ParseExample", "Data types don't match",
                  "is required but could not be found", "Feature: image/", "Key: image/",
                  "Key: class/", *_DECODE_MESSAGES)


def _error_text(err: BaseException) -> str:
    """The text of ``err``. TensorFlow quotes the record in some of its errors ("Could
    not parse example input, value: '...'"), and a record that is not UTF-8 then makes
    its error a ``UnicodeDecodeError`` over that message, which it carries as bytes."""
    if isinstance(err, UnicodeDecodeError) and isinstance(err.object, (bytes, bytearray)):
        return bytes(err.object).decode("utf-8", "replace")
    return getattr(err, "message", None) or str(err)


def _is_data_error(err: BaseException) -> bool:
    import tensorflow as tf

    if isinstance(err, tf.errors.DataLossError):
        return True
    if isinstance(err, (tf.errors.InvalidArgumentError, UnicodeDecodeError)):
        return any(m in _error_text(err) for m in _DATA_MESSAGES)
    return False


def _is_decode_error(err: BaseException) -> bool:
    return any(m in _error_text(err) for m in _DECODE_MESSAGES)


def _first_line(err: BaseException) -> str:
    text = _error_text(err)
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text)
    text = re.sub(r"\s*\[Op:[^\]]*\].*", "", text)  # the eager op's name, not the cause
    return text.strip().splitlines()[0][:300] if text.strip() else type(err).__name__


def locate(paths, err: BaseException | None = None, what: str = "",
           ignore=frozenset(), level: str = "records") -> DamagedDataError | None:
    """Scan the splits ``paths`` (record by record, parsing each; ``level="full"``:
    the framing only; ``"decode"``: also decoding each image) for the damage behind
    ``err``; the :class:`DamagedDataError` of the first damaged file, else None."""
    for path in paths:
        if not path:
            continue
        split_dir = split_dir_of(path)
        if not os.path.isdir(split_dir):
            continue
        report = check_split(split_dir, level)
        damaged = [d for d in report.damaged if os.path.normpath(d.path) not in ignore]
        if damaged:
            for damage in damaged[1:]:
                LOG.warning("also damaged: %s", damage.line())
            return damaged_error(split_dir, damaged[0], report.manifest, what)
    return None


class reading:
    """Turn a damaged record met inside the block into one :class:`DamagedDataError`.

    ``paths``: the splits the block reads (folders or globs). A ``DataLossError`` (a
    corrupted or truncated record) or an ``InvalidArgumentError`` a record caused
    (unparsable, a feature missing or of another type, an out-of-range label, an empty
    or undecodable image; or the ``UnicodeDecodeError`` TensorFlow raises in its place
    when the message quotes a record that is not UTF-8) is followed by a scan of these
    splits, which finds the file and record (decoding every image when an image did not
    decode); the error raised then names them. Errors of another cause, and ones
    whose file no scan finds, pass through unchanged (a corrupt record always fails its
    CRC, so the scan finds every damaged file TensorFlow's reader would). ``ignore``:
    files already known damaged and left out (not blamed again).

    Example:

    >>> with reading("out/train", what="training"):  # doctest: +SKIP
    ...     model.fit(dataset)
    """

    def __init__(self, *paths: str | None, what: str = "", ignore=()):
        self.paths, self.what = paths, what
        self.ignore = {os.path.normpath(p) for p in ignore}

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if err is None or isinstance(err, DamagedDataError) or not _is_data_error(err):
            return False
        LOG.info("a record could not be read (%s); looking for the damaged file ...",
                 _first_line(err))
        # An image that does not decode passes the record checks: decode them all.
        level = "decode" if _is_decode_error(err) else "records"
        found = locate(self.paths, err, self.what, ignore=self.ignore, level=level)
        if found is None:
            return False
        raise found from None


# ------------------------------------------------------------------------ skipping


_SKIPPED: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "tfaploss_skipped_shards", default=(frozenset(), None))


def skipped_files() -> frozenset:
    """Normalised paths of the record files :func:`skipping` leaves out."""
    return _SKIPPED.get()[0]


def kept_class_records() -> dict[int, int] | None:
    """Within :func:`skipping` given ``class_records``: ``{label: images of its largest
    record}`` of the by-class files kept, what the samplers' class checks count;
    else None (the manifest's counts hold)."""
    return _SKIPPED.get()[1]


@contextlib.contextmanager
def skipping(files, class_records: dict[int, int] | None = None):
    """Within the block, :func:`tfaploss.data.records.split_files` leaves ``files`` out:
    every dataset a run builds (training, BatchNorm calibration) skips them alike.
    ``class_records``: what the kept by-class files hold (:func:`kept_class_records`),
    so that a sampler counts only the classes it can still draw."""
    token = _SKIPPED.set((frozenset(os.path.normpath(f) for f in files),
                          None if class_records is None else dict(class_records)))
    try:
        yield
    finally:
        _SKIPPED.reset(token)


def startup_check(train: str | None, test: str | None = None, *, layout: str = "by_class",
                  level: str = "sizes", skip: bool = False) -> dict | None:
    """What ``tfaploss train`` checks before its first step; the skipped shards.

    The training split's ``layout`` files and the test split's images at ``level``
    (``"sizes"``: against the manifest, no read; ``"full"``: also checksums; ``"off"``).
    ``skip``: the training split is read once in full (``"records"``) and its damaged
    files are left out instead of stopping the run; returns ``{"shards": [{"file",
    "problem", "records"}], "records": total or None}`` (None when nothing was
    skipped). Otherwise the first damaged file raises :class:`DamagedDataError`.
    Skipping by-class files also returns ``"class_records"`` (``{label: images of its
    largest record}`` in the files kept) and ``"classes_lost"`` (the manifest's
    classes no kept file holds).
    """
    if level not in ("sizes", "full", "off"):
        raise ValueError(f"verify_data must be 'sizes', 'full' or 'off', got {level!r}")
    skipped = None
    if train and os.path.isdir(split_dir_of(train)) and (level != "off" or skip):
        split_dir = split_dir_of(train)
        report = check_split(split_dir, "records" if skip else level, layouts=(layout,))
        for note in report.notes:
            LOG.info("note: %s: %s", split_dir, note)
        if report.damaged and not skip:
            for damage in report.damaged[1:]:
                LOG.warning("also damaged: %s", damage.line())
            raise damaged_error(split_dir, report.damaged[0], report.manifest,
                                "checking the training data")
        if report.damaged:
            recorded = ((report.manifest or {}).get("checksums") or {}).get("files") or {}
            shards = []
            for d in report.damaged:
                name = os.path.relpath(d.path, split_dir)
                shards.append({"file": name, "problem": d.line().split(": ", 1)[-1],
                               "records": (recorded.get(name) or {}).get("records")})
            counts = [s["records"] for s in shards]
            skipped = {"shards": shards,
                       "records": sum(counts) if None not in counts else None}
            if layout == "by_class":
                bad = {d.path for d in report.damaged}
                kept: dict[int, int] = {}
                for path, tally in report.class_records.items():
                    if path not in bad:
                        for label, n in tally.items():
                            kept[label] = max(kept.get(label, 0), n)
                skipped["class_records"] = kept
                skipped["classes_lost"] = sorted(set(_classes(report.manifest) or ())
                                                 - set(kept))
            if len(report.damaged) >= len(layout_files(split_dir, layout)):
                raise damaged_error(split_dir, report.damaged[0], report.manifest,
                                    "checking the training data (every file is damaged: "
                                    "nothing left to skip to)")
            LOG.warning("warning: skipping %d damaged file(s) of %s (%s records): %s. %s",
                        len(shards), split_dir,
                        skipped["records"] if skipped["records"] is not None else "?",
                        "; ".join(d.line() for d in report.damaged),
                        describe_source(report.manifest, split_dir))
    if test and os.path.isdir(split_dir_of(test)) and level != "off":
        check_or_raise(test, level, layouts=("images",), what="checking the test data")
    return skipped
