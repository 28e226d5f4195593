"""Damaged TFRecord shards as one :class:`DamagedDataError` naming the file, byte offset
and record, the job that wrote it and the command that writes it again, where
TensorFlow says only ``corrupted record at N`` (docs/reliability.md, "Damaged data").
:func:`check_split` checks a split against its manifest; :func:`reading` turns an error
met while iterating into that message; :func:`startup_check` and :func:`skipping` are
what ``tfaploss train`` checks first and the damaged shards it was told to leave out.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from dataclasses import dataclass, field

from tfaploss.data.framing import ALGORITHM, file_checksum
from tfaploss.data.record_checks import Damage, error_text, first_line, scan_shard, size_damage
from tfaploss.data.split_manifest import describe_source, manifest_classes, read_manifest

LOG = logging.getLogger(__name__)


class DamagedDataError(ValueError):
    """A record file that cannot be read as what its manifest says it is.

    ``path``: the file; ``offset``, ``record``: where (or None); ``problem``: what is
    wrong, in words. A ``ValueError``, so that the Beam jobs' ``__main__`` exits 2 on it.
    """

    def __init__(self, message: str, *, path: str = "", offset: int | None = None,
                 record: int | None = None, problem: str = ""):
        super().__init__(message)
        self.path, self.offset, self.record, self.problem = path, offset, record, problem


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


def layout_files(split_dir: str, layout: str) -> list[str]:
    import glob

    pattern = ("images-*.tfrecord" if layout == "images"
               else os.path.join("by_class", "classes-*.tfrecord"))
    return sorted(os.path.relpath(p, split_dir)
                  for p in glob.glob(os.path.join(split_dir, pattern)))


def check_split(split_dir: str, level: str = "sizes", *, layouts=("images", "by_class"),
                progress=None) -> SplitReport:
    """Check a split folder's record files against its ``manifest.json``; a
    :class:`SplitReport` with one :class:`Damage` per damaged file.

    ``level``: ``"sizes"`` (sizes and file names, no read: what ``tfaploss train``
    does at start-up), ``"full"`` (also each file's CRC-32C, or each record's own CRCs
    when the manifest records none), ``"records"`` (also parse and check every record)
    or ``"decode"`` (also decode every image). ``layouts``: ``"images"``,
    ``"by_class"``. ``progress``: called with ``(file, bytes)`` after each file.
    """
    if level not in ("sizes", "full", "records", "decode"):
        raise ValueError(f"level must be 'sizes', 'full', 'records' or 'decode', got "
                         f"{level!r}")
    manifest = read_manifest(split_dir)
    report = SplitReport(split_dir, manifest)
    recorded = ((manifest or {}).get("checksums") or {}).get("files")
    if recorded is None:
        report.notes.append("no checksums recorded in manifest.json (an older pipelines "
                            "version wrote it): checked each record's own CRC instead"
                            if level != "sizes" else "no checksums recorded")
    classes = manifest_classes(manifest)
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
    wrong_size = size_damage(path, os.path.getsize(path), expect)
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
    manifest = manifest if manifest is not None else read_manifest(split_dir)
    reading = f" while {what}" if what else ""
    return DamagedDataError(
        f"damaged data{reading}: {damage.line()}. It was {describe_source(manifest, split_dir)}",
        path=damage.path, offset=damage.offset, record=damage.record,
        problem=damage.problem)


def _first_damage_error(split_dir: str, damaged: list[Damage], manifest: dict | None,
                        what: str) -> DamagedDataError:
    """The error of the first damaged file, the others logged as warnings first."""
    for damage in damaged[1:]:
        LOG.warning("also damaged: %s", damage.line())
    return damaged_error(split_dir, damaged[0], manifest, what)


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
    if report.damaged:
        raise _first_damage_error(split_dir, report.damaged, report.manifest, what)
    return report


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


def _is_data_error(err: BaseException) -> bool:
    import tensorflow as tf

    if isinstance(err, tf.errors.DataLossError):
        return True
    if isinstance(err, (tf.errors.InvalidArgumentError, UnicodeDecodeError)):
        return any(m in error_text(err) for m in _DATA_MESSAGES)
    return False


def _is_decode_error(err: BaseException) -> bool:
    return any(m in error_text(err) for m in _DECODE_MESSAGES)


def locate(paths, what: str = "", ignore=frozenset(),
           level: str = "records") -> DamagedDataError | None:
    """Scan the splits ``paths`` (record by record, parsing each; ``level="full"``:
    the framing only; ``"decode"``: also decoding each image) for the damage behind an
    error; the :class:`DamagedDataError` of the first damaged file, else None."""
    for path in paths:
        if not path:
            continue
        split_dir = split_dir_of(path)
        if not os.path.isdir(split_dir):
            continue
        report = check_split(split_dir, level)
        damaged = [d for d in report.damaged if os.path.normpath(d.path) not in ignore]
        if damaged:
            return _first_damage_error(split_dir, damaged, report.manifest, what)
    return None


class reading:
    """Turn a damaged record met inside the block into one :class:`DamagedDataError`.

    An error a record caused (``DataLossError``, an ``InvalidArgumentError`` of its
    content, or the ``UnicodeDecodeError`` raised for one not UTF-8) is followed by a
    scan of the splits ``paths``, which finds the file and record; other errors, and ones
    no scan explains, pass through. ``ignore``: files already known damaged.
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
                 first_line(err))
        # An image that does not decode passes the record checks: decode them all.
        level = "decode" if _is_decode_error(err) else "records"
        found = locate(self.paths, self.what, ignore=self.ignore, level=level)
        if found is None:
            return False
        raise found from None


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
    (``"sizes"``, ``"full"`` or ``"off"``); the first damaged file raises
    :class:`DamagedDataError`. ``skip``: the training split is read in full
    (``"records"``) and its damaged files are left out instead; returns ``{"shards":
    [{"file", "problem", "records"}], "records": total}`` (None when nothing was
    skipped), for by-class files also ``"class_records"`` and ``"classes_lost"``.
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
            raise _first_damage_error(split_dir, report.damaged, report.manifest,
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
                skipped["classes_lost"] = sorted(set(manifest_classes(report.manifest) or ())
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
