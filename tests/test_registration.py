"""A model.keras written the way `tfaploss train` writes it loads in plain Keras after
one `import tfaploss`, checked in fresh processes."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import tfaploss
from tfaploss.config import config_from_dict
from tfaploss.run import build as B
from tfaploss.training import MultiStageModel, health_metrics

ROOT = Path(__file__).resolve().parents[1]

# The child loads both files and compares their embeddings with the parent's.
_LOAD = """
import json, sys
import numpy as np
{imports}
import keras
folder = sys.argv[1]
images = np.load(folder + "/images.npy")
out = {{}}
try:
    model = keras.saving.load_model(folder + "/model.keras")
    trainer = keras.saving.load_model(folder + "/trainer.keras")
    out["model"] = np.asarray(model(images)).tolist()
    out["trainer"] = np.asarray(trainer(images)).tolist()
    out["classes"] = [type(trainer).__name__, type(trainer.optimizer).__name__,
                      type(trainer.loss).__name__]
    out["layers"] = sorted({{type(l).__name__ for l in model._flatten_layers()}})
except Exception as err:
    out["error"] = f"{{type(err).__name__}}: {{err}}"
print("RESULT " + json.dumps(out))
"""


def _config():
    return config_from_dict({
        "data": {"batch_size": 8, "m": 4, "image_size": 16},
        "model": {"backbone": "small_cnn", "pooling": "gem", "embedding_dim": 8,
                  "weights": None, "freeze_bn": True, "head_lr_multiplier": 10.0,
                  "bn_calibration_images": 0},
        "loss": {"name": "ROADMAPLoss"},
        "optimizer": {"name": "adam", "lr": 1e-3},
        "training": {"epochs": 1, "steps_per_epoch": 2, "chunk_size": 4},
    }, warn=False)


def _child(script, folder):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.Popen([sys.executable, "-c", script, str(folder)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _result(proc):
    out, _ = proc.communicate(timeout=600)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained embedding model and its MultiStageModel trainer, as `tfaploss train`
    builds them (config builder, LR-multiplier optimizer, schedule, ROADMAP loss,
    health metrics), saved; two fresh processes start loading them at once."""
    folder = tmp_path_factory.mktemp("saved")
    cfg = _config()
    keras.utils.set_random_seed(0)
    model = B.build_model(cfg)
    trainer = MultiStageModel(model, chunk_size=cfg.training.chunk_size)
    trainer.compile(optimizer=B.build_optimizer(cfg, 2), loss=B.build_loss(cfg),
                    metrics=health_metrics())
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (8, 16, 16, 3)).astype("float32")
    y = np.repeat([0, 1], 4).astype("int32")
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.save(folder / "model.keras")
    trainer.save(folder / "trainer.keras")
    images = rng.uniform(0, 255, (3, 16, 16, 3)).astype("float32")
    np.save(folder / "images.npy", images)
    children = {
        "tfaploss": _child(_LOAD.format(imports="import tfaploss"), folder),
        "keras_only": _child(_LOAD.format(imports=""), folder),
    }
    return {"expected": np.asarray(model(images)), "children": children}


@pytest.mark.slow
def test_plain_keras_load_after_import_tfaploss(saved):
    out = _result(saved["children"]["tfaploss"])
    assert "error" not in out, out.get("error")
    np.testing.assert_allclose(out["model"], saved["expected"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["trainer"], saved["expected"], rtol=1e-5, atol=1e-6)
    assert out["classes"] == ["MultiStageModel", "LRMultiplierOptimizer", "ROADMAPLoss"]
    # The classes that once failed to load are among those that came back.
    assert {"ImageNetNormalization", "FrozenBatchNormalization", "GeM",
            "L2Normalize"} <= set(out["layers"])


@pytest.mark.slow
def test_keras_alone_names_the_tfaploss_package(saved):
    out = _result(saved["children"]["keras_only"])
    # Keras cannot import an unknown package by itself; its error names the class by
    # its registered name, which says where it comes from.
    assert "error" in out
    assert "tfaploss>ImageNetNormalization" in out["error"]


def _library_keras_classes():
    """Every Keras-saveable class defined in the modules tfaploss registers."""
    import importlib
    import pkgutil

    from tfaploss._registration import REGISTERING_MODULES

    saveable = (keras.layers.Layer, keras.losses.Loss, keras.optimizers.Optimizer,
                keras.metrics.Metric, keras.optimizers.schedules.LearningRateSchedule)
    # MultiStageModel's per-backend steps import their framework (torch, jax), which a
    # TensorFlow-only install lacks; they define no saveable class.
    other_backends = {f"tfaploss.training.multistage_{b}" for b in ("tf", "jax", "torch")}
    other_backends.discard("tfaploss.training.multistage_" + {
        "tensorflow": "tf", "jax": "jax", "torch": "torch"}[keras.backend.backend()])
    found = {}
    for root in REGISTERING_MODULES:
        module = importlib.import_module(root)
        names = [root]
        if hasattr(module, "__path__"):
            # Every module below, subpackages' too (tfaploss.training.health.metrics).
            names += [m.name for m in pkgutil.walk_packages(module.__path__, f"{root}.")]
        for name in names:
            if name in other_backends:
                continue
            for cls_name, cls in inspect.getmembers(importlib.import_module(name),
                                                    inspect.isclass):
                if (issubclass(cls, saveable) and cls.__module__ == name
                        and not cls_name.startswith("_")):
                    found[cls_name] = cls
    return found


def test_every_saved_class_is_registered_under_tfaploss():
    registered = tfaploss.register_keras_objects()
    classes = _library_keras_classes()
    assert {"ImageNetNormalization", "FrozenBatchNormalization", "MultiStageModel",
            "LRMultiplierOptimizer", "ROADMAPLoss", "RecipeSchedule", "GeM",
            "BatchHealthMetric"} <= set(classes)
    missing = sorted(n for n, c in classes.items()
                     if registered.get(f"tfaploss>{n}") is not c)
    assert not missing, f"not registered as tfaploss>Name: {missing}"


def test_import_tfaploss_does_not_import_keras():
    code = ("import sys, tfaploss; "
            "print(sorted(m for m in ('keras', 'tensorflow', 'apache_beam', 'scann') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300,
                         check=False)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
