"""SupRecallLoss and SupNDCGLoss against goldens of the authors' code
(github.com/elias-ramzi/SupRank, tests/goldens/suprank.json), on the backend the tests
run on, float64 (float32 on PyTorch, see ``backend.FLOAT64``).

Cases (tests/goldens/README.md): ``A`` 32 items of 11 classes of unequal sizes with
three singletons and exactly tied scores (the full gradient is stored); ``E`` 32 items,
8 classes of 4 (the only layout the authors' ``SupRecallLoss`` class accepts; its result
is stored beside the per-query form); ``L`` 256 items, 60 classes with 7 singletons and
ties (loss, gradient norm and projection). The goldens ran the authors' losses on
``F.normalize(X)`` and differentiated with respect to ``X``, so ``normalize=True``
matches the whole gradient.
"""

import functools

import numpy as np
import pytest

from tests.backend_agnostic.backend import (
    DTYPE,
    FLOAT64,
    MODES,
    load_golden,
    loss_value_and_grad,
)
from tfaploss import losses

GOLDENS = load_golden("suprank.json")
# 1e-6 relative: the authors' SupNDCG computes its IDCG in float32 even on float64
# inputs (~4e-8 relative); SupRecall agrees to ~1e-14. PyTorch runs in float32 here.
RTOL = 1e-6 if FLOAT64 else 1e-5

# the authors' argument names -> ours
_NAMES = {"tau": "temperature", "rho": "rho", "delta": "delta", "start": "start",
          "offset": "offset", "at_k": "at_k", "temp": "recall_temperature"}


def make_loss(key):
    setting = GOLDENS["settings"][key]
    kwargs = {_NAMES[name]: value for name, value in setting["kwargs"].items()}
    if key.endswith("classdefault"):
        kwargs["offset"] = None  # the authors' class default (ours follow their configs)
    cls = losses.SupRecallLoss if setting["kind"] == "recall" else losses.SupNDCGLoss
    return cls(dtype=DTYPE, **kwargs)


def _inputs(case):
    data = GOLDENS["inputs"][case]
    return np.asarray(data["X"], dtype=np.float64), np.asarray(data["y"])


def test_golden_settings_cover_the_shipped_configs():
    settings = GOLDENS["settings"]
    assert {"suprecall_sop", "suprecall_inat", "suprecall_at10", "supndcg_sop",
            "supndcg_inat"} <= set(settings)
    # our defaults are the SOP configs'
    for key, cls in (("suprecall_sop", losses.SupRecallLoss),
                     ("supndcg_sop", losses.SupNDCGLoss)):
        config = cls().get_config()
        for name, value in settings[key]["kwargs"].items():
            expected = list(value) if isinstance(value, list) else value
            assert config[_NAMES[name]] == expected, (key, name)


# Every setting on A (singletons, ties, unequal classes); the SOP settings also on E
# and on the 256-item L (kept short: JAX compiles every loss's loops).
CHECKS = ([(key, "A") for key in sorted(GOLDENS["settings"])]
          + [(key, case) for key in ("suprecall_sop", "supndcg_sop") for case in "EL"])


@functools.cache
def _eager(key, case):
    x, y = _inputs(case)
    return loss_value_and_grad(make_loss(key), y, x)


@pytest.mark.parametrize("key,case", CHECKS)
def test_losses_and_gradient_summaries(key, case):
    ref = GOLDENS["results"][key][case]
    x, _ = _inputs(case)
    value, grad = _eager(key, case)
    np.testing.assert_allclose(value, ref["loss"], rtol=RTOL)
    np.testing.assert_allclose(np.linalg.norm(grad), ref["grad_fro"], rtol=RTOL)
    w = np.random.default_rng(99).standard_normal(x.shape)
    np.testing.assert_allclose(np.sum(grad * w), ref["grad_dot_W"], rtol=0,
                               atol=RTOL * ref["grad_fro"] * np.sqrt(x.size))
    np.testing.assert_allclose(grad[0, :4], ref["grad_row0_first4"], rtol=0,
                               atol=RTOL * np.abs(grad).max())


def test_authors_class_equals_per_query_form():
    """On E (equal classes) the stored result of the authors' SupRecallLoss class is the
    per-query form the other cases use, so those goldens are the class's formula."""
    for key, setting in GOLDENS["settings"].items():
        if setting["kind"] == "recall":
            results = GOLDENS["results"][key]
            assert results["E_authors_class"]["loss"] == pytest.approx(
                results["E"]["loss"], rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key", ["suprecall_sop", "supndcg_sop"])
def test_full_gradient_case_a(key, mode):
    ref = GOLDENS["results"][key]["A"]
    golden = np.asarray(ref["grad"])
    x, y = _inputs("A")
    value, grad = (_eager(key, "A") if mode == "eager"
                   else loss_value_and_grad(make_loss(key), y, x, mode))
    np.testing.assert_allclose(value, ref["loss"], rtol=RTOL)
    np.testing.assert_allclose(grad, golden, rtol=0, atol=RTOL * np.abs(golden).max())
