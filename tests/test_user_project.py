"""tfaploss inside a user's project: their own ``models.py``, ``models/`` and
``pipelines/`` beside ours.

``models`` and ``pipelines`` are the commonest names in a Keras project. When tfaploss
installed them as top-level packages, a user's ``models.py`` in the working folder
shadowed ours and ``import tfaploss.training`` failed. Everything of ours now lives under
``tfaploss``; these tests run, from such a folder, what a user runs: a Beam job, an
import of every public module, ``tfaploss train`` and ``tfaploss evaluate``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.support.miniature import write_square_classes

pytestmark = pytest.mark.slow

# What the user's own modules say about themselves, so that the script can tell theirs
# from ours in sys.modules.
USER_MARK = "the user's own"

# The user's folder's modules import the user's ``models/`` package first, so that both
# of their names are in sys.modules before tfaploss is imported: the worst case.
CHECK_SCRIPT = textwrap.dedent('''\
    """The user's script: imports their own modules, then every public module of
    tfaploss, then trains and evaluates through the tfaploss command."""
    import importlib, json, pkgutil, sys

    import models, pipelines, layers
    from models import blocks

    assert models.MARK == blocks.MARK == pipelines.MARK == layers.MARK, "user modules"

    import tfaploss

    imported, missing_extras = ["tfaploss"], []
    for info in pkgutil.walk_packages(tfaploss.__path__, "tfaploss."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts[1:]):
            continue  # private modules, and __main__ (which would run the command)
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as err:
            if err.name.split(".")[0] in ("tfaploss", "models", "pipelines", "layers"):
                raise
            missing_extras.append([info.name, err.name])  # an optional extra
            continue
        imported.append(info.name)

    # Ours are ours, and the user's are still theirs.
    ours = [name for name in sys.modules if name.split(".")[0] in ("models", "pipelines")]
    theirs = {name: getattr(sys.modules[name], "MARK", None) for name in ours}
    from tfaploss.cli import main

    config, records, out = sys.argv[1:]
    train = main(["train", "--config", config])
    evaluate = main(["evaluate", "--model", json.load(open(config + ".json"))["model"],
                     "--data", records + "/test", "--ks", "1,2", "--backend", "exact",
                     "--out", out])
    print("RESULT " + json.dumps({"imported": imported, "missing_extras": missing_extras,
                                  "theirs": theirs, "train": train, "evaluate": evaluate}))
''')


def _user_project(root: Path) -> None:
    """A Keras project as users write them: models.py, models/, pipelines/, layers.py."""
    mark = f"MARK = {USER_MARK!r}\n"
    (root / "models.py").write_text(mark)  # shadowed by models/ below: both exist
    (root / "models").mkdir()
    (root / "models" / "__init__.py").write_text(mark)
    (root / "models" / "blocks.py").write_text(mark)
    # The names tfaploss's own modules had inside models/ and pipelines/.
    (root / "models" / "batch_norm.py").write_text(mark + "raise ImportError('user code')\n")
    (root / "pipelines").mkdir()
    (root / "pipelines" / "__init__.py").write_text(mark)
    for name in ("folder", "runner", "storage", "console"):
        (root / "pipelines" / f"{name}.py").write_text(
            mark + "raise ImportError('user code')\n")
    (root / "layers.py").write_text(mark)
    (root / "check.py").write_text(CHECK_SCRIPT)


def _public_modules() -> set[str]:
    """Every module of the tfaploss source tree whose dotted name has no private part."""
    import tfaploss

    root = Path(tfaploss.__file__).parent
    names = set()
    for path in root.rglob("*.py"):
        parts = ("tfaploss", *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(p.startswith("_") for p in parts[1:]):
            names.add(".".join(parts))
    return names


def _env() -> dict:
    # PYTHONPATH as a user's shell has it: the project folder is found first.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}


def test_a_project_with_its_own_models_and_pipelines_trains_with_tfaploss(tmp_path):
    pytest.importorskip("apache_beam")
    project = tmp_path / "my_project"
    project.mkdir()
    _user_project(project)
    write_square_classes(tmp_path / "pngs", classes=6, per_class=6)
    records = tmp_path / "records"

    job = subprocess.run(
        [sys.executable, "-m", "tfaploss.pipelines.folder", "--input_dir", tmp_path / "pngs",
         "--output_dir", records, "--test_classes", "c3,c4,c5",
         "--direct_running_mode", "in_memory", "--direct_num_workers", "1"],
        cwd=project, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert job.returncode == 0, job.stderr[-3000:]
    assert json.loads((records / "train" / "manifest.json").read_text())["job"] == (
        "tfaploss.pipelines.folder")

    run_dir = tmp_path / "run"
    config = project / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "description": "a user's tiny run",
        "run_dir": str(run_dir),
        "data": {"train": str(records / "train"), "test": str(records / "test"),
                 "sampler": "m_per_class", "batch_size": 6, "m": 2, "image_size": 16},
        "model": {"backbone": "small_cnn", "pooling": "gem", "embedding_dim": 8,
                  "weights": None, "bn_calibration_images": 6},
        "loss": {"name": "SmoothAPLoss"},
        "optimizer": {"name": "adam", "lr": 1e-3},
        "training": {"epochs": 1, "steps_per_epoch": 2, "chunk_size": 3},
        "evaluation": {"every_n_epochs": 0, "at_end": True, "ks": [1, 2],
                       "backend": "exact"},
    }))
    (project / "tiny.yaml.json").write_text(json.dumps({"model": str(run_dir / "model.keras")}))

    done = subprocess.run(
        [sys.executable, "check.py", str(config), str(records), str(tmp_path / "eval")],
        cwd=project, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])

    assert result["train"] == 0 and result["evaluate"] == 0, done.stdout[-3000:]
    # Every public module imported (an optional extra not installed is the only excuse).
    must = {"tfaploss.training", "tfaploss.models", "tfaploss.models.batch_norm",
            "tfaploss.pipelines", "tfaploss.pipelines.folder", "tfaploss.losses",
            "tfaploss.run.trainer", "tfaploss.evaluation.evaluator", "tfaploss.export",
            "tfaploss.cli", "tfaploss.demo", "tfaploss.compare"}
    assert must <= set(result["imported"]), sorted(must - set(result["imported"]))
    tried = set(result["imported"]) | {name for name, _ in result["missing_extras"]}
    assert tried == _public_modules(), sorted(_public_modules() ^ tried)
    # The only top-level models / pipelines in the process are still the user's.
    assert result["theirs"] and set(result["theirs"].values()) == {USER_MARK}, result["theirs"]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= summary["final_metrics"]["recall@1"] <= 1.0
    metrics = json.loads(next((tmp_path / "eval").glob("*.json")).read_text())
    assert metrics, "evaluate wrote no metrics"
