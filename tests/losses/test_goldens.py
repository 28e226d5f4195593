"""Every loss against the original implementations' goldens (tests/goldens), on the
backend the tests run on: loss values of cases A, B, D and the full gradient of case A,
float64 (float32 where the backend cannot, see ``backend.FLOAT64``), in each mode.

Gradient conventions (tests/goldens/README.md): the references that did not re-normalise
their input are matched by ``normalize=False`` whole and by ``normalize=True`` in the
tangential part; those that re-normalise (calibration, FastAP of PML) whole.
"""

from pathlib import Path

import numpy as np
import pytest

from tests.support.backend import (
    DTYPE,
    GRAD_RTOL,
    LOSS_RTOL,
    MODES,
    load_golden,
    loss_value_and_grad,
)
from tfaploss import losses

GOLDENS = load_golden("smooth_rank_losses.json")
APLOSS = load_golden("aploss_histogram.json")["batch_and_hand_cases"]

# golden key -> (loss, golden gradient is "raw" (normalize=False) or "tangential"/"whole"
# for normalize=True, factor applied to our loss)
CASES = {
    "roadmap_smoothap": (lambda: losses.SmoothAPLoss(normalize=False, dtype=DTYPE), "raw"),
    "smoothap_brown_orig": (lambda: losses.SmoothAPLoss(dtype=DTYPE), "tangential"),
    "roadmap_supap_classdefault": (lambda: losses.SupAPLoss(normalize=False, dtype=DTYPE),
                                   "raw"),
    "roadmap_supap_sop": (lambda: losses.SupAPLoss(offset=1.44, dtype=DTYPE), "tangential"),
    "roadmap_supap_inat": (lambda: losses.SupAPLoss(start=0.0, offset=1.0, dtype=DTYPE),
                           "tangential"),
    "pnp_orig_PNP-D_q_alpha4": (lambda: losses.PNPLoss(normalize=False, dtype=DTYPE), "raw"),
    "pnp_orig_PNP-I_b_b2": (lambda: losses.PNPLoss(variant="Ib", normalize=False,
                                                   dtype=DTYPE), "raw"),
    "roadmap_calibration": (lambda: losses.CalibrationLoss(dtype=DTYPE), "whole"),
    "roadmap_fastap_pml099": (lambda: losses.FastAPLoss(dtype=DTYPE), "whole"),
    "roadmap_blackboxap_margin0": (lambda: losses.BlackBoxAPLoss(margin=0.0, dtype=DTYPE),
                                   "tangential"),
    "roadmap_softbinap": (lambda: losses.APLoss(include_self=True, dtype=DTYPE),
                          "tangential"),
}
# The original BlackBox AP casts its rank ratios to float32 (README): 5e-9 apart.
LOSS_ATOL = {"roadmap_blackboxap_margin0": 5e-9}


def _inputs(case):
    data = GOLDENS["inputs"][case]
    return np.asarray(data["X"], dtype=np.float64), np.asarray(data["y"])


def _tangential(grad, x):
    return grad - np.sum(grad * x, axis=1, keepdims=True) * x


@pytest.mark.parametrize("key", sorted(CASES))
def test_loss_values_cases_a_b_d(key):
    make, _ = CASES[key]
    for case, ref in GOLDENS["results"][key].items():
        if case not in ("A", "B", "D"):
            continue
        x, y = _inputs(case)
        value, _ = loss_value_and_grad(make(), y, x)
        np.testing.assert_allclose(value, ref["loss"], rtol=LOSS_RTOL,
                                   atol=LOSS_ATOL.get(key, 0.0), err_msg=case)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key", sorted(CASES))
def test_full_gradient_case_a(key, mode):
    make, convention = CASES[key]
    golden = np.asarray(GOLDENS["full_grad_case_A"][key])
    x, y = _inputs("A")
    value, grad = loss_value_and_grad(make(), y, x, mode)
    np.testing.assert_allclose(value, GOLDENS["results"][key]["A"]["loss"], rtol=LOSS_RTOL,
                               atol=LOSS_ATOL.get(key, 0.0))
    expected = _tangential(golden, x) if convention == "tangential" else golden
    np.testing.assert_allclose(grad, expected, rtol=0,
                               atol=GRAD_RTOL * max(np.abs(golden).max(), 1e-3))


def _setting(key):
    nq, lo, hi = key.split("_")
    return int(nq[2:]), (float(lo), float(hi))


