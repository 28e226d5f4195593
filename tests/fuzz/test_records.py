"""Fuzz: damaged record files through ``tfaploss verify`` and the readers.

A small split (``tests.support.miniature``: 3 classes, 8 images, per-image and by-class
shards, a manifest with checksums) has one shard damaged per case, either layout:

* on disk, as storage damages a file: bits flipped anywhere, the file cut short, a
  record's length field rewritten (to 0, +-1, 2^32, 2^63, 2^64 - 1 or any 64-bit
  value; half the time with its CRC made to match), a CRC rewritten;
* in a record whose framing is then made valid again (both CRCs recomputed), as a
  faulty writer would leave it: the Example's bytes flipped, cut short, extended, or
  bytes of its image overwritten; half of these with the manifest's checksums written
  over the result too (the writer checksummed what it wrote).

Then, in the order a run meets them:

1. ``check_split`` at every level and ``tfaploss verify --records``: the split is
   sound, or the damaged file (and only it) is named, in the report, in verify's output
   (exit 2) and in the one :class:`DamagedDataError` of ``check_or_raise``;
2. reading it as evaluation and training do (the start-up size check, then the
   per-image reader or the by-class sampler inside ``integrity.reading``): the data
   comes out, or ONE ``DamagedDataError`` names the file, never another exception.

A record that framing, feature and checksum checks pass but whose image does not
decode is the one damage ``verify --records`` does not see (it does not decode
images); the reader names its file and record. A length field rewritten with its CRC to a length the host
cannot allocate crashes TensorFlow's reader (:data:`CRASHING_LENGTHS`): such a case is
checked up to verify, which finds it, and not read. Each case is bounded in time (a hang ends the run with every
thread's stack) and memory.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import struct
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz import harness
from tests.fuzz.profiles import examples
from tests.support.timing import speed_factor

tf = pytest.importorskip("tensorflow")

from tests.support.miniature import write_split_records
from tfaploss.data import framing
from tfaploss.data import integrity as I

pytestmark = pytest.mark.tensorflow

SIZES = {0: 3, 1: 3, 2: 2}
FILES = {"images": "images-00000-of-00001.tfrecord",
         "by_class": os.path.join("by_class", "classes-00000-of-00001.tfrecord")}
SOFT_S = 10.0  # a case: ~0.2-0.5 s on an idle core (a tf.data pipeline or two)
RSS_MB = 300.0  # the split is kilobytes; a case that grows the process this much leaks
# TensorFlow's TFRecord reader allocates a record's declared length before reading it:
# a length whose CRC matches it and that the host cannot allocate ends the process
# (SIGSEGV; measured: 2**32 gives DataLossError, 2**40 crashes). Storage damage cannot
# make one (the length's CRC fails first, but for 1 in 2**32); verify finds it (the
# default "full" check, and "records"), and so does `train --verify-data full` before
# the first read. Such a case is checked up to verify; the reader is not run on it.
# From 2**63 on the length reads as negative and TensorFlow refuses it.
CRASHING_LENGTHS = (2 ** 33, 2 ** 63)
_SPEED = speed_factor()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    split = tmp_path_factory.mktemp("pristine") / "train"
    manifest = write_split_records(str(split), SIZES, chunk_size=4, size=(16, 16))
    manifest.update(job="tfaploss.pipelines.folder", split="train",
                    options={"input_dir": "photos", "output_dir": "records"},
                    checksums=framing.manifest_checksums(str(split), list(FILES.values())),
                    label_map={str(k): f"c{k}" for k in SIZES})
    (split / "manifest.json").write_text(json.dumps(manifest))
    return split


def _frames(data: bytes) -> list[tuple[int, int]]:
    out, offset = [], 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        out.append((offset, length))
        offset += 16 + length
    return out


def _masked_crc(data: bytes) -> bytes:
    return struct.pack("<I", framing.masked_crc(data))


def _framed(payloads) -> bytes:
    out = []
    for payload in payloads:
        length = struct.pack("<Q", len(payload))
        out += [length, _masked_crc(length), payload, _masked_crc(payload)]
    return b"".join(out)


@st.composite
def damaged(draw, data: bytes):
    """``(damaged bytes, what was done, whether TensorFlow's reader survives it)``: one
    mutation of a shard (module docstring). The last is ``"rewritten"`` when the
    manifest's checksums are to be written over the damage (the reader survives)."""
    frames = _frames(data)
    kind = draw(st.sampled_from(["flip", "cut", "length", "crc", "payload"]))
    b = bytearray(data)
    if kind == "flip":
        spots = draw(st.lists(st.tuples(st.integers(0, len(b) - 1), st.integers(0, 7)),
                              min_size=1, max_size=4))
        for at, bit in spots:
            b[at] ^= 1 << bit
        return bytes(b), f"flip {len(spots)} bit(s) from byte {spots[0][0]}", True
    if kind == "cut":
        at = draw(st.integers(0, len(b) - 1))
        return bytes(b[:at]), f"cut at {at} of {len(b)}", True
    index = draw(st.integers(0, len(frames) - 1))
    offset, length = frames[index]
    if kind == "length":
        new = draw(st.sampled_from([0, 1, length - 1, length + 1, 2 ** 32, 2 ** 63,
                                    2 ** 64 - 1]) | st.integers(0, 2 ** 64 - 1))
        struct.pack_into("<Q", b, offset, new)
        fixed = draw(st.booleans())
        if fixed:
            b[offset + 8:offset + 12] = _masked_crc(bytes(b[offset:offset + 8]))
        survives = not (fixed and CRASHING_LENGTHS[0] <= new < CRASHING_LENGTHS[1])
        return (bytes(b), f"record {index} length {length} -> {new}{' (CRC fixed)' * fixed}",
                survives)
    if kind == "crc":
        which = draw(st.sampled_from(["length", "data"]))
        at = offset + 8 if which == "length" else offset + 12 + length
        struct.pack_into("<I", b, at, draw(st.integers(0, 2 ** 32 - 1)))
        return bytes(b), f"record {index} {which} CRC rewritten", True
    payloads = [data[o + 12:o + 12 + n] for o, n in frames]
    payload = bytearray(payloads[index])
    how = draw(st.sampled_from(["flip", "cut", "extend", "image"]))
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            payload[draw(st.integers(0, len(payload) - 1))] ^= 1 << draw(st.integers(0, 7))
    elif how == "cut":
        payload = payload[:draw(st.integers(0, len(payload) - 1))]
    elif how == "extend":
        payload += draw(st.binary(min_size=1, max_size=64))
    else:  # bytes of an image overwritten: the Example still parses
        start = bytes(payload).find(b"\xff\xd8\xff")
        at = draw(st.integers(start, len(payload) - 1))
        new = draw(st.binary(min_size=1, max_size=8))
        payload[at:at + len(new)] = new[:len(payload) - at]
    payloads[index] = bytes(payload)
    return (_framed(payloads), f"record {index} payload {how}, framing made valid",
            "rewritten" if draw(st.booleans()) else True)


def _rewrite_checksums(split: str) -> None:
    manifest_path = os.path.join(split, "manifest.json")
    with open(manifest_path, encoding="utf-8") as f:
        manifest = json.load(f)
    manifest["checksums"] = framing.manifest_checksums(split, list(FILES.values()))
    with open(manifest_path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)


def _verify(split: str) -> tuple[int, str]:
    """``tfaploss verify SPLIT --records``: exit status and what it wrote."""
    from tfaploss import cli

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger = logging.getLogger("tfaploss")
    logger.addHandler(handler)
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            status = cli.main(["verify", split, "--records"])
    finally:
        logger.removeHandler(handler)
    return status, out.getvalue()


def _read(split: str, layout: str):
    """Read the split as a run does: the start-up size check, then the reader."""
    from tfaploss.data import make_eval_dataset, make_train_dataset

    I.check_or_raise(split, "sizes", layouts=(layout,), what="checking the data")
    with I.reading(split, what="reading"):
        if layout == "images":
            for _ in make_eval_dataset(split, image_size=16, batch_size=4):
                pass
        else:
            for _ in make_train_dataset(split, batch_size=4, m=2, image_size=16).take(8):
                pass


@pytest.mark.parametrize("layout", sorted(FILES))
@settings(max_examples=examples("records"))
@given(data=st.data())
def test_a_damaged_shard_is_named_or_read(pristine, layout, data):
    sound = (pristine / FILES[layout]).read_bytes()
    mutated, what, reader_survives = data.draw(damaged(sound))
    if reader_survives == "rewritten":
        what += ", manifest checksums rewritten"
    with tempfile.TemporaryDirectory() as folder, harness.case(
            "records", soft_s=SOFT_S * _SPEED, rss_mb=RSS_MB, label=f"{layout}: {what}") as case:
        split = os.path.join(folder, "train")
        shutil.copytree(pristine, split)
        path = os.path.join(split, FILES[layout])
        with open(path, "wb") as f:
            f.write(mutated)
        if reader_survives == "rewritten":  # the writer's checksum of what it wrote
            _rewrite_checksums(split)

        verdicts = {}
        for level in ("full", "records"):
            report = I.check_split(split, level)
            assert [d.path for d in report.damaged] in ([], [path]), (what, level, report)
            verdicts[level] = not report.ok
        assert verdicts["records"] >= verdicts["full"], what  # records checks more
        status, output = _verify(split)
        assert status == (2 if verdicts["records"] else 0), (what, status, output)
        assert (path in output) == verdicts["records"], (what, output)
        assert "Traceback" not in output, output
        if verdicts["records"]:
            with pytest.raises(I.DamagedDataError) as err:
                I.check_or_raise(split, "records")
            assert err.value.path == path and path in str(err.value), (what, err.value)

        if not reader_survives:
            case.outcome = "verify only (a length TensorFlow's reader crashes on)"
            return
        try:
            _read(split, layout)
            case.outcome = "read" if not verdicts["records"] else "read, verify refused"
            return
        except I.DamagedDataError as err:
            message = str(err)
            case.outcome = "DamagedDataError"
        assert path in message and "\n" not in message, (what, message)
        # A record that verify passes reads, unless its image does not decode.
        if not verdicts["records"]:
            assert "decode" in message, (what, message)
            case.outcome = "DamagedDataError (image)"
