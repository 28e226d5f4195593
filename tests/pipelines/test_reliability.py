"""Faults and hostile inputs: killed reruns, deterministic shards, names that leave the
input folder, trees the folder job must account for file by file, quiet output."""

import glob
import json
import os
import pickle
import subprocess
import sys

import pytest

from tests.support import miniature as mini
from tfaploss.durable import faults
from tfaploss.pipelines import folder, revisited, runner, storage

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IN_MEMORY = ["--direct_running_mode", "in_memory"]


def _job(module, argv, env_extra=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": REPO, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", f"tfaploss.pipelines.{module}", *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def _check_manifest_matches_records(split_dir):
    with open(os.path.join(split_dir, "manifest.json")) as f:
        m = json.load(f)
    assert sorted(m["shards"]) == sorted(
        os.path.basename(p) for p in glob.glob(os.path.join(split_dir, "images-*.tfrecord")))
    assert len(mini.read_examples(split_dir)) == m["num_images"]
    return m


# ------------------------------------------------------------------ item 11.2: traversal


def test_revisited_refuses_names_that_leave_the_input_folder(tmp_path):
    m, truth = mini.make_revisited(str(tmp_path / "roxf"))
    secret = tmp_path / "secret.jpg"
    mini.write_image(str(secret), 3)
    os.symlink(secret, tmp_path / "roxf" / "jpg" / "link.jpg")
    evil = ["../secret", "../../secret", str(tmp_path / "secret"), "link", "jpg/../../secret"]
    truth["imlist"] = truth["imlist"] + evil
    with open(tmp_path / "roxf" / "gnd_roxford5k.pkl", "wb") as f:
        pickle.dump(truth, f, protocol=2)
    out = str(tmp_path / "out")
    manifests = revisited.run(["--input_dir", m.root, "--output_dir", out, "--dataset",
                               "roxford5k", "--max_failure_fraction", "0.9", "--ground_truth",
                               str(tmp_path / "roxf" / "gnd_roxford5k.pkl"), *IN_MEMORY])
    dead = {d["id"]: d for d in mini.read_dead_letters(os.path.join(out, "database"))}
    assert {name: dead[name]["reason"] for name in evil} == dict.fromkeys(evil, "unsafe_path")
    ids = {r["image/id"][0].decode() for r in mini.read_examples(os.path.join(out, "database"))}
    assert ids == set(m.ok["database"])
    assert manifests["database"]["failures_by_reason"]["unsafe_path"] == len(evil)


def test_annotation_jobs_refuse_unsafe_relative_paths():
    records = [{"id": "a", "relpath": "x/../../etc/passwd.jpg", "path": "p"},
               {"id": "b", "relpath": "/etc/passwd.jpg", "path": "p"},
               {"id": "c", "relpath": "ok/c.jpg", "path": "p"}]
    kept, dead = runner.dedupe_and_index(records)
    assert [r["id"] for r in kept] == ["c"]
    assert [(d["id"], d["reason"]) for d in dead] == [("a", "unsafe_path"), ("b", "unsafe_path")]


# --------------------------------------------------------- item 11.8: deterministic shards


@pytest.mark.slow
def test_shards_are_deterministic_and_never_empty(tmp_path):
    tree = mini.make_folder(str(tmp_path / "tree"))
    args = ["--input_dir", tree.root, "--records_per_shard", "4", "--class_chunk_size", "2",
            "--max_failure_fraction", "0.5", "--images_per_batch", "3"]
    a = str(tmp_path / "a")
    folder.run([*args, "--output_dir", a, *IN_MEMORY])
    assert runner.LAST_TIMING["processes"] == len(os.sched_getaffinity(0))  # one per core
    files_a = mini.snapshot(os.path.join(a, "train"))
    files_a.pop("manifest.json")  # the options differ
    # Every way the image work can run writes the same bytes: forked processes (above),
    # threads of the Beam process, inline, and Beam's own worker processes.
    for name, how in [("threads", ["--image_processes", "1", "--image_threads", "2"]),
                      ("inline", ["--image_processes", "1", "--image_threads", "1"]),
                      ("beam_workers", ["--direct_running_mode", "multi_processing",
                                        "--direct_num_workers", "2"])]:
        b = str(tmp_path / name)
        folder.run([*args, "--output_dir", b, *how])
        files_b = mini.snapshot(os.path.join(b, "train"))
        files_b.pop("manifest.json")
        assert files_b == files_a, name
    shards = sorted(glob.glob(os.path.join(a, "train", "images-*.tfrecord")))
    by_class = sorted(glob.glob(os.path.join(a, "train", "by_class", "*.tfrecord")))
    # 29 listed images (the broken link is a dead letter while planning): ceil(29 / 4)
    # shards; 6 classes in min(8, 6) by-class shards.
    assert len(shards) == 8 and len(by_class) == 6
    assert all(os.path.getsize(p) > 0 for p in shards + by_class)
    # Listed image i (sorted by id) sits in shard i * 8 // 29, the shard in index order.
    import tensorflow as tf

    for k, path in enumerate(shards):
        indices = [tf.train.Example.FromString(raw).features.feature["image/index"]
                   .int64_list.value[0] for raw in tf.data.TFRecordDataset(path)
                   .as_numpy_iterator()]
        assert indices == sorted(indices)
        assert {i * 8 // 29 for i in indices} == {k}


# ------------------------------------------------------------ item 11.6: killed reruns


@pytest.mark.slow
def test_rerun_killed_midway_leaves_the_previous_dataset_intact(tmp_path):
    tree = mini.make_folder(str(tmp_path / "tree"))
    out = str(tmp_path / "out")
    base = ["--input_dir", tree.root, "--output_dir", out, "--test_classes", "4,5",
            "--max_failure_fraction", "0.5", *IN_MEMORY]
    folder.run(base)
    before = {s: mini.snapshot(os.path.join(out, s)) for s in ("train", "test")}

    # A rerun with other settings, killed after 6 images (os._exit: no clean-up at all).
    killed = _job("folder", [*base, "--max_side", "16", "--images_per_batch", "2"],
                  {faults.ENV: "images:6"}, timeout=120)
    assert killed.returncode == 75, killed.stderr
    assert f"{faults.ENV}=images:6: simulated kill at images " in killed.stderr
    assert mini.processes_running_with(out) == []  # its image processes died with it
    assert {s: mini.snapshot(os.path.join(out, s)) for s in ("train", "test")} == before
    for s in ("train", "test"):
        _check_manifest_matches_records(os.path.join(out, s))

    # Killed between the two renames of a publish: the old split is put back.
    killed = _job("folder", [*base, "--max_side", "16"], {faults.ENV: "publish"})
    assert killed.returncode == 75, killed.stderr
    assert f"{faults.ENV}=publish: simulated kill at publish" in killed.stderr
    assert not os.path.exists(os.path.join(out, "train"))  # renamed aside, not lost
    storage.recover(os.path.join(out, "train"))
    assert {s: mini.snapshot(os.path.join(out, s)) for s in ("train", "test")} == before

    # A complete rerun replaces both splits and leaves no staging folder behind.
    manifests = folder.run([*base, "--max_side", "16"])
    assert manifests["train"]["options"]["max_side"] == 16
    for s in ("train", "test"):
        m = _check_manifest_matches_records(os.path.join(out, s))
        assert all(max(r["image/height"][0], r["image/width"][0]) <= 16
                   for r in mini.read_examples(os.path.join(out, s)))
        assert m["num_images"] == manifests[s]["num_images"]
    assert sorted(os.listdir(out)) == ["test", "train"]


def test_refuses_to_replace_a_folder_it_did_not_write(tmp_path):
    tree = mini.make_folder(str(tmp_path / "tree"))
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "train" / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match="was not written by a tfaploss pipelines job"):
        folder.run(["--input_dir", tree.root, "--output_dir", str(out), *IN_MEMORY])
    assert (out / "train" / "thesis.tex").read_text() == "years of work"


# -------------------------------------------------------- item 11.7: every file accounted


def _all_entries(root):
    """Every file and symlink below ``root`` (symlinks not followed), as the job names
    them: relative, non-UTF-8 bytes backslash-escaped."""
    out = set()
    for dirpath, dirs, files in os.walk(os.fsencode(root)):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            rel = os.path.relpath(os.path.join(dirpath, name), os.fsencode(root))
            out.add(rel.decode("utf-8", "backslashreplace"))
    return out


@pytest.fixture
def messy_tree(tmp_path):
    root = tmp_path / "messy"
    for rel in ["a/x.jpg", "a/.hidden_real_image.jpg", "a/.hidden_dir/y.jpg", "a/_under/z.jpg",
                "a/sub/deep.jpg", "a/sub/.deep_hidden.jpg", "_underscore_class/w.jpg",
                ".hidden_class/v.jpg", "b/q.jpg", "b/r.png", "c/locked/s.jpg", "c/t.jpg"]:
        mini.write_image(str(root / rel), 1, "png" if rel.endswith(".png") else "rgb")
    (root / "a" / "notes.txt").write_text("notes")
    (root / "stray.jpg").write_bytes((root / "a" / "x.jpg").read_bytes())
    os.symlink(".", root / "a" / "loop")                 # a self-loop
    os.symlink("../b", root / "a" / "leak")              # into another class
    os.symlink("../../b/q.jpg", root / "a" / "sub" / "leak.jpg")
    os.symlink("x.jpg", root / "a" / "same.jpg")         # second name of a listed file
    with open(os.fsencode(str(root / "b")) + b"/caf\xe9.jpg", "wb") as f:  # Latin-1 name
        f.write((root / "a" / "x.jpg").read_bytes())
    return root


def test_folder_job_accounts_for_every_file(messy_tree, tmp_path, monkeypatch):
    locked = str(messy_tree / "c" / "locked")
    real_scandir = os.scandir

    def scandir(path="."):
        if isinstance(path, str) and path == locked:  # as root, chmod 000 would not stop us
            raise PermissionError(13, "Permission denied")
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    out = str(tmp_path / "out")
    manifests = folder.run(["--input_dir", str(messy_tree), "--output_dir", out,
                            "--max_failure_fraction", "1", *IN_MEMORY])
    m = manifests["train"]
    records = {r["image/id"][0].decode() for r in mini.read_examples(os.path.join(out, "train"))}
    dead = {d["path"]: d["reason"] for d in mini.read_dead_letters(os.path.join(out, "train"))}
    with open(os.path.join(out, "train", "ignored_files.jsonl")) as f:
        ignored = {d["path"]: d["reason"] for d in map(json.loads, f)}
    assert records == {"a/x.jpg", "a/sub/deep.jpg", "b/q.jpg", "b/r.png", "c/t.jpg"}
    assert dead == {"b/caf\\xe9.jpg": "bad_file_name", "c/locked/": "unreadable_folder"}
    assert m["label_map"] == {"0": "a", "1": "b", "2": "c"}
    # Exactly one place for every entry (the locked folder's file is behind its dead letter).
    entries = _all_entries(messy_tree) - {"c/locked/s.jpg"}
    assert not records & set(ignored) and not records & set(dead) and not set(dead) & set(
        ignored)
    assert records | set(dead) - {"c/locked/"} | set(ignored) == entries
    # One link policy (tfaploss/pipelines/links.py): links inside the input root are followed, so
    # a link into another class folder is a second name for what that class lists.
    assert "loop" in ignored["a/loop"] and "already listed as b/" in ignored["a/leak"]
    assert ignored["a/sub/leak.jpg"] == "same file as b/q.jpg"
    assert ignored["a/same.jpg"] == "same file as a/x.jpg"
    for rel in ("a/.hidden_real_image.jpg", "a/.hidden_dir/y.jpg", "a/sub/.deep_hidden.jpg",
                ".hidden_class/v.jpg"):
        assert "'.'" in ignored[rel], rel
    for rel in ("a/_under/z.jpg", "_underscore_class/w.jpg"):
        assert "'_'" in ignored[rel], rel
    assert ignored["a/notes.txt"] == "not an image file extension"
    assert ignored["stray.jpg"] == "not inside a class folder"
    assert m["num_ignored_files"] == len(ignored) and m["num_failures"] == 2


# ----------------------------------------------------------- item 14.4: already split


def test_already_split_tree_is_refused_or_split(tmp_path):
    root = tmp_path / "split"
    for rel in ["train/cat/0.jpg", "train/cat/1.jpg", "train/dog/0.jpg", "test/cow/0.jpg",
                "test/eel/0.jpg", "test/eel/1.jpg"]:
        mini.write_image(str(root / rel), len(rel) % 5)
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match="looks already split.*--splits_from_folders"):
        folder.run(["--input_dir", str(root), "--output_dir", out, *IN_MEMORY])
    assert not os.path.exists(out)
    manifests = folder.run(["--input_dir", str(root), "--output_dir", out,
                            "--splits_from_folders", *IN_MEMORY])
    assert manifests["train"]["label_map"] == {"0": "cat", "1": "dog"}
    assert manifests["test"]["label_map"] == {"0": "cow", "1": "eel"}
    got = {r["image/id"][0].decode(): r["image/class/label"][0]
           for r in mini.read_examples(os.path.join(out, "test"))}
    assert got == {"test/cow/0.jpg": 0, "test/eel/0.jpg": 1, "test/eel/1.jpg": 1}
    assert manifests["train"]["by_class"] and manifests["test"]["by_class"] is None


# ------------------------------------------------------------- item 14.7: quiet output


@pytest.mark.slow
def test_a_job_prints_a_few_lines_of_its_own(tmp_path):
    tree = mini.make_folder(str(tmp_path / "tree"))
    done = _job("folder", ["--input_dir", tree.root, "--output_dir", str(tmp_path / "out"),
                           "--max_failure_fraction", "0.5"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "train: 28 images, 6 classes, 2 failures, 1 shards\n"
    lines = done.stderr.strip().splitlines()
    assert len(lines) <= 4, lines
    assert lines[-1].startswith("folder: 29 images in ")
    assert not any("apitools" in ln or "INFO" in ln or "WARNING" in ln for ln in lines), lines
    # Plain lines, readable in a log file: no carriage return, colour code or backspace.
    assert not any(code in done.stdout + done.stderr for code in ("\r", "\x1b", "\x08"))
    refused = _job("folder", ["--input_dir", str(tmp_path / "nowhere"), "--output_dir",
                              str(tmp_path / "o")])
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: --input_dir {str(tmp_path / 'nowhere')!r} is not a directory"]
