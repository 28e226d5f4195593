"""The folder job end to end on a miniature tree (DirectRunner, both modes)."""

import json
import os

import numpy as np
import pytest

from tests.support import miniature as mini
from tfaploss.pipelines import folder
from tfaploss.pipelines import runner as R

IN_MEMORY = ["--direct_running_mode", "in_memory"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("folder_tree"))
    return mini.make_folder(root)


@pytest.fixture(scope="module")
def split_run(tree, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("folder_out"))
    # 2 of 20 train inputs fail: more than 1 %, so the job raises after writing everything.
    with pytest.raises(R.TooManyFailuresError) as info:
        folder.run(["--input_dir", tree.root, "--output_dir", out, "--test_classes", "4,5",
                    "--max_failure_fraction", "0.01", "--class_chunk_size", "4", *IN_MEMORY])
    assert str(info.value).startswith("more failures than --max_failure_fraction=0.01: "
                                      "train: 2 of 20 inputs failed (10.00%)")
    return out, info.value.manifests


def test_split_counts_labels_and_manifest(tree, split_run):
    out, manifests = split_run
    assert sorted(manifests) == ["test", "train"]
    expected = tree.ok["all"]
    for split, classes in (("train", [0, 1, 2, 3]), ("test", [4, 5])):
        m = manifests[split]
        want = {i: classes.index(k) for i, k in expected.items() if k in classes}
        records = mini.read_examples(os.path.join(out, split))
        got = {r["image/id"][0].decode(): r["image/class/label"][0] for r in records}
        assert got == want
        assert m["num_images"] == len(want)
        assert m["num_classes"] == len(classes)
        assert m["label_map"] == {str(i): str(k) for i, k in enumerate(classes)}
        counts = {str(classes.index(k)): sum(v == k for v in expected.values()) for k in classes}
        assert m["class_counts"] == counts
        # A file outside any class folder is listed once, with the first split.
        want_ignored = ([{"path": "README.txt", "reason": "not inside a class folder"}]
                        if split == "train" else [])
        assert m["ignored_files"] == want_ignored
        assert m["num_ignored_files"] == len(want_ignored)
        with open(os.path.join(out, split, "manifest.json")) as f:
            assert json.load(f) == m
        # ids follow the sorted listing
        indices = sorted((r["image/index"][0], r["image/id"][0]) for r in records)
        assert [i for i, _ in indices] == sorted(i for i, _ in indices)


def test_dead_letters_counted_and_nothing_lost(tree, split_run):
    out, manifests = split_run
    dead = mini.read_dead_letters(os.path.join(out, "train"))
    assert {(d["id"], d["reason"]) for d in dead} == set(tree.failed["all"].items())
    m = manifests["train"]
    assert m["num_failures"] == 2
    assert m["failures_by_reason"] == {"missing_file": 1, "truncated": 1}
    assert m["num_inputs"] == m["num_images"] + m["num_failures"]
    assert manifests["test"]["num_failures"] == 0


