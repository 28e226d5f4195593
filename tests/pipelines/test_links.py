"""One link policy for the jobs that walk a folder (tfaploss/pipelines/links.py), files and
folders alike: links inside the input root are followed, links that leave it are ignored
with a reason unless ``--follow_external_links``, loops and second names of what is
already listed are ignored either way, dangling links are dead letters."""

import json
import os

import pytest

from tests.support import miniature as mini
from tfaploss.pipelines import folder, glyphs
from tfaploss.pipelines import links as LK

IN_MEMORY = ["--direct_running_mode", "in_memory"]


@pytest.fixture
def tree(tmp_path):
    """``root/``: classes a, b and a hidden store; ``outside/``: what links may leave to."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    for rel in ["root/a/x.jpg", "root/b/y.jpg", "root/.store/s.jpg", "root/.store/deep/t.jpg",
                "outside/o.jpg", "outside/dir/p.jpg"]:
        mini.write_image(str(tmp_path / rel), len(rel) % 5)
    return root, outside


def _listing(root, follow=False):
    got = folder.list_tree(str(root), follow_external_links=follow)
    records = {rel: cls for cls, files in got.classes.items() for rel, _ in files}
    ignored = {d["path"]: d["reason"] for ds in got.ignored.values() for d in ds}
    dead = {d["path"]: d["reason"] for ds in got.dead.values() for d in ds}
    assert not set(records) & set(ignored) and not set(records) & set(dead)
    assert not set(ignored) & set(dead)
    return records, ignored, dead


def test_file_link_inside_the_root_is_followed(tree):
    root, _ = tree
    os.symlink("../.store/s.jpg", root / "a" / "l.jpg")
    records, ignored, _ = _listing(root)
    assert records["a/l.jpg"] == "a" and ".store/s.jpg" in ignored  # hidden as itself


@pytest.mark.parametrize("follow", [False, True])
def test_file_link_leaving_the_root_needs_the_flag(tree, follow):
    root, outside = tree
    os.symlink(outside / "o.jpg", root / "a" / "o.jpg")
    records, ignored, _ = _listing(root, follow)
    if follow:
        assert records["a/o.jpg"] == "a"
        bound = dict(folder.list_tree(str(root), follow_external_links=True).classes["a"])
        assert bound["a/o.jpg"] == os.path.realpath(outside)  # the read stays there
    else:
        assert ignored["a/o.jpg"] == LK.LEAVES_ROOT and "a/o.jpg" not in records


def test_folder_link_inside_the_root_is_followed_once(tree):
    root, _ = tree
    os.symlink("../.store", root / "a" / "more")
    os.symlink("../.store/deep", root / "a" / "zdeep")  # inside what `more` lists
    os.symlink("../.store/deep", root / "b" / "deep")
    records, ignored, _ = _listing(root)
    # Links are followed in the order found (classes, then names), after every real entry.
    assert records["a/more/s.jpg"] == "a" and records["a/more/deep/t.jpg"] == "a"
    for rel in ("a/zdeep", "b/deep"):
        assert ignored[rel] == ("symlink to a folder already listed as a/more/deep/ "
                                "(not followed again)")


def test_link_to_another_class_is_a_duplicate_not_a_class(tree):
    root, _ = tree
    os.symlink("../b", root / "a" / "0_bees")  # sorts before every real name
    os.symlink("b", root / "0")                # a class folder that is another class
    os.symlink("../b/y.jpg", root / "a" / "0.jpg")
    records, ignored, _ = _listing(root)
    assert records == {"a/x.jpg": "a", "b/y.jpg": "b"}
    assert ignored["a/0_bees"] == ignored["0"] == ("symlink to a folder already listed as "
                                                   "b/ (not followed again)")
    assert ignored["a/0.jpg"] == "same file as b/y.jpg"


@pytest.mark.parametrize("follow", [False, True])
def test_folder_link_leaving_the_root_needs_the_flag(tree, follow):
    root, outside = tree
    os.symlink(outside / "dir", root / "a" / "ext")
    os.symlink(outside / "dir", root / "extclass")
    os.symlink(outside, root / "wider")  # holds what `ext` lists: the file is listed once
    records, ignored, _ = _listing(root, follow)
    if follow:
        assert records["a/ext/p.jpg"] == "a" and records["wider/o.jpg"] == "wider"
        assert "extclass" not in {c for c in records.values()}
        assert "already listed as a/ext/" in ignored["extclass"]
        assert "already listed as a/ext/" in ignored["wider/dir"]
    else:
        assert ignored["a/ext"] == ignored["extclass"] == ignored["wider"] == LK.LEAVES_ROOT
        assert set(records) == {"a/x.jpg", "b/y.jpg"}


@pytest.mark.parametrize("follow", [False, True])
def test_loops_are_detected_either_way(tree, follow):
    root, _ = tree
    os.symlink(".", root / "a" / "self")
    os.symlink("..", root / "a" / "up")          # the input root
    os.symlink("../..", root / "b" / "above")    # above the root: leaves it, or a loop
    os.symlink(".", root / "rootclass")          # a class folder that is the root
    records, ignored, _ = _listing(root, follow)
    assert set(records) == {"a/x.jpg", "b/y.jpg"}
    for rel in ("a/self", "a/up", "rootclass"):
        assert "loop" in ignored[rel], rel
    assert ("loop" in ignored["b/above"]) if follow else ignored["b/above"] == LK.LEAVES_ROOT


def test_dangling_links_are_dead_letters(tree):
    root, outside = tree
    os.symlink("nowhere.jpg", root / "a" / "gone.jpg")
    os.symlink(outside / "nowhere", root / "a" / "gonedir")
    os.symlink("gone.jpg", root / "a" / "gone2.jpg")  # a link to a dangling link
    _, _, dead = _listing(root)
    assert dead == dict.fromkeys(["a/gone.jpg", "a/gonedir", "a/gone2.jpg"], "missing_file")


def test_links_to_links_are_judged_by_where_the_chain_ends(tree):
    root, outside = tree
    os.symlink("../.store/s.jpg", root / "a" / "l1.jpg")
    os.symlink("l1.jpg", root / "a" / "l2.jpg")             # inside, then inside
    os.symlink(outside / "o.jpg", root / ".store" / "out.jpg")
    os.symlink("../.store/out.jpg", root / "b" / "l3.jpg")  # inside, then out
    os.symlink(outside / "back.jpg", root / "b" / "l4.jpg")
    os.symlink(root / "a" / "x.jpg", outside / "back.jpg")  # out, then back inside
    records, ignored, _ = _listing(root)
    assert records["a/l1.jpg"] == "a" and ignored["a/l2.jpg"] == "same file as a/l1.jpg"
    assert ignored["b/l3.jpg"] == LK.LEAVES_ROOT
    assert ignored["b/l4.jpg"] == "same file as a/x.jpg"


def _entries(root):
    """Every file and link below ``root``, links not followed."""
    out = set()
    for dirpath, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            out.add(os.path.relpath(os.path.join(dirpath, name), root))
    return out


@pytest.mark.parametrize("follow", [False, True])
def test_every_variant_at_once_is_accounted_for(tree, tmp_path, follow):
    root, outside = tree
    for target, link in [("../.store/s.jpg", "a/l.jpg"), (outside / "o.jpg", "a/o.jpg"),
                         ("../.store", "a/more"), ("../b", "a/bees"), (outside / "dir", "a/ext"),
                         (".", "a/self"), ("..", "b/up"), ("nowhere.jpg", "b/gone.jpg"),
                         ("l.jpg", "a/l2.jpg"), (outside / "dir", "extclass")]:
        os.symlink(target, root / link)
    out = str(tmp_path / "out")
    argv = ["--input_dir", str(root), "--output_dir", out, "--max_failure_fraction", "1"]
    m = folder.run(argv + (["--follow_external_links"] if follow else []) + IN_MEMORY)["train"]
    split = os.path.join(out, "train")
    records = {r["image/id"][0].decode() for r in mini.read_examples(split)}
    dead = {d["path"] for d in mini.read_dead_letters(split)}
    with open(os.path.join(split, "ignored_files.jsonl")) as f:
        ignored = {d["path"]: d["reason"] for d in map(json.loads, f)}
    followed = {"a/more"} | ({"a/ext", "extclass"} if follow else set())
    # A followed folder link is accounted for by what it lists.
    listed = {rel.split("/")[0] if rel.split("/")[0] in followed else
              "/".join(rel.split("/")[:2]) if "/".join(rel.split("/")[:2]) in followed
              else rel for rel in records | dead | set(ignored)}
    assert listed == _entries(root)
    assert len(records) + len(dead) + len(ignored) == len(records | dead | set(ignored))
    assert m["num_ignored_files"] == len(ignored) and m["num_images"] == len(records)
    assert dead == {"b/gone.jpg"}
    leaving = sorted(p for p, why in ignored.items() if why == LK.LEAVES_ROOT)
    assert leaving == ([] if follow else ["a/ext", "a/o.jpg", "extclass"])
    assert ("a/ext/p.jpg" in records and "a/o.jpg" in records) == follow


def test_the_glyphs_job_walks_by_the_same_policy(tmp_path):
    root, outside = tmp_path / "fonts", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    for path in (root / "sub" / "a.ttf", outside / "o.ttf"):
        path.write_bytes(b"not parsed while listing")
    os.symlink("sub", root / "0_again")       # sorts first, but sub/ is listed as itself
    os.symlink(outside / "o.ttf", root / "o.ttf")
    os.symlink(".", root / "sub" / "loop")
    os.symlink("nowhere.ttf", root / "gone.ttf")
    got = glyphs.list_fonts(str(root))
    ignored = {d["path"]: d["reason"] for d in got.ignored}
    assert [rel for rel, _ in got.fonts] == ["sub/a.ttf"]
    assert ignored["0_again"].startswith("symlink to a folder already listed as sub/")
    assert ignored["o.ttf"] == LK.LEAVES_ROOT and "loop" in ignored["sub/loop"]
    assert [d["path"] for d in got.dead] == ["gone.ttf"]
    assert [rel for rel, _ in glyphs.list_fonts(str(root), True).fonts] == ["o.ttf",
                                                                            "sub/a.ttf"]
