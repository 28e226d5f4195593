"""Damaged record files, as a class: every crafted variant is found, named and stopped.

Each variant damages one shard of a small split (``tests.support.miniature``): bytes
flipped in a record's payload, length or CRCs; the file truncated mid-payload,
mid-header or exactly between two records; emptied; replaced by a JPEG, a text or a
gzip-compressed copy; or one record rewritten with valid framing but a missing feature,
a feature of another type, a label that is negative or outside the manifest's classes,
an empty or non-image ``image/encoded``. For each: ``tfaploss verify``'s check finds it,
and reading the split (evaluation, the samplers) ends in ONE ``DamagedDataError`` naming
the file, where in it, who wrote it and how to rebuild it, or (for the damage
TensorFlow's reader does not notice: a copy truncated between records, an empty file)
the start-up size check catches it first.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import struct

import pytest

tf = pytest.importorskip("tensorflow")

from tests.support.miniature import write_split_records
from tfaploss.data import framing
from tfaploss.data import integrity as I

SIZES = {0: 6, 1: 6, 2: 6, 3: 6}
IMAGES = "images-00000-of-00001.tfrecord"
CLASSES = os.path.join("by_class", "classes-00000-of-00001.tfrecord")
JOB = {"job": "tfaploss.pipelines.folder", "split": "train",
       "options": {"input_dir": "photos", "output_dir": "records", "verbose": False,
                   "by_class": "train", "class_chunk_size": 4}}


def _frames(data: bytes) -> list[tuple[int, int]]:
    """(offset, length) of each record of a TFRecord file's bytes."""
    out, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        out.append((offset, length))
        offset += 16 + length
    return out


def _frame(payload: bytes) -> bytes:
    length = struct.pack("<Q", len(payload))
    def masked(b):
        return struct.pack("<I", framing.masked_crc(b))

    return length + masked(length) + payload + masked(payload)


def _flip(data: bytes, at: int, n: int = 2) -> bytes:
    b = bytearray(data)
    for i in range(at, at + n):
        b[i] ^= 0x5A
    return bytes(b)


def _example(**features) -> bytes:
    f = {}
    for key, (kind, values) in features.items():
        if kind == "bytes":
            f[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
        elif kind == "int":
            f[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=values))
        else:
            f[key] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
    return tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString()


def _replace_record(data: bytes, index: int, payload: bytes) -> bytes:
    frames = _frames(data)
    start, length = frames[index]
    return data[:start] + _frame(payload) + data[start + 16 + length:]


def _image_record(data: bytes, index: int) -> dict:
    start, length = _frames(data)[index]
    ex = tf.train.Example.FromString(data[start + 12:start + 12 + length])
    return {k: v for k, v in ex.features.feature.items()}


def _rewritten(change):
    """A variant rewriting record 2 of the images shard with ``change(features)``."""
    def damage(data: bytes) -> bytes:
        feats = _image_record(data, 2)
        jpeg = feats["image/encoded"].bytes_list.value[0]
        fields = {"image/encoded": ("bytes", [jpeg]), "image/id": ("bytes", [b"0/2"]),
                  "image/class/label": ("int", [0])}
        change(fields)
        return _replace_record(data, 2, _example(**fields))
    return damage


def _length_past_the_end(data: bytes) -> bytes:
    """Record 1's length set past 2**63 with its CRC made to match: TensorFlow's reader
    then fails with "Can't read a negative number of bytes"."""
    b = bytearray(data)
    offset = _frames(data)[1][0]
    struct.pack_into("<Q", b, offset, 2 ** 63 + 5)
    b[offset + 8:offset + 12] = struct.pack("<I", framing.masked_crc(bytes(b[offset:offset + 8])))
    return bytes(b)


def _example_cut_short(data: bytes) -> bytes:
    """Record 2's Example cut inside its image, framing valid: TensorFlow's parse error
    quotes the record, which is not UTF-8, and so is raised as a UnicodeDecodeError."""
    start, length = _frames(data)[2]
    payload = data[start + 12:start + 12 + length]
    return _replace_record(data, 2, payload[:payload.find(b"\xff\xd8\xff") + 40])


