"""HAPLoss against HAPPIER's own ``HAPLoss`` (tests/goldens/hap.json), on the backend the
tests run on (TensorFlow, JAX, PyTorch): loss values, full gradients of the small cases,
gradient norm and projection of the B = 256 cases.

The goldens' relevance matrix went through float32 in the authors' code
(``get_relevances_pop``), so float64 results agree to ~1e-8, not to rounding: the
tolerance here is 1e-6 relative (1e-5 where the backend computes in float32).
"""

import numpy as np
import pytest

from tests.backend_agnostic.backend import DTYPE, FLOAT64, MODES, load_golden, loss_value_and_grad
from tfaploss.losses import HAPLoss, SupAPLoss

GOLDENS = load_golden("hap.json")
RTOL = 1e-6 if FLOAT64 else 1e-5
# The B = 256 cases run compiled where the backend compiles (JAX's eager dispatch of
# the block loop's ops is slow; TensorFlow's XLA compile is too).
FAST = "jit" if "jit" in MODES else "eager"


def _case(name):
    case = GOLDENS["cases"][name]
    constants = GOLDENS["constants"][case["constants"]]
    return case, np.asarray(case["X"], np.float64), np.asarray(case["y"]), constants


def _projection_matrix(shape):
    return np.sin(np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + 1.0)


def _tangential(grad, x):
    return grad - np.sum(grad * x, axis=1, keepdims=True) * x


def test_goldens_cover_the_requested_settings():
    assert GOLDENS["commit"] == "5af91b3ac6c216a936232da33b42af7efaba5c6b"
    levels = {name: np.asarray(c["y"]).shape[1] for name, c in GOLDENS["cases"].items()}
    assert levels == {"A": 3, "B": 2, "C": 4, "N": 3}
    _, xb, yb, _ = _case("B")
    assert xb.shape[0] >= 256
    _, counts = np.unique(yb[:, 0], return_counts=True)
    assert (counts == 1).any()  # singleton fine classes
    scores = xb @ xb.T
    assert len(np.unique(scores[0])) < scores.shape[1] - 3  # exact ties


@pytest.mark.parametrize(("name", "mode"), [("A", mode) for mode in MODES] + [("N", FAST)])
def test_loss_and_full_gradient(name, mode):
    case, x, y, constants = _case(name)
    value, grad = loss_value_and_grad(HAPLoss(**constants, normalize=False, dtype=DTYPE),
                                      y, x, mode)
    golden = np.asarray(case["grad"])
    np.testing.assert_allclose(value, case["loss"], rtol=RTOL)
    np.testing.assert_allclose(grad, golden, rtol=0, atol=RTOL * np.abs(golden).max())


def test_normalize_true_matches_the_tangential_gradient():
    # The authors' loss takes the network's unit-norm output as is; re-normalising
    # removes the radial part of the gradient only.
    case, x, y, constants = _case("N")
    value, grad = loss_value_and_grad(HAPLoss(**constants, dtype=DTYPE), y, x, FAST)
    golden = np.asarray(case["grad"])
    np.testing.assert_allclose(value, case["loss"], rtol=RTOL)
    np.testing.assert_allclose(grad, _tangential(golden, x), rtol=0,
                               atol=RTOL * np.abs(golden).max())


@pytest.mark.parametrize("name", ["B", "C"])
def test_batch_256_loss_gradient_norm_and_projection(name):
    case, x, y, constants = _case(name)
    value, grad = loss_value_and_grad(HAPLoss(**constants, normalize=False, dtype=DTYPE),
                                      y, x, FAST)
    w = _projection_matrix(x.shape)
    np.testing.assert_allclose(value, case["loss"], rtol=RTOL)
    np.testing.assert_allclose(np.linalg.norm(grad), case["grad_norm"], rtol=RTOL)
    np.testing.assert_allclose(np.sum(grad * w), case["grad_projection"], rtol=0,
                               atol=RTOL * case["grad_norm"] * np.linalg.norm(w))


def test_small_blocks_give_the_same_loss_and_gradient():
    case, x, y, constants = _case("A")
    value, grad = loss_value_and_grad(
        HAPLoss(**constants, normalize=False, pairs_per_block=7, dtype=DTYPE), y, x, FAST)
    np.testing.assert_allclose(value, case["loss"], rtol=RTOL)
    golden = np.asarray(case["grad"])
    np.testing.assert_allclose(grad, golden, rtol=0, atol=RTOL * np.abs(golden).max())


def test_one_level_is_sup_ap():
    _, x, y, _ = _case("A")
    sup = loss_value_and_grad(SupAPLoss(offset=1.44, dtype=DTYPE), y[:, 0], x, FAST)
    for labels in (y[:, 0], y[:, :1]):
        hap = loss_value_and_grad(HAPLoss(offset=1.44, dtype=DTYPE), labels, x, FAST)
        np.testing.assert_allclose(hap[0], sup[0], rtol=1e-9 if FLOAT64 else 1e-5)
        np.testing.assert_allclose(hap[1], sup[1], rtol=0,
                                   atol=RTOL * np.abs(sup[1]).max())
