"""MultiSimilarityLoss (with and without its miner), SupConLoss and ProxyAnchorLoss
against pytorch-metric-learning 2.9 (tests/goldens/pml_peers.json), on the backend the
tests run on, float64 (float32 on PyTorch, see ``backend.FLOAT64``).

Cases (tests/goldens/README.md): ``A`` 32 items, 9 classes of 1 to 8 with two
singletons; ``B`` 40 items, 8 classes of 2 to 8; ``S`` 12 singletons (no positive
pair); ``L`` 256 items, 58 classes of 1 to 16 (loss, gradient norm and projection).
Gradients are with respect to the raw embeddings (PML normalises inside, as
``normalize=True`` does), and for Proxy-Anchor also with respect to the raw proxies.
"""

import functools

import keras
import numpy as np
import pytest

from tests.backend_agnostic.backend import (
    DTYPE,
    FLOAT64,
    GRAD_RTOL,
    LOSS_RTOL,
    MODES,
    load_golden,
    loss_value_and_grad,
    to_numpy,
    value_and_grad,
)
from tfaploss import losses

GOLDENS = load_golden("pml_peers.json")
# PML agrees to ~1e-15 in float64 (measured); PyTorch runs in float32 here.
RTOL = 1e-10 if FLOAT64 else LOSS_RTOL
GTOL = 1e-10 if FLOAT64 else GRAD_RTOL


def _inputs(case):
    data = GOLDENS["inputs"][case]
    return (np.asarray(data["X"], dtype=np.float64), np.asarray(data["y"]),
            np.asarray(data["P"], dtype=np.float64), data["num_classes"])


def make_loss(key, case, **extra):
    setting = GOLDENS["settings"][key]
    family, kwargs = setting["family"], dict(setting["kwargs"])
    if family == "multi_similarity_mined":
        return losses.MultiSimilarityLoss(dtype=DTYPE, **kwargs["loss"], **kwargs["miner"],
                                          **extra)
    if family == "multi_similarity":
        return losses.MultiSimilarityLoss(dtype=DTYPE, **kwargs, **extra)
    if family == "supcon":
        return losses.SupConLoss(dtype=DTYPE, **kwargs, **extra)
    _, _, proxies, num_classes = _inputs(case)
    loss = losses.ProxyAnchorLoss(num_classes, dtype=DTYPE, **kwargs, **extra)
    loss.proxies_layer.set_proxies(proxies)
    return loss


def _tolerance(golden):
    return GTOL * max(np.abs(golden).max(), 1e-300)


def test_goldens_cover_the_defaults_and_pml_versions():
    assert GOLDENS["source"]["pml_version"] == "2.9.0"
    defaults = {"multi_similarity": losses.MultiSimilarityLoss().get_config(),
                "supcon": losses.SupConLoss().get_config(),
                "proxy_anchor": losses.ProxyAnchorLoss(3).get_config()}
    found = set()
    for setting in GOLDENS["settings"].values():
        family = setting["family"]
        if family in defaults and all(defaults[family][k] == v
                                      for k, v in setting["kwargs"].items()):
            found.add(family)
    assert found == set(defaults)  # our defaults are PML's, and goldens hold them


# Every setting on every case; the full gradient where it is stored.
CHECKS = [(key, case) for key in sorted(GOLDENS["results"]) for case in "ABSL"]


@functools.cache
def _eager(key, case):
    x, y, _, _ = _inputs(case)
    return loss_value_and_grad(make_loss(key, case), y, x)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # S: no positive pair
@pytest.mark.parametrize("key,case", CHECKS)
def test_value_and_gradient_equal_pml(key, case):
    ref = GOLDENS["results"][key][case]
    x, _, _, _ = _inputs(case)
    value, grad = _eager(key, case)
    if case == "S" and GOLDENS["settings"][key]["family"] == "multi_similarity":
        # A batch without any positive pair: every loss of the library gives 0 (with a
        # warning); PML averages the negative terms (documented in the docstring).
        assert ref["loss"] > 0.01
        assert float(value) == 0.0 and not np.any(grad)
        return
    np.testing.assert_allclose(value, ref["loss"], rtol=RTOL)
    if "grad" in ref:
        golden = np.asarray(ref["grad"])
        if np.any(golden):
            np.testing.assert_allclose(grad, golden, rtol=0, atol=_tolerance(golden))
        else:
            assert not np.any(grad)
        return
    np.testing.assert_allclose(np.linalg.norm(grad), ref["grad_fro"], rtol=RTOL * 10)
    w = np.random.default_rng(99).standard_normal(x.shape)
    np.testing.assert_allclose(np.sum(grad * w), ref["grad_dot_W"], rtol=0,
                               atol=GTOL * ref["grad_fro"] * np.sqrt(x.size))
    np.testing.assert_allclose(grad[0, :4], ref["grad_row0_first4"], rtol=0,
                               atol=_tolerance(grad))