def test_histogram_ap_batch32_all_settings():
    rs = np.random.RandomState(0)
    x, labels = rs.randn(32, 16), rs.randint(0, 4, 32)
    np.testing.assert_array_equal(labels, APLOSS["batch_labels"])
    checked = 0
    for key, expected in APLOSS["batch32"].items():
        if not key.startswith("nq"):
            continue
        num_bins, score_range = _setting(key)
        kwargs = {"num_bins": num_bins, "score_range": score_range, "dtype": DTYPE}
        for loss, golden in [(losses.APLoss(include_self=True, **kwargs), "loss_self_included"),
                             (losses.APLoss(**kwargs), "loss_self_excluded"),
                             (losses.TieAwareAPLoss(**kwargs), "tap_loss_excl"),
                             (losses.TieAwareAPLoss(simplified=True, **kwargs),
                              "taps_loss_excl")]:
            value, _ = loss_value_and_grad(loss, labels, x)
            np.testing.assert_allclose(value, expected[golden], rtol=LOSS_RTOL, err_msg=key)
            checked += 1
    assert checked >= 8
    value, _ = loss_value_and_grad(losses.APLoss(class_balanced=True, dtype=DTYPE), labels, x)
    np.testing.assert_allclose(value, APLOSS["class_balanced"]["ref_loss"], rtol=LOSS_RTOL)


@pytest.mark.parametrize("mode", MODES)
def test_histogram_ap_batch32_gradient(mode):
    rs = np.random.RandomState(0)
    x, labels = rs.randn(32, 16), rs.randint(0, 4, 32)
    golden = APLOSS["grad_nq20_m1_1"]
    value, grad = loss_value_and_grad(losses.APLoss(dtype=DTYPE), labels, x, mode)
    np.testing.assert_allclose(value, golden["loss"], rtol=LOSS_RTOL)
    atol = GRAD_RTOL * max(np.abs(grad).max(), 1e-3)
    np.testing.assert_allclose(grad[0, :4], golden["grad_row0_first4"], atol=atol, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(grad), golden["grad_fro"], rtol=LOSS_RTOL * 10)


@pytest.mark.parametrize("mining", ["semihard", "hard", "all"])
def test_triplet_and_contrastive_match_tf_addons_definitions(mining):
    from tests.support import reference

    rng = np.random.default_rng(5)
    labels = rng.integers(0, 4, 14)
    x = rng.standard_normal((14, 5))
    ref = {"semihard": reference.triplet_semihard_reference,
           "hard": reference.triplet_hard_reference,
           "all": reference.triplet_all_reference}[mining]
    value, grad = loss_value_and_grad(losses.TripletLoss(mining=mining, dtype=DTYPE),
                                      labels, x)
    np.testing.assert_allclose(value, ref(x, labels), rtol=LOSS_RTOL)
    fd = reference.numerical_gradient(lambda z: ref(z, labels), x)
    np.testing.assert_allclose(grad, fd, rtol=0, atol=max(1e-6, GRAD_RTOL) * np.abs(fd).max())
    value, _ = loss_value_and_grad(losses.ContrastiveLoss(dtype=DTYPE), labels, x)
    np.testing.assert_allclose(value, reference.contrastive_reference(x, labels),
                               rtol=LOSS_RTOL)
    balanced = reference.contrastive_per_query_reference
    value, grad = loss_value_and_grad(
        losses.ContrastiveLoss(averaging="per_query", dtype=DTYPE), labels, x)
    np.testing.assert_allclose(value, balanced(x, labels), rtol=LOSS_RTOL)
    fd = reference.numerical_gradient(lambda z: balanced(z, labels), x)
    np.testing.assert_allclose(grad, fd, rtol=0, atol=max(1e-6, GRAD_RTOL) * np.abs(fd).max())


@pytest.mark.slow
def test_other_backends_never_import_tensorflow():
    """On JAX and PyTorch the losses and ops are keras.ops only: a fresh process (this one
    also holds the TensorFlow-only test modules) computes the value and
    gradient of one golden case of every loss class, and TensorFlow is imported exactly when it is the backend."""
    import subprocess
    import sys

    from tests.support.backend import BACKEND

    if BACKEND == "tensorflow":
        pytest.skip("TensorFlow is the backend here: the check is for JAX and PyTorch")
    code = (
        "import sys\n"
        "from tests.losses.test_goldens import CASES, _inputs\n"
        "from tests.support.backend import loss_value_and_grad\n"
        "x, y = _inputs('B')\n"
        "seen = set()\n"
        "for make, _ in CASES.values():\n"
        "    loss = make()\n"
        "    if type(loss) not in seen:  # every loss class once: its code path\n"
        "        seen.add(type(loss))\n"
        "        loss_value_and_grad(loss, y, x)\n"
        "print('tensorflow' in sys.modules)\n")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == str(BACKEND == "tensorflow")
