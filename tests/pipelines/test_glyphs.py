"""The glyphs job end to end on the fonts matplotlib ships (DejaVu, STIX).

The font folder holds: DejaVu Sans, a byte-for-byte copy of it (its glyphs are the same
outlines as the original's), STIX General (it lacks most of U+0181-U+0189), a ``.ttc``
collection built from DejaVu Sans Bold and DejaVu Sans Mono (both faces must be used),
DejaVu Serif in a subfolder, random bytes and a truncated font named ``.ttf`` (dead
letters), and, ignored, a ``README.txt``, a font in a hidden folder and a symlink to
DejaVu Sans. U+2800 (Braille blank) is an empty outline in every DejaVu face that has
it.
"""

import json
import os
import random
import shutil

import matplotlib
import numpy as np
import pytest
from fontTools.ttLib import TTFont
from fontTools.ttLib.ttCollection import TTCollection

from tests.support import miniature as mini
from tfaploss.pipelines import glyph_render as G
from tfaploss.pipelines import glyphs
from tfaploss.pipelines import runner as R

FONT_DIR = os.path.join(matplotlib.get_data_path(), "fonts", "ttf")
CHARSET = "U+0041-U+0043,U+0180-U+0189,U+2800"
CANVAS = 24
BASE = ["--charset", CHARSET, "--min_coverage", "0.8", "--test_fraction", "0.4",
        "--val_fraction", "0.2", "--canvas_size", str(CANVAS),
        "--direct_running_mode", "in_memory"]

SANS, STIX, COPY = "DejaVuSans.ttf#0", "STIXGeneral.ttf#0", "copy/DejaVuSans.ttf#0"
BOLD, MONO, SERIF = "pair.ttc#0", "pair.ttc#1", "serif/DejaVuSerif.ttf#0"
STIX_LACKS = [0x0181, 0x0182, 0x0183, 0x0184, 0x0185, 0x0186, 0x0187, 0x0189]
KEPT = [0x41, 0x42, 0x43, *range(0x0180, 0x018A)]


def _face(face_id):
    rel, index = face_id.rsplit("#", 1)
    return rel, int(index)