@pytest.mark.parametrize("case", "AB")
@pytest.mark.parametrize("key", [k for k in sorted(GOLDENS["results"])
                                 if GOLDENS["settings"][k]["family"] != "proxy_anchor"])
def test_per_query_terms_equal_pml_element_losses(key, case):
    ref = GOLDENS["results"][key][case]["per_anchor"]
    x, y, _, _ = _inputs(case)
    terms = to_numpy(make_loss(key, case, reduction="none")(y, x))
    np.testing.assert_allclose(terms, np.abs(ref), rtol=RTOL, atol=1e-12 if FLOAT64 else 1e-6)


@pytest.mark.parametrize("case", "ABS")
@pytest.mark.parametrize("key", [k for k in sorted(GOLDENS["results"])
                                 if GOLDENS["settings"][k]["family"] == "proxy_anchor"])
def test_proxy_anchor_terms_and_proxy_gradient_equal_pml(key, case):
    ref = GOLDENS["results"][key][case]
    x, y, proxies, num_classes = _inputs(case)
    loss = make_loss(key, case, reduction="none")
    terms = to_numpy(loss(y, x))
    pos, neg = np.asarray(ref["pos_per_proxy"]), np.asarray(ref["neg_per_proxy"])
    expected = pos * num_classes / ref["pos_divisor"] + neg
    assert ref["neg_divisor"] == num_classes
    np.testing.assert_allclose(terms, expected, rtol=RTOL)

    loss = make_loss(key, case)
    variable = loss.proxies_layer.proxies

    def of_proxies(p):
        with keras.StatelessScope(state_mapping=[(variable, p)]):
            return loss(y, x)

    value, grad = value_and_grad(of_proxies, proxies)
    golden = np.asarray(ref["grad_proxies"])
    np.testing.assert_allclose(value, ref["loss"], rtol=RTOL)
    np.testing.assert_allclose(grad, golden, rtol=0, atol=_tolerance(golden))


@pytest.mark.parametrize("mode", [m for m in MODES if m != "eager"])
@pytest.mark.parametrize("key", ["multi_similarity_mined/alpha=2,beta=50,base=0.5,epsilon=0.1",
                                 "supcon/temperature=0.1", "proxy_anchor/margin=0.1,alpha=32"])
def test_compiled_modes_give_the_eager_gradient(key, mode):
    ref = GOLDENS["results"][key]["A"]
    x, y, _, _ = _inputs("A")
    value, grad = loss_value_and_grad(make_loss(key, "A"), y, x, mode)
    golden = np.asarray(ref["grad"])
    np.testing.assert_allclose(value, ref["loss"], rtol=RTOL)
    np.testing.assert_allclose(grad, golden, rtol=0, atol=_tolerance(golden))


def test_proxy_anchor_sample_weight_weights_items_inside_the_sums():
    """Weight 0 removes an item, weight 2 counts it twice (as a duplicated row would)."""
    x, y, _, _ = _inputs("A")
    key = "proxy_anchor/margin=0.1,alpha=32"
    weights = np.ones(len(y))
    weights[[0, 5]] = 0.0
    weights[7] = 2.0
    keep = weights > 0
    rows = np.concatenate([np.flatnonzero(keep), [7]])
    weighted = to_numpy(make_loss(key, "A")(y, x, sample_weight=weights))
    explicit = to_numpy(make_loss(key, "A")(y[rows], x[rows]))
    np.testing.assert_allclose(weighted, explicit, rtol=RTOL)
    assert abs(float(weighted) - GOLDENS["results"][key]["A"]["loss"]) > 1e-3
