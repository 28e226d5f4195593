"""FastAPLoss against Kun He's original and pytorch-metric-learning (goldens)."""

import numpy as np
import pytest
import tensorflow as tf

from tests.support import reference
from tfaploss.losses import FastAPLoss
from tfaploss.ops import fastap, label_masks

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only

KEYS = ["fastap_kunhe_orig", "roadmap_fastap_pml099"]
W99 = np.random.default_rng(99).standard_normal((32, 16))


def _loss_and_grad(x, labels, dtype, **kwargs):
    x = tf.constant(x, dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = FastAPLoss(dtype=dtype, **kwargs)(np.asarray(labels), x)
    return value.numpy(), tape.gradient(value, x).numpy()


def _tangential(g, x):
    return g - (g * x).sum(1, keepdims=True) * x


@pytest.mark.parametrize("case", ["A", "B", "D"])
@pytest.mark.parametrize("dtype,rtol", [("float32", 1e-5), ("float64", 1e-9)])
def test_goldens_loss_and_gradient(smooth_rank_goldens, case, dtype, rtol):
    inputs = smooth_rank_goldens["inputs"][case]
    x, labels = np.array(inputs["X"]), np.array(inputs["y"])
    value, grad = _loss_and_grad(x, labels, dtype)
    for key in KEYS:
        np.testing.assert_allclose(value, smooth_rank_goldens["results"][key][case]["loss"],
                                   rtol=rtol)
    # pytorch-metric-learning re-normalises inside and returns the true gradient.
    golden = smooth_rank_goldens["results"]["roadmap_fastap_pml099"][case]
    scale = np.abs(grad).max()
    atol = 1e-12 if dtype == "float64" else 1e-5 * scale
    np.testing.assert_allclose(grad[0, :4], golden["grad_row0_first4"], atol=atol, rtol=0)
    np.testing.assert_allclose((grad * W99).sum(), golden["grad_dot_W99"], rtol=rtol * 100)
    np.testing.assert_allclose(np.linalg.norm(grad), golden["grad_fro"], rtol=rtol * 100)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_full_gradient_case_a(smooth_rank_goldens, dtype):
    inputs = smooth_rank_goldens["inputs"]["A"]
    x = np.array(inputs["X"])
    _, grad = _loss_and_grad(x, inputs["y"], dtype)
    atol = 1e-12 if dtype == "float64" else 1e-5 * np.abs(grad).max()
    true_grad = np.array(smooth_rank_goldens["full_grad_case_A"]["roadmap_fastap_pml099"])
    np.testing.assert_allclose(grad, true_grad, atol=atol, rtol=0)
    # Kun He's original: tangential part of its gradient / (N_valid / 2), N_valid = 32.
    orig = np.array(smooth_rank_goldens["full_grad_case_A"]["fastap_kunhe_orig"])
    np.testing.assert_allclose(grad, _tangential(orig, x) / 16.0, atol=atol, rtol=0)


def test_permutation_case_d_permutes_gradient_rows(smooth_rank_goldens):
    a, d = smooth_rank_goldens["inputs"]["A"], smooth_rank_goldens["inputs"]["D"]
    perm = np.array(smooth_rank_goldens["perm_D"])
    np.testing.assert_allclose(np.array(d["X"]), np.array(a["X"])[perm])
    va, ga = _loss_and_grad(np.array(a["X"]), a["y"], "float64")
    vd, gd = _loss_and_grad(np.array(d["X"]), d["y"], "float64")
    np.testing.assert_allclose(vd, va, rtol=1e-13)
    np.testing.assert_allclose(gd, ga[perm], atol=1e-15)


def test_matches_numpy_original_with_irregular_labels_and_singletons():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(23, 8))
    labels = rng.integers(0, 9, 23)
    assert (np.bincount(labels) == 1).any()  # queries without positives are dropped
    for num_bins in (10, 4):
        value, grad = _loss_and_grad(x, labels, "float64", num_bins=num_bins)
        np.testing.assert_allclose(value, reference.fastap_reference(x, labels, num_bins),
                                   rtol=1e-12)
        assert np.all(np.isfinite(grad))


def test_ops_on_memory_bank_matches_reference_histogram():
    rng = np.random.default_rng(8)
    q, db = rng.normal(size=(5, 4)), rng.normal(size=(17, 4))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    db /= np.linalg.norm(db, axis=1, keepdims=True)
    ql, dl = rng.integers(0, 3, 5), rng.integers(0, 3, 17)
    pos, cand = label_masks(tf.constant(ql), tf.constant(dl))
    value = fastap(tf.constant(q @ db.T), pos, cand).numpy()
    # Direct Eq. 14 on squared distances with 11 centres on [0, 4].
    d2 = 2 - 2 * q @ db.T
    pulse = np.maximum(0, 1 - np.abs(d2[..., None] - np.linspace(0, 4, 11)) / 0.4)
    rel = ql[:, None] == dl[None]
    hp, h = (pulse * rel[..., None]).sum(1), pulse.sum(1)
    with np.errstate(invalid="ignore"):
        expected = np.nan_to_num(hp * np.cumsum(hp, 1) / np.cumsum(h, 1)).sum(1) / rel.sum(1)
    np.testing.assert_allclose(value, np.nan_to_num(expected), rtol=1e-12)


def test_all_positive_and_no_positive_batches():
    x = np.random.default_rng(9).normal(size=(6, 3))
    value, grad = _loss_and_grad(x, np.zeros(6, int), "float64")
    assert abs(value) < 1e-12 and np.abs(grad).max() < 1e-12
    value, grad = _loss_and_grad(x, np.arange(6), "float64")
    assert value == 0.0 and np.all(grad == 0.0)