@pytest.fixture(scope="module")
def fonts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fonts")
    shutil.copy(os.path.join(FONT_DIR, "DejaVuSans.ttf"), root / "DejaVuSans.ttf")
    (root / "copy").mkdir()
    shutil.copy(os.path.join(FONT_DIR, "DejaVuSans.ttf"), root / "copy" / "DejaVuSans.ttf")
    shutil.copy(os.path.join(FONT_DIR, "STIXGeneral.ttf"), root / "STIXGeneral.ttf")
    (root / "serif").mkdir()
    shutil.copy(os.path.join(FONT_DIR, "DejaVuSerif.ttf"), root / "serif" / "DejaVuSerif.ttf")
    pair = TTCollection()
    pair.fonts = [TTFont(os.path.join(FONT_DIR, n))
                  for n in ("DejaVuSans-Bold.ttf", "DejaVuSansMono.ttf")]
    pair.save(str(root / "pair.ttc"))
    (root / "broken.ttf").write_bytes(random.Random(0).randbytes(4000))
    with open(os.path.join(FONT_DIR, "DejaVuSerif-Bold.ttf"), "rb") as f:
        whole = f.read()
    (root / "truncated.ttf").write_bytes(whole[: len(whole) * 3 // 5])
    (root / "README.txt").write_text("fonts for the glyph tests\n")
    (root / ".cache").mkdir()
    shutil.copy(os.path.join(FONT_DIR, "DejaVuSerif.ttf"), root / ".cache" / "x.ttf")
    os.symlink("DejaVuSans.ttf", root / "link.ttf")
    # What the expectations below assume about the fonts' cmaps.
    for face_id, lacks in ((STIX, STIX_LACKS + [0x2800]), (MONO, [0x2800]), (SANS, [])):
        rel, index = _face(face_id)
        path = str(root / rel)
        font = (TTCollection(path).fonts[index] if rel.endswith(".ttc") else TTFont(path))
        cmap = font.getBestCmap()
        assert [cp for cp in KEPT + [0x2800] if cp not in cmap] == lacks, face_id
    return str(root)


def _code_point(label_text):
    """``"U+0181 Ɓ"`` (a label_map value) -> 0x181."""
    return int(label_text.split()[0].replace("U+", ""), 16)


def _read_ignored(split_dir):
    path = os.path.join(split_dir, "ignored_files.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def run(fonts, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("glyphs_out"))
    # The 2 dead letters are more than --max_failure_fraction (1 %) of train's inputs:
    # the job raises after writing every split.
    with pytest.raises(R.TooManyFailuresError, match="train: 2 of "):
        glyphs.run(["--input_dir", fonts, "--output_dir", out, *BASE])
    splits = {}
    for split in ("train", "val", "test"):
        d = os.path.join(out, split)
        with open(os.path.join(d, "manifest.json")) as f:
            manifest = json.load(f)
        splits[split] = {"manifest": manifest, "records": mini.read_examples(d),
                         "dead": mini.read_dead_letters(d), "ignored": _read_ignored(d)}
    return out, splits


def _expected_faces(cp):
    """The faces that give an image of ``cp`` (the copy repeats DejaVu Sans)."""
    faces = [SANS, BOLD, MONO, SERIF]
    return sorted(faces if cp in STIX_LACKS else faces + [STIX])


def test_class_splits_are_disjoint_with_contiguous_labels_and_counts(run):
    _, splits = run
    chars = {}
    for split, s in splits.items():
        m = s["manifest"]
        cps = [_code_point(v) for _, v in sorted(m["label_map"].items(),
                                                 key=lambda kv: int(kv[0]))]
        assert cps == sorted(cps)  # labels in code-point order
        assert m["label_map"] == {str(i): f"U+{cp:04X} {chr(cp)}" for i, cp in enumerate(cps)}
        chars[split] = set(cps)
        labels = {r["image/class/label"][0] for r in s["records"]}
        assert labels == set(range(len(cps)))
        got = {}
        for r in s["records"]:
            label = r["image/class/label"][0]
            assert r["image/class/text"][0].decode() == chr(cps[label])
            char_id, face_id = r["image/id"][0].decode().split("/", 1)
            assert char_id == f"U+{cps[label]:04X}"
            assert r["image/path"][0].decode() == _face(face_id)[0]
            got.setdefault(cps[label], []).append(face_id)
        assert {cp: sorted(f) for cp, f in got.items()} == {
            cp: _expected_faces(cp) for cp in cps}
        assert m["num_images"] == len(s["records"]) == sum(len(_expected_faces(cp))
                                                           for cp in cps)
        assert m["num_classes"] == len(cps)
        assert m["class_counts"] == {str(i): len(_expected_faces(cp))
                                     for i, cp in enumerate(cps)}
        faces = {f["face"]: f["images"] for f in m["glyphs"]["faces"]}
        assert sum(faces.values()) == m["num_images"]
        assert faces[MONO] > 0 and faces[BOLD] > 0  # both faces of the collection
    assert not chars["train"] & chars["val"] and not chars["train"] & chars["test"]
    assert not chars["val"] & chars["test"]
    assert chars["train"] | chars["val"] | chars["test"] == set(KEPT)
    # 13 characters: round(0.4 * 13) test, round(0.2 * 13) val, the rest train.
    assert [len(chars[s]) for s in ("train", "val", "test")] == [5, 3, 5]
    assert splits["train"]["manifest"]["by_class"] and splits["val"]["manifest"]["by_class"]
    assert splits["test"]["manifest"]["by_class"] is None
    by_class = mini.read_examples(os.path.join(run[0], "val"), layout="by_class")
    assert sum(len(c["image/id"]) for c in by_class) == splits["val"]["manifest"]["num_images"]


def test_missing_and_empty_glyphs_are_ignored_with_their_reason(run):
    _, splits = run
    pairs = {}
    for s in splits.values():
        for d in s["ignored"]:
            if "char" in d:
                key = (d["char"], f"{d['path']}#{d['face']}")
                assert key not in pairs
                pairs[key] = (d["reason"], d.get("same_as"))
    ids = {r["image/id"][0].decode() for s in splits.values() for r in s["records"]}
    want = {}
    for cp in STIX_LACKS:
        want[(f"U+{cp:04X}", STIX)] = ("not in cmap", None)
    for cp in KEPT:
        want[(f"U+{cp:04X}", COPY)] = ("same outline as another face", SANS)
    # U+2800: an empty outline in every face taking part in its range (Mono and STIX
    # have no character of it), so the character has no image and is dropped.
    for face in (SANS, COPY, BOLD, SERIF):
        want[("U+2800", face)] = ("empty outline", None)
    assert pairs == want
    for char, face in pairs:
        assert f"{char}/{face}" not in ids  # no image for an ignored pair
    assert not any(i.startswith("U+2800/") for i in ids)
    # A character's pairs are listed with its split; U+2800, in none, with train.
    for s in splits.values():
        own = {f"U+{_code_point(v):04X}" for v in s["manifest"]["label_map"].values()}
        for d in s["ignored"]:
            if "char" in d and d["char"] != "U+2800":
                assert d["char"] in own
    assert {d["char"] for d in splits["train"]["ignored"] if d.get("char") == "U+2800"}


def test_every_file_ends_up_in_exactly_one_place(fonts, run):
    _, splits = run
    train = splits["train"]
    dead = {d["path"]: d["reason"] for d in train["dead"]}
    assert dead == {"broken.ttf": "undecodable", "truncated.ttf": "truncated"}
    assert train["manifest"]["failures_by_reason"] == {"truncated": 1, "undecodable": 1}
    file_level = {d["path"]: d["reason"] for d in train["ignored"] if "face" not in d}
    assert file_level == {"README.txt": "not a font file (.ttf, .otf, .ttc, .otc)",
                          ".cache/x.ttf": "inside .cache/: name starts with '.' (hidden)",
                          "link.ttf": "same file as DejaVuSans.ttf"}
    used = {r["image/path"][0].decode() for s in splits.values() for r in s["records"]}
    used |= {d["path"] for s in splits.values() for d in s["ignored"] if "face" in d}
    on_disk = {os.path.relpath(os.path.join(d, n), fonts)
               for d, _, files in os.walk(fonts) for n in files}
    places = [set(dead), set(file_level), used]
    assert set().union(*places) == on_disk
    assert sum(map(len, places)) == len(on_disk)  # disjoint
    for split in ("val", "test"):
        assert splits[split]["dead"] == []
        assert all("char" in d for d in splits[split]["ignored"])


def test_images_are_centred_black_on_white_and_never_cropped(run):
    _, splits = run
    for s in splits.values():
        for r in s["records"]:
            img = mini.decode(r["image/encoded"][0]).astype(int)
            assert img.shape == (CANVAS, CANVAS, 3)
            assert r["image/height"][0] == r["image/width"][0] == CANVAS
            gray = img.mean(axis=2)
            ink = np.argwhere(gray < 128)
            assert len(ink) > 0
            # Nothing touches the canvas edge, and the background is white.
            assert gray[0].min() > 200 and gray[-1].min() > 200
            assert gray[:, 0].min() > 200 and gray[:, -1].min() > 200
            assert np.median(gray) > 240
            (y0, x0), (y1, x1) = ink.min(axis=0), ink.max(axis=0)
            # centred on the ink, up to the shift jitter (0.04 canvas) and JPEG noise
            assert abs((x0 + x1) / 2 - (CANVAS - 1) / 2) <= 0.04 * CANVAS + 1.5
            assert abs((y0 + y1) / 2 - (CANVAS - 1) / 2) <= 0.04 * CANVAS + 1.5


def test_rerun_writes_the_same_bytes(fonts, run, tmp_path):
    out, _ = run
    before = mini.snapshot(out)
    assert any(p.endswith(".tfrecord") for p in before)
    with pytest.raises(R.TooManyFailuresError):
        glyphs.run(["--input_dir", fonts, "--output_dir", out, *BASE])
    after = mini.snapshot(out)
    assert sorted(after) == sorted(before)
    for path in before:  # every file, manifests included
        assert after[path] == before[path], path


@pytest.mark.slow
def test_jitter_is_deterministic_per_seed_and_differs_across_seeds(fonts, tmp_path):
    kw = {"scale": 0.15, "shift": 0.04, "stroke": 1.0}
    a = G.jitter(0, SANS, 0x41, **kw)
    assert a == G.jitter(0, SANS, 0x41, **kw)
    assert a != G.jitter(1, SANS, 0x41, **kw)
    assert a != G.jitter(0, SERIF, 0x41, **kw) and a != G.jitter(0, SANS, 0x42, **kw)
    assert 0.85 <= a["scale"] <= 1 and abs(a["shift_x"]) <= 0.04 and 0 <= a["stroke"] <= 1
    path = os.path.join(fonts, "DejaVuSans.ttf")

    def png(seed, cp=0x41):
        return G.render_png(path, 0, cp, canvas=32, margin=0.08, **G.jitter(seed, SANS, cp, **kw))

    assert png(0) == png(0)
    assert len({png(seed) for seed in range(4)}) == 4
    # The job: the same images for the same seed (test above), others for another.
    out = str(tmp_path / "seed1")
    with pytest.raises(R.TooManyFailuresError):
        glyphs.run(["--input_dir", fonts, "--output_dir", out, *BASE, "--seed", "1"])
    first = {r["image/id"][0]: r["image/encoded"][0]
             for r in mini.read_examples(os.path.join(out, "test"))}
    assert len(first) > 0
    with pytest.raises(R.TooManyFailuresError):
        glyphs.run(["--input_dir", fonts, "--output_dir", str(tmp_path / "seed2"), *BASE,
                    "--seed", "2"])
    second = {r["image/id"][0]: r["image/encoded"][0]
              for s in ("train", "val", "test")
              for r in mini.read_examples(str(tmp_path / "seed2" / s))}
    assert set(first) <= set(second)  # the same 13 characters, split otherwise
    # Two draws can round to the same pixels on a 24-pixel canvas, but rarely.
    assert sum(first[i] != second[i] for i in first) >= 0.9 * len(first)


@pytest.mark.parametrize("argv, message", [
    (["--min_coverage", "1.5"], "--min_coverage must be in (0, 1], got 1.5"),
    (["--charset", "nonsense"], "--charset: unknown character set 'nonsense' in 'nonsense'"),
    (["--charset", "latin,U+0050-U+0041"], "--charset: range 'U+0050-U+0041' is empty"),
    (["--val_fraction", "-0.1"], "--val_fraction must be in [0, 1), got -0.1"),
    (["--test_fraction", "0.6", "--val_fraction", "0.5"],
     ("--test_fraction + --val_fraction must be below 1 (the rest is train), got "
      "0.6 + 0.5 = 1.1")),
    (["--max_classes", "-3"], "--max_classes must be >= 0 (0: all), got -3"),
])
def test_bad_arguments_name_the_argument_and_value(fonts, tmp_path, argv, message):
    with pytest.raises(ValueError) as info:
        glyphs.run(["--input_dir", fonts, "--output_dir", str(tmp_path), *argv])
    assert message in str(info.value)
    assert not os.listdir(tmp_path)  # refused before writing anything
    assert R.main_wrapper(glyphs.run, ["--input_dir", fonts, "--output_dir",
                                       str(tmp_path), *argv]) == 2


def _odd_font(path):
    """A font worse than any shipped one: A is a triangle, B draws the .notdef box, C a
    contour of zero area (points on a line), D nothing, E maps to .notdef, and F's
    glyph data is corrupt (it claims 32767 contours)."""
    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.ttGlyphPen import TTGlyphPen

    def glyph(*contours):
        pen = TTGlyphPen(None)
        for points in contours:
            pen.moveTo(points[0])
            for p in points[1:]:
                pen.lineTo(p)
            pen.closePath()
        return pen.glyph()

    box = ([(50, 0), (50, 700), (450, 700), (450, 0)],
           [(100, 50), (400, 50), (400, 650), (100, 650)])
    glyphs_ = {".notdef": glyph(*box), "A": glyph([(0, 0), (250, 700), (500, 0)]),
               "B": glyph(*box), "C": glyph([(100, 100), (300, 300), (500, 500)]),
               "D": glyph(), "F": glyph([(0, 0), (250, 700), (500, 0)])}
    fb = FontBuilder(1000, isTTF=True)
    fb.setupGlyphOrder(list(glyphs_))
    fb.setupCharacterMap({0x41: "A", 0x42: "B", 0x43: "C", 0x44: "D", 0x45: ".notdef",
                          0x46: "F"})
    fb.setupGlyf(glyphs_)
    fb.setupHorizontalMetrics({name: (600, 0) for name in glyphs_})
    fb.setupHorizontalHeader(ascent=800, descent=-200)
    fb.setupNameTable({"familyName": "Odd", "styleName": "Regular"})
    fb.setupOS2()
    fb.setupPost()
    fb.save(path)
    font = TTFont(path)
    at = font.reader.tables["glyf"].offset + font["loca"][font.getGlyphID("F")]
    font.close()
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\x7f\xff")


def test_tofu_zero_area_and_empty_glyphs_of_a_made_up_font(tmp_path):
    fonts = tmp_path / "fonts"
    fonts.mkdir()
    shutil.copy(os.path.join(FONT_DIR, "DejaVuSans.ttf"), fonts / "DejaVuSans.ttf")
    shutil.copy(os.path.join(FONT_DIR, "DejaVuSerif.ttf"), fonts / "DejaVuSerif.ttf")
    _odd_font(str(fonts / "odd.ttf"))
    out = tmp_path / "out"
    manifests = glyphs.run(["--input_dir", str(fonts), "--output_dir", str(out),
                            "--charset", "U+0041-U+0046", "--min_coverage", "0.5",
                            "--test_fraction", "0.5", "--val_fraction", "0",
                            "--canvas_size", str(CANVAS), "--max_failure_fraction", "0.5",
                            "--direct_running_mode", "in_memory"])
    assert sorted(manifests) == ["test", "train"] and not (out / "val").exists()
    ignored = [d for s in ("train", "test") for d in _read_ignored(str(out / s))]
    assert sorted((d["char"], d["path"], d["reason"]) for d in ignored) == [
        ("U+0042", "odd.ttf", "same outline as .notdef"),
        ("U+0043", "odd.ttf", "no ink when rendered"),
        ("U+0044", "odd.ttf", "empty outline"),
        # A cmap entry pointing at glyph 0 means "missing" in the cmap formats.
        ("U+0045", "odd.ttf", "not in cmap")]
    ids = sorted(r["image/id"][0].decode() for s in ("train", "test")
                 for r in mini.read_examples(str(out / s)))
    assert ids == ["U+0041/DejaVuSans.ttf#0", "U+0041/DejaVuSerif.ttf#0", "U+0041/odd.ttf#0",
                   "U+0042/DejaVuSans.ttf#0", "U+0042/DejaVuSerif.ttf#0",
                   "U+0043/DejaVuSans.ttf#0", "U+0043/DejaVuSerif.ttf#0",
                   "U+0044/DejaVuSans.ttf#0", "U+0044/DejaVuSerif.ttf#0",
                   "U+0045/DejaVuSans.ttf#0", "U+0045/DejaVuSerif.ttf#0",
                   "U+0046/DejaVuSans.ttf#0", "U+0046/DejaVuSerif.ttf#0"]
    # The corrupt glyph is a dead letter of its character's split; the file's other
    # glyphs are used.
    dead = [d for s in ("train", "test") for d in mini.read_dead_letters(str(out / s))]
    assert [(d["id"], d["path"], d["reason"]) for d in dead] == [
        ("U+0046/odd.ttf#0", "odd.ttf", "undecodable")]
    assert sum(m["num_failures"] for m in manifests.values()) == 1
    # The odd font's glyphs would have rendered: the box, and nothing at all.
    box = G.render(str(fonts / "odd.ttf"), 0, 0x42, canvas=CANVAS, margin=0.08)
    assert np.asarray(box).min() < 50
    with pytest.raises(G.I.ImageError, match="no_ink"):
        G.render(str(fonts / "odd.ttf"), 0, 0x43, canvas=CANVAS, margin=0.08)


def _cff_font(path, name):
    """A CFF-flavoured OpenType font: A a triangle, B the .notdef box, D nothing."""
    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.t2CharStringPen import T2CharStringPen

    def charstring(*contours):
        pen = T2CharStringPen(600, None)
        for points in contours:
            pen.moveTo(points[0])
            for p in points[1:]:
                pen.lineTo(p)
            pen.closePath()
        return pen.getCharString()

    box = ([(50, 0), (50, 700), (450, 700), (450, 0)],
           [(100, 50), (400, 50), (400, 650), (100, 650)])
    charstrings = {".notdef": charstring(*box), "A": charstring([(0, 0), (250, 700), (500, 0)]),
                   "B": charstring(*box), "D": charstring()}
    fb = FontBuilder(1000, isTTF=False)
    fb.setupGlyphOrder(list(charstrings))
    fb.setupCharacterMap({0x41: "A", 0x42: "B", 0x44: "D"})
    fb.setupCFF(name, {"FullName": name}, charstrings, {})
    fb.setupHorizontalMetrics({n: (600, 0) for n in charstrings})
    fb.setupHorizontalHeader(ascent=800, descent=-200)
    fb.setupNameTable({"familyName": name, "styleName": "Regular"})
    fb.setupOS2()
    fb.setupPost()
    fb.save(path)


def test_cff_outlines_and_collections_sharing_one_cff_table(tmp_path):
    from tfaploss.pipelines import fonts as F

    _cff_font(str(tmp_path / "a.otf"), "Aaa")
    # Two faces with the same tables: the collection stores the CFF table once.
    pair = TTCollection()
    pair.fonts = [TTFont(str(tmp_path / "a.otf")), TTFont(str(tmp_path / "a.otf"))]
    pair.save(str(tmp_path / "pair.otc"))
    with F.FontFile(str(tmp_path / "pair.otc"), "pair.otc") as font:
        first, second = font.faces
        assert first.table is second.table  # read once
        assert [first.glyph(cp).reason for cp in (0x41, 0x42, 0x43, 0x44)] == [
            None, "same outline as .notdef", "not in cmap", "empty outline"]
        assert first.glyph(0x41) == second.glyph(0x41)  # same outline, same fingerprint
        assert [f.name for f in font.faces] == ["Aaa", "Aaa"]
    with F.FontFile(str(tmp_path / "a.otf"), "a.otf") as font, \
            F.FontFile(str(tmp_path / "pair.otc"), "pair.otc") as other:
        # the same CFF table bytes, in another file: still the same outline
        assert font.faces[0].glyph(0x41) == other.faces[1].glyph(0x41)
