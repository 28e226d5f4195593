"""The tree follows the data's path, with no circles.

raw files -> ``pipelines`` -> TFRecords -> ``tfaploss.data`` -> ``models`` ->
``tfaploss.losses`` / ``tfaploss.training`` -> ``tfaploss.run`` -> ``tfaploss.evaluation``
-> ``tfaploss.export``. Each package below may import only packages of a strictly lower
layer (every import counts, including the lazy ones inside functions), so the import
graph between packages has no cycle and a reader can learn the tree bottom-up. A new
package fails this test until it is given a layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("tfaploss", "pipelines", "models")

# Unit -> layer. A unit is a top-level package, or a direct child of ``tfaploss``.
LAYERS = {
    # Foundations: no other tfaploss package.
    "tfaploss._registration": 0,
    "tfaploss._keras_compat": 0,    # the one home of Keras's private names
    # Crash safety: atomic files, checkpoints, run-directory checks, locks, fault points.
    # A foundation because the Beam jobs (pipelines) take its locks and fault points; the
    # one part that needs the config schema (same config?) is tfaploss.run.resume.
    "tfaploss.durable": 0,
    "tfaploss.log": 0,              # the logging scheme (loggers, CLI handler)
    "tfaploss.ops": 0,              # backend kernels the losses share
    # Building blocks, each standing alone.
    "tfaploss.data": 1,             # TFRecords -> batches
    "models": 1,                    # backbones and embedding heads
    "tfaploss.losses": 1,
    "tfaploss.evaluation": 1,       # search and metrics over embeddings
    # What combines blocks.
    "tfaploss.training": 2,         # multi-stage step, health, checkpoints (uses models)
    "tfaploss.config": 2,           # the schema checks a loss section against its class
    "tfaploss.export": 2,           # SavedModel around a model
    "pipelines": 2,                 # Beam jobs (read ground truth as evaluation does)
    # The run: a config carried out end to end.
    "tfaploss.run": 3,
    # Applications.
    "tfaploss.demo": 4,
    "tfaploss.compare": 4,          # the comparison protocol over runs
    # The package root imports what registers tfaploss's Keras classes (every layer);
    # modules import the submodule they need, never the root's names.
    "tfaploss": 5,
    "tfaploss.cli": 6,              # the command line (reads the root's __version__)
}


def _unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "tfaploss" and len(parts) > 1 else parts[0]


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path):
    """Every module of ours that ``path`` imports, with the line."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from tfaploss import losses` imports tfaploss.losses, not just tfaploss.
            names = [f"{node.module}.{a.name}" for a in node.names
                     if _is_module(f"{node.module}.{a.name}")] or [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] in OURS:
                yield name, node.lineno


def _package_modules():
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            yield module.removesuffix(".__init__"), path


def test_every_package_has_a_layer():
    units = {_unit(module) for module, _ in _package_modules()}
    missing = sorted(units - set(LAYERS))
    assert not missing, f"give these packages a layer in {Path(__file__).name}: {missing}"


def test_imports_only_go_down_the_layers():
    upward = []
    for module, path in _package_modules():
        source = _unit(module)
        for name, line in _imports(path):
            target = _unit(name)
            if target == source or target not in LAYERS or source not in LAYERS:
                continue
            if LAYERS[target] >= LAYERS[source]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({source}, layer "
                              f"{LAYERS[source]}) imports {name} (layer {LAYERS[target]})")
    assert not upward, "imports against the data's path:\n" + "\n".join(upward)


@pytest.mark.parametrize("source, target", [
    ("tfaploss.losses", "tfaploss.training"),
    ("tfaploss.config", "tfaploss.run"),
    ("tfaploss.run", "tfaploss.cli"),
])
def test_the_rule_catches_an_upward_import(source, target):
    assert LAYERS[target] > LAYERS[source]
