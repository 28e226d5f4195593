"""PNP: goldens of both reference implementations, properties, dense reference.

`pnp_orig_*` (the authors' code) ranks the given X as is: it matches
``normalize=False`` (whole gradient, radial part included). `pnp_pml_head_*`
(pytorch-metric-learning) re-normalises inside: it matches our default
``normalize=True``, whose gradient is the tangential part of the original's. Both give
the same loss values.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.losses.test_smooth_rank import (
    assert_grad_summary,
    awkward_batch,
    batch_masks,
    dense_rank_terms,
    dense_sigmoid,
    golden_inputs,
    loss_and_grad,
    tangential,
)
from tfaploss.losses import PNPLoss
from tfaploss.ops.smooth_rank import pnp_penalty

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only

# golden name suffix -> (orig key, pml key, constructor kwargs)
VARIANTS = {
    "O": ("pnp_orig_PNP-O", "pnp_pml_head_O", {"variant": "O"}),
    "Ds": ("pnp_orig_PNP-D_s", "pnp_pml_head_Ds", {"variant": "Ds"}),
    "Dq1": ("pnp_orig_PNP-D_q_alpha1", "pnp_pml_head_Dq_alpha1", {"variant": "Dq", "alpha": 1.0}),
    "Dq4": ("pnp_orig_PNP-D_q_alpha4", "pnp_pml_head_Dq_alpha4", {"variant": "Dq"}),
    "Iu": ("pnp_orig_PNP-I_u", "pnp_pml_head_Iu", {"variant": "Iu"}),
    "Ib2": ("pnp_orig_PNP-I_b_b2", "pnp_pml_head_Ib_b2", {"variant": "Ib"}),
    "Ib4": ("pnp_orig_PNP-I_b_b4", "pnp_pml_head_Ib_b4", {"variant": "Ib", "b": 4.0}),
    "Ib1": ("pnp_orig_PNP-I_b_b1", "pnp_pml_head_Ib_b1", {"variant": "Ib", "b": 1.0}),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_original_code_goldens(smooth_rank_goldens, name):
    key, _, kwargs = VARIANTS[name]
    results = smooth_rank_goldens["results"][key]
    for case in ("A", "B"):
        x, y = golden_inputs(smooth_rank_goldens, case)
        value, grad = loss_and_grad(PNPLoss(normalize=False, dtype="float64", **kwargs), y, x)
        np.testing.assert_allclose(value, results[case]["loss"], rtol=1e-9)
        assert_grad_summary(grad, results[case])
    value32 = float(PNPLoss(**kwargs)(y, tf.constant(x, tf.float32)))
    np.testing.assert_allclose(value32, results["B"]["loss"], rtol=1e-5)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_full_gradient_case_a(smooth_rank_goldens, name):
    key, _, kwargs = VARIANTS[name]
    golden = np.asarray(smooth_rank_goldens["full_grad_case_A"][key])
    scale = np.abs(golden).max()
    x, y = golden_inputs(smooth_rank_goldens, "A")
    _, raw = loss_and_grad(PNPLoss(normalize=False, dtype="float64", **kwargs), y, x)
    np.testing.assert_allclose(raw, golden, rtol=0, atol=1e-12 * scale)
    value32, grad32 = loss_and_grad(PNPLoss(**kwargs), y, x, dtype="float32")
    np.testing.assert_allclose(value32, smooth_rank_goldens["results"][key]["A"]["loss"],
                               rtol=1e-5)
    np.testing.assert_allclose(grad32, tangential(golden, x), rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_pml_goldens_normalise_inside(smooth_rank_goldens, name):
    _, key, kwargs = VARIANTS[name]
    for case in ("A", "B", "D"):
        ref = smooth_rank_goldens["results"][key][case]
        x, y = golden_inputs(smooth_rank_goldens, case)
        value, grad = loss_and_grad(PNPLoss(dtype="float64", **kwargs), y, x)
        np.testing.assert_allclose(value, ref["loss"], rtol=1e-9)
        assert_grad_summary(grad, ref)


def test_permutation_equivariance(smooth_rank_goldens):
    perm = np.asarray(smooth_rank_goldens["perm_D"])
    xa, ya = golden_inputs(smooth_rank_goldens, "A")
    xd, yd = golden_inputs(smooth_rank_goldens, "D")
    for kwargs in ({"variant": "Dq"}, {"variant": "Iu"}):
        value_a, grad_a = loss_and_grad(PNPLoss(dtype="float64", **kwargs), ya, xa)
        value_d, grad_d = loss_and_grad(PNPLoss(dtype="float64", **kwargs), yd, xd)
        np.testing.assert_allclose(value_d, value_a, rtol=1e-12)
        np.testing.assert_allclose(grad_d, grad_a[perm], rtol=0,
                                   atol=1e-13 * np.abs(grad_a).max())


def test_penalties_by_hand():
    r = tf.constant([0.0, 0.5, 3.0], tf.float64)
    expected = {
        "O": [0.0, 0.5, 3.0],
        "Iu": [0.0, 1.5 * np.log(1.5), 4 * np.log(4.0)],
        "Ib": [0.0, (1.0 - np.log(2.0)) / 4, (6.0 - np.log(7.0)) / 4],
        "Ds": [0.0, np.log(1.5), np.log(4.0)],
        "Dq": [0.0, 1 - 1.5**-4, 1 - 4.0**-4],
    }
    for variant, values in expected.items():
        np.testing.assert_allclose(pnp_penalty(r, variant, b=2.0, alpha=4.0).numpy(), values,
                                   rtol=1e-14)


@pytest.mark.parametrize("variant", ["O", "Iu", "Ib", "Ds", "Dq"])
def test_blocked_equals_dense_reference_and_drops_lonely_queries(variant):
    """Unequal, non-contiguous classes with two singletons: they are left out as
    queries (no other positive) but still rank as negatives for the others."""
    x, y = awkward_batch(21)
    value, grad = loss_and_grad(PNPLoss(variant=variant, dtype="float64", pairs_per_block=4),
                                y, x)
    positives, candidates = batch_masks(y)
    xv = tf.Variable(x)
    with tf.GradientTape() as tape:
        xn = xv / tf.norm(xv, axis=1, keepdims=True)
        _, r = dense_rank_terms(xn @ tf.transpose(xn), positives, candidates, None,
                                dense_sigmoid(0.01))
        f = tf.where(positives, pnp_penalty(r, variant, 2.0, 4.0), tf.zeros_like(r))
        per_query = tf.reduce_sum(f, 1) / tf.reduce_sum(tf.cast(positives, tf.float64), 1)
        keep = np.array([np.sum(y == v) > 1 for v in y])
        assert keep.sum() == len(y) - 2
        ref = tf.reduce_mean(tf.boolean_mask(per_query, keep))
    np.testing.assert_allclose(value, float(ref), rtol=1e-12)
    np.testing.assert_allclose(grad, tape.gradient(ref, xv).numpy(), rtol=0,
                               atol=1e-12 * max(1.0, np.abs(grad).max()))


@pytest.mark.parametrize("variant", ["O", "Dq"])
def test_all_positive_batch_zero_loss_zero_grad(variant):
    x = np.random.default_rng(0).standard_normal((6, 4))
    value, grad = loss_and_grad(PNPLoss(variant=variant, dtype="float64"), np.ones(6, int), x)
    assert value == 0.0
    np.testing.assert_array_equal(grad, 0.0)


def test_no_positive_pair_gives_zero():
    from tfaploss.losses import base

    base._warned_no_positives = False
    x = np.random.default_rng(1).standard_normal((5, 4))
    with pytest.warns(RuntimeWarning, match="no pair"):
        value, grad = loss_and_grad(PNPLoss(dtype="float64"), np.arange(5), x)
    assert value == 0.0
    np.testing.assert_array_equal(grad, 0.0)


def test_memory_bank_keeps_queries_with_one_database_positive():
    rng = np.random.default_rng(3)
    q, db = rng.standard_normal((3, 4)), rng.standard_normal((6, 4))
    q_labels, db_labels = np.array([0, 1, 5]), np.array([0, 1, 1, 2, 3, 4])
    loss = PNPLoss(variant="O", dtype="float64")
    full = float(loss.query_database_loss(q_labels, q, db_labels, db))
    first = float(loss.query_database_loss(q_labels[:1], q[:1], db_labels, db))
    second = float(loss.query_database_loss(q_labels[1:2], q[1:2], db_labels, db))
    assert first > 0 and second > 0
    np.testing.assert_allclose(full, (first + second) / 2, rtol=1e-12)


def test_argument_errors_and_config_round_trip():
    with pytest.raises(ValueError, match="variant"):
        PNPLoss(variant="Dx")
    with pytest.raises(ValueError, match="alpha"):
        PNPLoss(alpha=0)
    loss = PNPLoss(variant="Ib", b=4.0, alpha=2.0, temperature=0.05, include_self=False,
                   pairs_per_block=3)
    clone = PNPLoss.from_config(loss.get_config())
    assert clone.get_config() == loss.get_config()
