"""The private Keras names tfaploss relies on (tfaploss/_keras_compat.py) still exist.

A Keras upgrade that moves one of them fails here with the name, the Keras version and
what to do, rather than deep inside a training step. Uses no backend API.
"""

import ast
import importlib
import re
from pathlib import Path

import keras
import numpy as np
import pytest

from tfaploss import _keras_compat

ROOT = Path(__file__).resolve().parents[1]
ADVICE = (
    "tfaploss/_keras_compat.py lists the private Keras names tfaploss uses. Find where "
    "Keras {version} keeps '{name}' now (or its public replacement), update "
    "_keras_compat.py and the code that uses it, and widen the keras pin in setup.py "
    "only after `make test` (TensorFlow, JAX and PyTorch) passes on that version."
)


def _fail(name, what):
    pytest.fail(f"{what} in Keras {keras.__version__}.\n"
                + ADVICE.format(version=keras.__version__, name=name), pytrace=False)


def _resolve(dotted):
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("module, name", _keras_compat.PRIVATE_IMPORTS,
                         ids=[f"{m}.{n}" for m, n in _keras_compat.PRIVATE_IMPORTS])
def test_private_imports_exist(module, name):
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        value, problem = None, f"`from {module} import {name}` fails ({error})"
    else:
        problem = None
    if problem:
        _fail(f"{module}.{name}", problem)
    assert getattr(_keras_compat, name) is value


def _instances():
    """A compiled model and a built optimizer: some attributes exist only then."""
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    return {"keras.Model": model, "keras.layers.Layer": model,
            "keras.optimizers.Optimizer": optimizer}


@pytest.mark.parametrize("owner, name, kind, used_in", _keras_compat.PRIVATE_ATTRIBUTES,
                         ids=[f"{o}.{n}" for o, n, _, _ in _keras_compat.PRIVATE_ATTRIBUTES])
def test_private_attributes_exist(owner, name, kind, used_in):
    cls = _resolve(owner)
    target = _instances()[owner] if kind == "instance" else cls
    assert isinstance(target, cls) or target is cls
    if not hasattr(target, name):
        _fail(f"{owner}.{name}", f"`{owner}` has no attribute `{name}` (used in {used_in})")


def test_private_loss_unscaling_is_the_identity_off_tf_distribute():
    """Its contract as MultiStageModel relies on it: a no-op outside a replicated
    strategy (MultiStageModel uses it to undo the per-replica scaling of the loss it
    differentiates, and for the loss it reports)."""
    value = keras.ops.convert_to_tensor(np.float32(2.5))
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(_keras_compat.unscale_loss_for_distribution(value)), 2.5)


def _python_files():
    for folder in ("tfaploss",):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_only_keras_compat_imports_from_keras_src():
    offenders = []
    for path in _python_files():
        if path.name == "_keras_compat.py" and path.parent.name == "tfaploss":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            if any(m == "keras.src" or m.startswith("keras.src.") for m in modules):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, (
        "import private Keras names through tfaploss/_keras_compat.py (and list them "
        f"there): {offenders}")


def test_installed_keras_is_within_the_tested_pin():
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    match = re.search(r'"keras>=(\d+)\.(\d+),<(\d+)\.(\d+)"', setup)
    assert match, "setup.py must pin keras to the tested minors: keras>=X.Y,<X.Z"
    low, high = tuple(map(int, match.groups()[:2])), tuple(map(int, match.groups()[2:]))
    installed = tuple(int(p) for p in keras.__version__.split(".")[:2])
    assert low <= installed < high, (
        f"Keras {keras.__version__} is outside setup.py's tested range "
        f">={low[0]}.{low[1]},<{high[0]}.{high[1]}.\n"
        + ADVICE.format(version=keras.__version__, name="(each name)"))