def _huffman_table_broken(data: bytes, index: int = 2) -> bytes:
    """Record ``index``'s JPEG with its Huffman table overwritten, framing and features
    valid: only decoding the image finds it."""
    start, length = _frames(data)[index]
    payload = bytearray(data[start + 12:start + 12 + length])
    table = bytes(payload).find(b"\xff\xc4")
    payload[table + 4:table + 20] = b"\xff" * 16
    return _replace_record(data, index, bytes(payload))


def _text(_):
    return b"just some notes, saved under the wrong name\n" * 40


def _jpeg(data):
    return b"\xff\xd8\xff\xe0\x00\x10JFIF" + bytes(range(256)) * 4


# name -> (what it does to the images shard's bytes, the layout it damages)
FRAMING = {
    "payload bytes flipped": lambda d: _flip(d, _frames(d)[2][0] + 40),
    "length bytes flipped": lambda d: _flip(d, _frames(d)[1][0] + 2),
    "length CRC flipped": lambda d: _flip(d, _frames(d)[1][0] + 9),
    "data CRC flipped": lambda d: _flip(d, _frames(d)[1][0] + 12 + _frames(d)[1][1] + 1),
    "truncated mid-payload": lambda d: d[:_frames(d)[3][0] + 100],
    "truncated mid-header": lambda d: d[:_frames(d)[3][0] + 5],
    "truncated between records": lambda d: d[:_frames(d)[3][0]],
    "truncated to one byte": lambda d: d[:1],
    "zero-length": lambda d: b"",
    "a JPEG renamed": _jpeg,
    "a text file renamed": _text,
    "gzip-compressed": gzip.compress,
    "not an Example": lambda d: _replace_record(d, 2, b"\x00\xff" * 30),
    "an Example cut short, not UTF-8": _example_cut_short,
    "length past 2**63, its CRC matching": _length_past_the_end,
}
FEATURES = {
    "image/encoded missing": _rewritten(lambda f: f.pop("image/encoded")),
    "image/id missing": _rewritten(lambda f: f.pop("image/id")),
    "label of type float": _rewritten(lambda f: f.update({"image/class/label": (
        "float", [1.0])})),
    "image/encoded of type int": _rewritten(lambda f: f.update({"image/encoded": (
        "int", [7])})),
    "label negative": _rewritten(lambda f: f.update({"image/class/label": ("int", [-5])})),
    "label out of map": _rewritten(lambda f: f.update({"image/class/label": ("int", [99])})),
    "label not a manifest class": _rewritten(lambda f: f.update({"image/class/label": (
        "int", [4])})),
    "two labels": _rewritten(lambda f: f.update({"image/class/label": ("int", [0, 1])})),
    "empty image/encoded": _rewritten(lambda f: f.update({"image/encoded": (
        "bytes", [b""])})),
    "image/encoded not an image": _rewritten(lambda f: f.update({"image/encoded": (
        "bytes", [b"<html>not found</html>"])})),
}
VARIANTS = {**FRAMING, **FEATURES}
# What TensorFlow's reader takes for a shorter, valid file: caught by sizes alone.
SILENT = {"truncated mid-header", "truncated between records", "truncated to one byte",
          "zero-length"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A split as the pipelines write it: records, manifest with job, options and the
    checksums of every file."""
    split = tmp_path_factory.mktemp("pristine") / "train"
    manifest = write_split_records(str(split), SIZES, chunk_size=4, size=(16, 16))
    # class 4 is left out of the class list; the images' labels stay 0..3
    manifest.update(JOB, checksums=framing.manifest_checksums(str(split), [IMAGES, CLASSES]),
                    label_map={str(k): f"c{k}" for k in SIZES})
    (split / "manifest.json").write_text(json.dumps(manifest))
    return split


def _damaged(pristine, tmp_path, variant: str, name: str = IMAGES):
    split = tmp_path / "train"
    shutil.copytree(pristine, split)
    path = split / name
    path.write_bytes(VARIANTS[variant](path.read_bytes()))
    return split, path


def _assert_one_message(err: I.DamagedDataError, path, *, located=True):
    text = str(err)
    assert str(path) in text, text
    assert "written by tfaploss.pipelines.folder (split train)" in text, text
    assert "rebuild it: python -m tfaploss.pipelines.folder" in text and "--input_dir photos" in text
    assert "\n" not in text and "Traceback" not in text and "function_node" not in text
    if located:
        assert err.record is not None or err.offset is not None or "bytes" in err.problem


def test_pristine_split_passes_every_level(pristine):
    for level in ("sizes", "full", "records"):
        report = I.check_split(str(pristine), level)
        assert report.ok, [d.line() for d in report.damaged]
        assert len(report.checked) == 2 and not report.notes
    assert framing.file_checksum(str(pristine / IMAGES))["records"] == sum(SIZES.values())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_verify_finds_every_variant(pristine, tmp_path, variant):
    split, path = _damaged(pristine, tmp_path, variant)
    report = I.check_split(str(split), "records")
    assert [d.path for d in report.damaged] == [str(path)], variant
    if variant in FRAMING:  # the checksum pass alone finds those
        assert not I.check_split(str(split), "full").ok
    if variant in FRAMING or variant in FEATURES:  # a rewritten record changes the size
        sizes = I.check_split(str(split), "sizes")
        assert sizes.ok == (len(path.read_bytes()) == len(pristine.joinpath(
            IMAGES).read_bytes())), variant


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_reading_a_variant_ends_in_one_message(pristine, tmp_path, variant):
    """Evaluation's reader (``make_eval_dataset``) inside ``integrity.reading``."""
    from tfaploss.data import make_eval_dataset

    split, path = _damaged(pristine, tmp_path, variant)
    with pytest.raises(I.DamagedDataError) as err:
        if variant in SILENT:
            I.check_or_raise(str(split), "sizes", what="evaluating")
        with I.reading(str(split), what="evaluating"):
            for _ in make_eval_dataset(str(split), image_size=16, batch_size=4):
                pass
    _assert_one_message(err.value, path)


@pytest.mark.parametrize("variant", ["payload bytes flipped", "truncated mid-payload",
                                     "a JPEG renamed", "gzip-compressed", "not an Example"])
def test_the_samplers_reader_ends_in_one_message(pristine, tmp_path, variant):
    from tfaploss.data import make_train_dataset

    split, path = _damaged(pristine, tmp_path, variant, CLASSES)
    ds = make_train_dataset(str(split), batch_size=4, m=2, image_size=16)
    with pytest.raises(I.DamagedDataError) as err, I.reading(str(split), what="training"):
        for _ in ds.take(40):
            pass
    _assert_one_message(err.value, path)


@pytest.mark.parametrize("change,problem", [
    (lambda f: f.update({"class/label": ("int", [-3])}), "below 0"),
    (lambda f: f.update({"class/label": ("int", [9])}), "not among the manifest's 4"),
    (lambda f: f.update({"class/num_images": ("int", [1])}), "class/num_images is 1"),
    (lambda f: f.update({"image/encoded": ("bytes", [b"", b""])}), "image/encoded is empty"),
    (lambda f: f.update({"image/id": ("bytes", [b"0/0"])}), "image/id holds 1 ids for 3"),
])
def test_by_class_records_with_bad_features(pristine, tmp_path, change, problem):
    from tfaploss.data import make_train_dataset

    split = tmp_path / "train"
    shutil.copytree(pristine, split)
    path = split / CLASSES
    data = path.read_bytes()
    start, length = _frames(data)[0]
    ex = tf.train.Example.FromString(data[start + 12:start + 12 + length])
    feats = ex.features.feature
    fields = {"class/label": ("int", list(feats["class/label"].int64_list.value)),
              "class/num_images": ("int", list(feats["class/num_images"].int64_list.value)),
              "image/encoded": ("bytes", list(feats["image/encoded"].bytes_list.value)),
              "image/id": ("bytes", list(feats["image/id"].bytes_list.value))}
    change(fields)
    path.write_bytes(_replace_record(data, 0, _example(**fields)))
    report = I.check_split(str(split), "records")
    assert len(report.damaged) == 1 and problem in report.damaged[0].problem
    with pytest.raises(I.DamagedDataError) as err, I.reading(str(split), what="training"):
        for _ in make_train_dataset(str(split), batch_size=4, m=2, image_size=16).take(40):
            pass
    _assert_one_message(err.value, path)


@pytest.mark.parametrize("name", [IMAGES, CLASSES])
def test_an_image_that_does_not_decode_is_named_by_the_reader(pristine, tmp_path, name):
    """Framing and features sound, the image not, and the manifest's checksum written
    over it (a faulty writer): ``verify --records`` does not decode images, so only the
    reader meets it, and names the file and record after a scan that decodes them
    (check level "decode")."""
    from tfaploss.data import make_eval_dataset, make_train_dataset

    split = tmp_path / "train"
    shutil.copytree(pristine, split)
    path = split / name
    path.write_bytes(_huffman_table_broken(path.read_bytes(), 2 if name == IMAGES else 0))
    manifest = json.loads((split / "manifest.json").read_text())
    manifest["checksums"] = framing.manifest_checksums(str(split), [IMAGES, CLASSES])
    (split / "manifest.json").write_text(json.dumps(manifest))
    assert I.check_split(str(split), "records").ok
    damaged = I.check_split(str(split), "decode").damaged
    assert [d.path for d in damaged] == [str(path)]
    assert "does not decode: Invalid JPEG data" in damaged[0].problem, damaged[0].problem
    assert "[Op:" not in damaged[0].problem
    with pytest.raises(I.DamagedDataError) as err, I.reading(str(split), what="reading"):
        if name == IMAGES:
            for _ in make_eval_dataset(str(split), image_size=16, batch_size=4):
                pass
        else:
            for _ in make_train_dataset(str(split), batch_size=4, m=2, image_size=16).take(40):
                pass
    _assert_one_message(err.value, path)
    assert "does not decode" in str(err.value)


def test_an_older_manifest_without_checksums_still_loads_and_verifies(pristine, tmp_path):
    from tfaploss.data import load_split

    split = tmp_path / "train"
    shutil.copytree(pristine, split)
    manifest = json.loads((split / "manifest.json").read_text())
    del manifest["checksums"]
    (split / "manifest.json").write_text(json.dumps(manifest))
    assert sum(1 for _ in load_split(str(split), decode=False)) == sum(SIZES.values())
    report = I.check_split(str(split), "full")
    assert report.ok and "no checksums recorded" in report.notes[0]
    assert "no checksums recorded" in I.check_split(str(split), "sizes").notes[0]
    # The records' own CRCs still find a flipped byte.
    (split / IMAGES).write_bytes(VARIANTS["payload bytes flipped"]((split / IMAGES)
                                                                  .read_bytes()))
    assert not I.check_split(str(split), "full").ok


def test_a_stray_or_missing_file_disagrees_with_the_manifest(pristine, tmp_path):
    split = tmp_path / "train"
    shutil.copytree(pristine, split)
    shutil.copy(split / IMAGES, split / "images-00000-of-00002.tfrecord")
    damaged = I.check_split(str(split), "sizes").damaged
    assert len(damaged) == 1 and "not written with this manifest" in damaged[0].problem
    os.remove(split / IMAGES)
    problems = sorted(d.problem for d in I.check_split(str(split), "sizes").damaged)
    assert problems[0].startswith("missing")


def test_a_swapped_file_of_the_same_size_is_caught_by_its_checksum(pristine, tmp_path):
    split = tmp_path / "train"
    shutil.copytree(pristine, split)
    data = (split / IMAGES).read_bytes()
    frames = _frames(data)
    a, b = frames[0], frames[1]  # two valid records swapped: framing fine, order not
    assert a[1] == b[1]
    first, second = data[:16 + a[1]], data[16 + a[1]:32 + a[1] + b[1]]
    (split / IMAGES).write_bytes(second + first + data[32 + a[1] + b[1]:])
    assert I.check_split(str(split), "sizes").ok
    damaged = I.check_split(str(split), "full").damaged
    assert len(damaged) == 1 and "CRC-32C" in damaged[0].problem
    # --records checks all that the default does (each record parses here).
    damaged = I.check_split(str(split), "records").damaged
    assert len(damaged) == 1 and "CRC-32C" in damaged[0].problem


def test_the_parse_checks_cost_little(pristine):
    """The in-graph checks add a few scalar ops per record; the pristine split parses
    exactly as before (same values)."""
    from tfaploss.data import load_split

    rows = list(load_split(str(pristine), decode=False).as_numpy_iterator())
    assert [int(r["label"]) for r in rows] == [k for k, n in SIZES.items() for _ in range(n)]


def test_the_checksum_is_crc32c_of_the_whole_file(pristine):
    import zlib  # noqa: F401  (CRC-32, not C: a different polynomial)

    data = (pristine / IMAGES).read_bytes()
    entry = framing.file_checksum(str(pristine / IMAGES))
    assert entry["bytes"] == len(data)
    assert entry["crc32c"] == f"{framing.crc32c(data):08x}"
    # CRC-32C's check value
    assert framing.crc32c(b"123456789") == 0xE3069283


def test_skipping_a_by_class_file_shrinks_the_samplers_classes(pristine, tmp_path):
    """A skipped by-class file takes its classes with it: the samplers' class checks
    count only what the kept files hold, and a sampler the rest cannot fill is refused
    with one message instead of waiting forever for its first batch."""
    from types import SimpleNamespace

    from tfaploss.data import datasets as D
    from tfaploss.run.build import check_classes_left

    split = tmp_path / "train"
    shutil.copytree(pristine, split)
    data = (split / CLASSES).read_bytes()
    frames = _frames(data)  # two records (chunks of 3) per class, classes 0..3 in order
    cut = frames[4][0]
    (split / CLASSES).unlink()
    halves = ["classes-00000-of-00002.tfrecord", "classes-00001-of-00002.tfrecord"]
    (split / "by_class" / halves[0]).write_bytes(data[:cut])  # classes 0, 1
    (split / "by_class" / halves[1]).write_bytes(_flip(data[cut:], 40))  # 2, 3: damaged
    manifest = json.loads((split / "manifest.json").read_text())
    manifest["checksums"] = framing.manifest_checksums(
        str(split), [IMAGES, *(os.path.join("by_class", h) for h in halves)])
    (split / "manifest.json").write_text(json.dumps(manifest))

    skipped = I.startup_check(str(split), layout="by_class", skip=True)
    kept = skipped.pop("class_records")
    assert [s["file"] for s in skipped["shards"]] == [f"by_class/{halves[1]}"]
    assert kept == {0: 3, 1: 3} and skipped["classes_lost"] == [2, 3]
    json.dumps(skipped)  # what summary.json records

    with I.skipping([str(split / "by_class" / halves[1])], kept):
        assert sorted(D._eligible(manifest, 2)) == [0, 1]  # all_classes: 2 classes
        with pytest.raises(ValueError, match="the split has 2 once its damaged by-class"):
            D._validate_sampler(manifest, "m_per_class", batch_size=8, m=2)
    assert sorted(D._eligible(manifest, 2)) == [0, 1, 2, 3]  # outside: the manifest's

    def cfg(batch, m):
        return SimpleNamespace(data=SimpleNamespace(m=m, batch_size=batch, train=str(split),
                                                    sampler="m_per_class"))

    check_classes_left(cfg(4, 2), kept, skipped)  # two classes of two: enough
    with pytest.raises(I.DamagedDataError) as err:
        check_classes_left(cfg(8, 2), kept, skipped)
    text = str(err.value)
    assert "2 classes have a by-class record of m=2 images" in text and "needs 4" in text
    assert halves[1] in text and "rebuild it: python -m tfaploss.pipelines.folder" in text
    assert "\n" not in text
    with pytest.raises(I.DamagedDataError, match="0 classes"):
        check_classes_left(cfg(4, 4), kept, skipped)  # no kept record holds 4 images


def test_a_job_output_is_a_folder_holding_a_manifest_file(pristine, tmp_path):
    """One rule for "a job wrote this folder", which verify, evaluate and the embed job
    ask: a manifest.json file, not a folder of that name, not a manifest one level down."""
    from tfaploss.cli.verify import split_dirs
    from tfaploss.data.split_manifest import MANIFEST, is_job_output

    assert is_job_output(pristine) and os.path.isfile(os.path.join(pristine, MANIFEST))
    fake = tmp_path / "fake"
    (fake / MANIFEST).mkdir(parents=True)
    assert not is_job_output(str(fake)) and not is_job_output(str(tmp_path / "absent"))
    out = tmp_path / "out"
    shutil.copytree(pristine, out / "train")
    (out / "notes").mkdir()
    assert not is_job_output(str(out))
    assert split_dirs(str(out)) == [str(out / "train")]
    assert split_dirs(str(out / "train")) == [str(out / "train")]
    with pytest.raises(FileNotFoundError, match="holds no manifest.json"):
        split_dirs(str(fake))