def test_images_decode_with_colour_and_orientation_fixed(tree, split_run):
    out, _ = split_run
    records = {r["image/id"][0].decode(): r for r in mini.read_examples(os.path.join(out, "train"))}
    for image_id, label in tree.ok["all"].items():
        if label >= 4:
            continue
        r = records[image_id]
        img = mini.decode(r["image/encoded"][0])
        assert img.shape == (r["image/height"][0], r["image/width"][0], 3)
        centre = img[img.shape[0] // 2, img.shape[1] // 2].astype(int)
        colour = np.array(mini.class_colour(label))
        if image_id == tree.special["gray"]:
            gray = round(0.299 * colour[0] + 0.587 * colour[1] + 0.114 * colour[2])
            np.testing.assert_allclose(centre, [gray] * 3, atol=4)
        else:
            np.testing.assert_allclose(centre, colour, atol=6)
    exif = mini.decode(records[tree.special["exif"]]["image/encoded"][0])
    # stored 32x24 with a red top-left marker; orientation 6 shows it rotated clockwise
    assert exif.shape == (mini.W, mini.H, 3)
    assert exif[2, -3, 0] > 200 and exif[2, -3, 1] < 60
    assert exif[2, 2, 0] < 200


def test_png_tree_and_by_class_layout(tree, split_run):
    out, manifests = split_run
    chunks = mini.read_examples(os.path.join(out, "train"), layout="by_class")
    per_class = {}
    for c in chunks:
        label = c["class/label"][0]
        per_class.setdefault(label, []).extend(i.decode() for i in c["image/id"])
        assert len(c["image/id"]) == len(c["image/encoded"]) <= 4
        assert c["class/num_images"][0] == manifests["train"]["class_counts"][str(label)]
    want = {}
    for image_id, k in tree.ok["all"].items():
        if k < 4:
            want.setdefault(k, []).append(image_id)
    assert {k: sorted(v) for k, v in per_class.items()} == {k: sorted(v) for k, v in want.items()}
    assert manifests["train"]["by_class"]["shards"]
    assert manifests["test"]["by_class"] is None  # --by_class train by default
    png = [r for r in mini.read_examples(os.path.join(out, "train"))
           if r["image/id"][0].startswith(b"3/")]
    assert len(png) == 5 and all(r["image/format"] == [b"jpeg"] for r in png)


def test_multi_processing_rerun_gives_same_records(tree, split_run, tmp_path):
    out, _ = split_run
    again = str(tmp_path / "again")
    folder.run(["--input_dir", tree.root, "--output_dir", again, "--test_classes", "4,5",
                "--max_failure_fraction", "0.2", "--class_chunk_size", "4",
                "--direct_running_mode", "multi_processing", "--direct_num_workers", "2"])
    for split in ("train", "test"):
        first = sorted(map(repr, mini.read_examples(os.path.join(out, split))))
        second = sorted(map(repr, mini.read_examples(os.path.join(again, split))))
        assert first == second
        with open(os.path.join(out, split, "manifest.json")) as f1, \
                open(os.path.join(again, split, "manifest.json")) as f2:
            m1, m2 = json.load(f1), json.load(f2)
        for m in (m1, m2):
            m.pop("options")
        assert m1 == m2


def test_main_exit_codes():
    def too_many(argv):
        raise R.TooManyFailuresError("too many", {})

    def bad_argument(argv):
        raise ValueError("--max_side must be >= 0, got -1")

    assert R.main_wrapper(too_many, []) == 1
    assert R.main_wrapper(bad_argument, []) == 2


def test_argument_errors_name_the_argument(tree, tmp_path):
    with pytest.raises(ValueError, match=r"--test_classes names unknown classes \['9'\]"):
        folder.plan(folder.parser().parse_args(
            ["--input_dir", tree.root, "--output_dir", str(tmp_path), "--test_classes", "9"]))
    with pytest.raises(ValueError, match="--jpeg_quality must be in 1..100, got 0"):
        folder.run(["--input_dir", tree.root, "--output_dir", str(tmp_path),
                    "--jpeg_quality", "0"])
    assert "--test_classes" in folder.parser().format_help()


def test_importing_the_job_loads_neither_tensorflow_nor_beam():
    # TensorFlow took seconds of every job's start-up (through tfaploss.data's package
    # imports) for nothing the job uses; Beam is imported once the image processes work.
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys, tfaploss.pipelines.folder, tfaploss.pipelines.runner, tfaploss.data.integrity, tfaploss.data.framing; "
            "print(sorted(m for m in ('tensorflow', 'keras', 'apache_beam') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True,
                          text=True, check=True, env={**os.environ, "PYTHONPATH": repo})
    assert done.stdout.split("\n")[-2] == "[]", done.stdout


def test_image_processes_start_before_beam_and_each_task_runs_once(tree, tmp_path,
                                                                    monkeypatch):
    from tfaploss.pipelines import console
    from tfaploss.pipelines import image_workers as W
    from tfaploss.pipelines import runner as R

    submitted, claimed, at_beam_import = [], [], []
    submit, claim, import_beam = W.submit_ahead, W.claim_ahead, console.import_beam_quietly

    def submit_spy(token, *args, **kwargs):
        n = submit(token, *args, **kwargs)
        submitted.extend(W._AHEAD[token])
        return n

    def claim_spy(token, path):
        out = claim(token, path)
        if out is not None:
            claimed.append(path)
        return out

    def import_spy():
        at_beam_import.append(list(submitted))
        return import_beam()

    monkeypatch.setattr(W, "submit_ahead", submit_spy)
    monkeypatch.setattr(W, "claim_ahead", claim_spy)
    monkeypatch.setattr(console, "import_beam_quietly", import_spy)
    # 3 images per batch, tasks of 4: batches of one task, each its own part file
    base = ["--input_dir", tree.root, "--num_shards", "2", "--images_per_batch", "3",
            "--max_failure_fraction", "1", "--image_processes", "2"]
    monkeypatch.setattr(R, "AHEAD_IMAGES_PER_PROCESS", 4)  # 8 images: 3 of the batches
    ahead = folder.run([*base, "--output_dir", str(tmp_path / "ahead")])

    assert len(submitted) == 3 and at_beam_import[0] == submitted
    assert sorted(claimed) == sorted(submitted)  # each taken over once, none run twice
    assert not W._AHEAD  # nothing left behind once the job ended

    submitted.clear()
    monkeypatch.setattr(R, "AHEAD_IMAGES_PER_PROCESS", 0)
    plain = folder.run([*base, "--output_dir", str(tmp_path / "plain")])
    assert submitted == []
    assert ahead["train"]["num_images"] == plain["train"]["num_images"] > 9
    for split in ahead:
        files = [mini.snapshot(str(tmp_path / run / split)) for run in ("ahead", "plain")]
        assert files[0].pop("manifest.json") and files[1].pop("manifest.json")
        assert files[0] == files[1] and any(f.endswith(".tfrecord") for f in files[0])
