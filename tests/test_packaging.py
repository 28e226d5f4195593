"""What a built wheel holds: the whole ``tfaploss`` package and its data (the recipes
as ``tfaploss/recipes/*.yaml``, the font fetcher), and no other top-level package.

Built twice, from a copy of the working tree (the shared ``build/`` folder of the clone
may hold stale files that would slip into a wheel built in place): straight from the
tree, as ``pip wheel .`` does, and from the sdist, as ``python -m build`` does, which
checks MANIFEST.in. A few seconds each.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OTHER_TOP_LEVEL = ("models", "pipelines", "tests", "benchmarks", "experiments", "configs",
                   "docs")

pytestmark = pytest.mark.slow


def _copy_tree(target: Path) -> None:
    """The files git would commit (tracked, and new ones not ignored); without git, the
    tree less what .gitignore names."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
        capture_output=True, check=False)
    if listed.returncode != 0:
        shutil.copytree(REPO, target, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".cache"))
        return
    for name in listed.stdout.decode().split("\0"):
        source = REPO / name
        if name and source.is_file():  # a deleted, not yet committed file is listed too
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _wheel(source: Path, out: Path) -> Path:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(out), "."],
        cwd=source, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (wheel,) = out.glob("tfaploss-*.whl")
    return wheel


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree") / "tfaploss-src"
    _copy_tree(root)
    return root


@pytest.fixture(scope="module", params=["tree", "sdist"])
def wheel(request, tree, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"wheel-{request.param}")
    if request.param == "tree":
        return _wheel(tree, out)
    script = ("import sys; from setuptools import build_meta; "
              "print(build_meta.build_sdist(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", script, str(out / "sdist")], cwd=tree,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    sdist = out / "sdist" / result.stdout.split()[-1]
    with tarfile.open(sdist) as archive:
        archive.extractall(out / "unpacked", filter="data")
    (unpacked,) = (out / "unpacked").iterdir()
    return _wheel(unpacked, out)


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_every_module_of_the_package_is_in_the_wheel(wheel, tree):
    expected = {p.relative_to(tree).as_posix() for p in (tree / "tfaploss").rglob("*.py")}
    assert len(expected) > 100
    assert not expected - _names(wheel)


def test_the_recipes_are_package_data(wheel):
    names = _names(wheel)
    expected = {f"tfaploss/recipes/{p.name}" for p in (REPO / "configs").glob("*.yaml")}
    assert len(expected) >= 15
    assert {n for n in names if n.startswith("tfaploss/recipes/")} == expected
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(expected):  # byte for byte what configs/ holds
            assert archive.read(name) == (REPO / "configs" / Path(name).name).read_bytes()


def test_the_font_fetcher_is_package_data(wheel):
    assert "tfaploss/pipelines/fetch_fonts.sh" in _names(wheel)


def test_tfaploss_is_the_only_top_level_package(wheel):
    names = _names(wheel)
    dist_info = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    assert len(dist_info) == 1
    assert {n.split("/")[0] for n in names} == {"tfaploss"} | dist_info
    assert not [n for n in names if n.split("/")[0] in OTHER_TOP_LEVEL]
    top_level = f"{dist_info.pop()}/top_level.txt"
    if top_level in names:
        with zipfile.ZipFile(wheel) as archive:
            assert archive.read(top_level).decode().split() == ["tfaploss"]
