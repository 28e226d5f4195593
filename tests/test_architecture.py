"""The tree follows the data's path, with no circles.

The rules are import-linter contracts in ``pyproject.toml`` (``[tool.importlinter]``):
the layers, the package root that only the command line reads, and no cycle between
the modules of any package. ``lint-imports`` in the repository root checks them by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
ROOTS = ("tfaploss",)
CHECK = ("import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(no_cache=True, no_logo=True))")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", CHECK], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def _contracts(root: Path = ROOT) -> dict[str, dict]:
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    return {c["id"]: c for c in config["tool"]["importlinter"]["contracts"]}


def test_contracts_are_kept():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_package_has_a_layer():
    named = {name.strip() for layer in _contracts()["layers"]["layers"]
             for name in layer.split("|")}
    units = set()
    for path in (ROOT / "tfaploss").iterdir():
        if path.name.startswith("__"):
            continue
        if path.suffix == ".py" or (path / "__init__.py").is_file():
            units.add(f"tfaploss.{path.stem}")
    missing = sorted(units - named)
    assert not missing, f"give these a layer in pyproject.toml's import contracts: {missing}"


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    """The packages' sources and the contracts, copied, for the probes to break."""
    root = tmp_path_factory.mktemp("tree")
    shutil.copy(ROOT / "pyproject.toml", root)
    for package in ROOTS:
        shutil.copytree(ROOT / package, root / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return root


# Each probe adds modules to a copy of the tree; the named contract must break.
PROBES = {
    "upward import": ("layers", {"tfaploss/ops/probe.py": "import tfaploss.run.trainer\n"}),
    "lazy upward import": ("layers", {
        "tfaploss/models/probe.py": "def f():\n    from tfaploss.evaluation import metrics\n"}),
    "siblings of one layer": ("layers", {"tfaploss/losses/probe.py": "import tfaploss.models.heads\n"}),
    "root's names": ("root", {
        "tfaploss/losses/probe.py": "from tfaploss import __version__\n"}),
    "module cycle": ("cycles", {
        "tfaploss/evaluation/probe_a.py": "from tfaploss.evaluation import probe_b\n",
        "tfaploss/evaluation/probe_b.py": "from tfaploss.evaluation import probe_a\n"}),
    "cycle of three": ("cycles", {
        "tfaploss/pipelines/probe_a.py": "def f():\n    import tfaploss.pipelines.probe_b\n",
        "tfaploss/pipelines/probe_b.py": "import tfaploss.pipelines.probe_c\n",
        "tfaploss/pipelines/probe_c.py": "from tfaploss.pipelines import probe_a\n"}),
}


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_the_contracts_catch(tree_copy, probe, tmp_path):
    contract, files = PROBES[probe]
    root = tmp_path / "tree"
    shutil.copytree(tree_copy, root)
    for name, text in files.items():
        (root / name).write_text(text, encoding="utf-8")
    result = _lint(root)
    assert result.returncode == 1, result.stdout + result.stderr
    broken = result.stdout.split("Broken contracts")[-1]
    assert _contracts(root)[contract]["name"] in broken, result.stdout
    assert "probe" in broken, result.stdout  # broken by the probe, not by something else
