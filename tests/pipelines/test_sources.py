"""SOP, iNaturalist, GLDv2 and revisited Oxford/Paris jobs on miniature layouts."""

import hashlib
import json
import os
import pickle

import numpy as np
import pytest

from tests.support import miniature as mini
from tfaploss.evaluation.revisited import check_revisited_gnd, load_revisited_gnd
from tfaploss.pipelines import gldv2, inaturalist, pickle_sandbox, revisited, sop

IN_MEMORY = ["--direct_running_mode", "in_memory", "--max_failure_fraction", "0.5"]


def check_split(out, split, want, failed, manifest, super_labels=None):
    """Records, labels, dead letters and manifest counts of one split."""
    split_dir = os.path.join(out, split)
    records = mini.read_examples(split_dir)
    got = {r["image/id"][0].decode(): r["image/class/label"][0] for r in records}
    assert got == want
    for r in records:  # every image decodes to what its header says
        img = mini.decode(r["image/encoded"][0])
        assert img.shape == (r["image/height"][0], r["image/width"][0], 3)
    if super_labels is not None:
        assert {r["image/id"][0].decode(): r["image/class/super_label"][0]
                for r in records} == super_labels
    dead = mini.read_dead_letters(split_dir)
    got_dead = sorted(("line" if d["id"].startswith("line ") else d["id"], d["reason"])
                      for d in dead)
    assert got_dead == sorted(failed.items())
    assert manifest["num_images"] == len(want)
    assert manifest["num_failures"] == len(failed)
    assert manifest["num_classes"] == len({v for v in want.values() if v >= 0})
    assert sum(manifest["class_counts"].values()) == len(want)
    return records


def test_sop(tmp_path):
    m = mini.make_sop(str(tmp_path / "sop"))
    out = str(tmp_path / "out")
    manifests = sop.run(["--input_dir", m.root, "--output_dir", out, *IN_MEMORY])
    for split in ("train", "test"):
        check_split(out, split, m.ok[split], m.failed[split], manifests[split],
                    m.super_labels[split])
        assert manifests[split]["label_map"] == {
            str(c): str(c + 1 + (6 if split == "test" else 0)) for c in range(6)}
        assert manifests[split]["super_label_map"] == {str(i): s
                                                        for i, s in enumerate(mini.SOP_SUPERS)}
    train = manifests["train"]
    assert train["failures_by_reason"] == {"bad_annotation": 1, "duplicate_id": 1,
                                           "missing_file": 1, "truncated": 1}
    assert train["class_super_labels"] == {str(c): c % 3 for c in range(6)}
    assert train["by_class"] and manifests["test"]["by_class"] is None


def test_inaturalist(tmp_path):
    m = mini.make_inaturalist(str(tmp_path / "inat"))
    out = str(tmp_path / "out")
    manifests = inaturalist.run(["--input_dir", m.root, "--output_dir", out, "--max_side", "20",
                                 "--by_class", "none", *IN_MEMORY])
    for split in ("train", "test"):
        records = check_split(out, split, m.ok[split], m.failed[split], manifests[split],
                              m.super_labels[split])
        assert all(max(r["image/height"][0], r["image/width"][0]) <= 20 for r in records)
    assert manifests["test"]["label_map"] == {"0": "5040", "1": "5050", "2": "5060",
                                              "3": "5070"}
    assert manifests["train"]["super_label_map"] == {"0": "Aves", "1": "Plantae"}


def test_gldv2_train_and_min_images(tmp_path):
    m = mini.make_gldv2(str(tmp_path / "gld"))
    out = str(tmp_path / "out")
    manifests = gldv2.run(["--input_dir", m.root, "--output_dir", out, "--train_csv",
                           "train.csv", "--min_images_per_class", "2", "--by_class", "none",
                           *IN_MEMORY])
    want = {k: v for k, v in m.ok["train"].items() if v < 5}  # landmark 7000 has 1 image
    check_split(out, "train", want, m.failed["train"], manifests["train"])
    assert manifests["train"]["num_classes_below_min"] == 1
    assert manifests["train"]["num_images_below_min"] == 1
    # train_clean.csv lists the same images of the 5 landmarks (read without Beam)
    pairs, bad = gldv2.read_train(os.path.join(m.root, "train_clean.csv"))
    full, _ = gldv2.read_train(os.path.join(m.root, "train.csv"))
    assert not bad and sorted(pairs) == sorted(p for p in full if p[1] != 7000)


def test_gldv2_retrieval_sets_and_ground_truth(tmp_path):
    m = mini.make_gldv2(str(tmp_path / "gld"))
    out = str(tmp_path / "out")
    manifests = gldv2.run(["--input_dir", m.root, "--output_dir", out, "--subset", "retrieval",
                           *IN_MEMORY])
    check_split(out, "index", m.ok["index"], m.failed["index"], manifests["index"])
    check_split(out, "test", m.ok["test"], {}, manifests["test"])
    with open(os.path.join(out, "test", "ground_truth.json")) as f:
        truth = json.load(f)
    assert len(truth) == 3  # the 'None' query is left out
    index_ids = sorted(m.ok["index"]) + sorted(m.failed["index"])
    assert all(set(t["relevant"]) <= set(index_ids) and len(t["relevant"]) == 3 for t in truth)


def _sha256_of(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_revisited_database_queries_crops_and_json_truth(tmp_path):
    m, truth = mini.make_revisited(str(tmp_path / "roxf"))
    out = str(tmp_path / "out")
    pinned = _sha256_of(os.path.join(m.root, "gnd_roxford5k.pkl"))
    manifests = revisited.run(["--input_dir", m.root, "--output_dir", out, "--dataset",
                               "roxford5k", "--expected_sha256", pinned.upper(), *IN_MEMORY])
    db = check_split(out, "database", m.ok["database"], m.failed["database"],
                     manifests["database"])
    assert {r["image/id"][0].decode(): r["image/index"][0] for r in db} == {
        name: truth["imlist"].index(name) for name in m.ok["database"]}
    queries = check_split(out, "queries", m.ok["queries"], m.failed["queries"],
                          manifests["queries"])
    for r in queries:
        q = truth["qimlist"].index(r["image/id"][0].decode())
        assert r["image/index"][0] == q
        box = truth["gnd"][q]["bbx"]
        np.testing.assert_allclose(r["image/bbox"], box)
        # crop [floor(x0), floor(y0), ceil(x1), ceil(y1)) of the 32x24 image
        assert (r["image/width"][0], r["image/height"][0]) == (16, min(24, int(np.ceil(box[3])) - 2))
    with open(os.path.join(out, "gnd_roxford5k.json")) as f:
        gnd = json.load(f)
    assert gnd["imlist"] == truth["imlist"] and gnd["qimlist"] == truth["qimlist"]
    assert gnd["gnd"][1]["easy"] == [2, 6] and gnd["gnd"][0]["junk"] == []
    assert manifests["queries"]["ground_truth"] == "../gnd_roxford5k.json"
    with open(os.path.join(m.root, "gnd_roxford5k.pkl"), "rb") as f:
        published = f.read()
    assert gnd["source"] == {"file": "gnd_roxford5k.pkl",
                             "sha256": hashlib.sha256(published).hexdigest()}
    # what evaluation reads back is what pickle itself reads from the published file
    assert load_revisited_gnd(os.path.join(out, "gnd_roxford5k.json")) == \
        check_revisited_gnd(pickle.loads(published))


def test_revisited_ground_truth_only_converts_the_pickle_once(tmp_path):
    """--ground_truth_only: the JSON evaluation reads, written atomically, no image read
    and no split written; a second run replaces it whole. The file is one the user named
    (--ground_truth), elsewhere than INPUT_DIR, so no SHA-256 is needed."""
    m, truth = mini.make_revisited(str(tmp_path / "roxf"))
    named = tmp_path / "mine.pkl"
    os.replace(os.path.join(m.root, "gnd_roxford5k.pkl"), named)
    out = tmp_path / "out"
    argv = ["--input_dir", m.root, "--output_dir", str(out), "--dataset", "roxford5k",
            "--ground_truth_only", "--ground_truth", str(named), *IN_MEMORY]
    path = revisited.run(argv)
    assert path == os.path.join(str(out), "gnd_roxford5k.json")
    assert sorted(os.listdir(out)) == ["gnd_roxford5k.json"]
    got = load_revisited_gnd(path)
    assert got["imlist"] == truth["imlist"] and got["qimlist"] == truth["qimlist"]
    for g, e in zip(got["gnd"], truth["gnd"], strict=True):
        assert g == {k: [float(v) for v in e[k]] if k == "bbx" else [int(v) for v in e[k]]
                     for k in ("bbx", "easy", "hard", "junk")}
    with open(path) as f:
        assert json.load(f)["source"]["file"] == "mine.pkl"
    assert revisited.run(argv) == path and sorted(os.listdir(out)) == ["gnd_roxford5k.json"]
    assert revisited.describe(path) == f"ground truth: {path}"


def test_revisited_reads_the_default_pickle_only_with_its_sha256(tmp_path, monkeypatch):
    """INPUT_DIR/gnd_<dataset>.pkl is read only when its SHA-256 is the one expected
    (given, or pinned in PUBLISHED_SHA256); otherwise one line says which hash it has and
    how to go on, and nothing is written."""
    m, _ = mini.make_revisited(str(tmp_path / "roxf"))
    out = tmp_path / "out"
    sha256 = _sha256_of(os.path.join(m.root, "gnd_roxford5k.pkl"))
    argv = ["--input_dir", m.root, "--output_dir", str(out), "--dataset", "roxford5k",
            "--ground_truth_only", *IN_MEMORY]
    with pytest.raises(ValueError, match=f"SHA-256 {sha256}.*--expected_sha256 {sha256}.*"
                                         "--ground_truth"):
        revisited.run(argv)
    with pytest.raises(ValueError, match=f"SHA-256 {sha256}, not the expected 0{{64}}"):
        revisited.run([*argv, "--expected_sha256", "0" * 64])
    with pytest.raises(SystemExit):  # not a SHA-256: refused by the parser
        revisited.run([*argv, "--expected_sha256", "abc"])
    assert not out.exists()
    monkeypatch.setitem(revisited.PUBLISHED_SHA256, "roxford5k", sha256)
    assert load_revisited_gnd(revisited.run(argv))["imlist"][0] == "oxford_000000"


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_revisited_refuses_a_pickle_carrying_a_callable(tmp_path):
    root = tmp_path / "evil"
    root.mkdir()
    payload = {"imlist": ["a"], "qimlist": [], "gnd": [], "x": _Exploit()}
    (root / "gnd_roxford5k.pkl").write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(pickle_sandbox.UnsafePickleError, match="posix.system"):
        revisited.run(["--input_dir", str(root), "--output_dir", str(tmp_path / "out"),
                       "--dataset", "roxford5k", "--ground_truth",
                       str(root / "gnd_roxford5k.pkl"), *IN_MEMORY])
    assert not (tmp_path / "out" / "gnd_roxford5k.json").exists()


@pytest.mark.parametrize("gnd, key", [
    ([1], r"'gnd'\[0\]"),
    ([None], r"'gnd'\[0\]"),
    ([{"easy": [0], "hard": [], "junk": [], "bbx": ["a", 1, 2, 3]}], r"'gnd'\[0\]\['bbx'\]"),
    ([{"easy": [0], "hard": [], "junk": []}], r"'gnd'\[0\] has no 'bbx'"),
])
def test_revisited_job_names_file_and_key_for_a_wrong_structure(tmp_path, gnd, key):
    root = tmp_path / "bad"
    root.mkdir()
    payload = {"imlist": ["a"], "qimlist": ["q"], "gnd": gnd}
    (root / "gnd_roxford5k.pkl").write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(ValueError, match=key) as err:
        revisited.run(["--input_dir", str(root), "--output_dir", str(tmp_path / "out"),
                       "--dataset", "roxford5k", "--expected_sha256",
                       _sha256_of(root / "gnd_roxford5k.pkl"), *IN_MEMORY])
    assert "gnd_roxford5k.pkl" in str(err.value)
