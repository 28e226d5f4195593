"""APLoss / TieAwareAPLoss (histogram AP, Revaud et al.) against the goldens and properties."""

import numpy as np
import pytest
import tensorflow as tf

from tests.support import reference
from tfaploss.losses import APLoss, TieAwareAPLoss
from tfaploss.ops import (
    histogram_ap,
    label_masks,
    soft_bins_dense,
    tie_aware_histogram_ap,
    two_bin_assignment,
)

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only

F32_RTOL, F64_RTOL = 1e-5, 1e-9


def _setting(key):
    """'nq20_-1_1' -> (20, (-1.0, 1.0))."""
    nq, lo, hi = key.split("_")
    return int(nq[2:]), (float(lo), float(hi))


@pytest.fixture(scope="module")
def batch32(aploss_goldens):
    cases = aploss_goldens["batch_and_hand_cases"]
    rs = np.random.RandomState(0)
    x = rs.randn(32, 16)
    labels = rs.randint(0, 4, 32)
    np.testing.assert_array_equal(labels, cases["batch_labels"])
    return x, labels, cases


def _loss_and_grad(loss, labels, x, dtype):
    x = tf.constant(x, dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = loss(tf.constant(labels), x)
    return value.numpy(), tape.gradient(value, x).numpy()


@pytest.mark.parametrize("dtype,rtol", [("float32", F32_RTOL), ("float64", F64_RTOL)])
def test_batch32_losses_all_settings(batch32, dtype, rtol):
    x, labels, cases = batch32
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    for key, expected in cases["batch32"].items():
        if not key.startswith("nq"):
            continue
        num_bins, score_range = _setting(key)
        kwargs = {"num_bins": num_bins, "score_range": score_range, "dtype": dtype}
        for include_self, golden in [(True, "loss_self_included"), (False, "loss_self_excluded")]:
            value = APLoss(include_self=include_self, **kwargs)(labels, xn)
            np.testing.assert_allclose(value, expected[golden], rtol=rtol, err_msg=key)
        for simplified, golden in [(False, "tap_loss_excl"), (True, "taps_loss_excl")]:
            value = TieAwareAPLoss(simplified=simplified, **kwargs)(labels, xn)
            np.testing.assert_allclose(value, expected[golden], rtol=rtol, err_msg=key)
        # Per-query APs through the functional core.
        s = tf.constant(xn @ xn.T, dtype)
        pos, cand = label_masks(tf.constant(labels), tf.constant(labels), exclude_self=True)
        ap = histogram_ap(s, pos, cand, num_bins, score_range).numpy()
        np.testing.assert_allclose(ap[:4], expected["ap_excl_first4"], rtol=rtol)
    exact = reference.batch_average_precision(x, labels, include_self=False)
    np.testing.assert_allclose(exact[:4], cases["batch32"]["exact_AP_excl_first4"], rtol=1e-12)
    np.testing.assert_allclose(np.nanmean(exact), cases["batch32"]["exact_mAP_excl"], rtol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_batch32_gradient_through_normalisation(batch32, dtype):
    x, labels, cases = batch32
    golden = cases["grad_nq20_m1_1"]
    value, grad = _loss_and_grad(APLoss(dtype=dtype), labels, x, dtype)
    rtol = F64_RTOL if dtype == "float64" else F32_RTOL
    np.testing.assert_allclose(value, golden["loss"], rtol=rtol)
    atol = 1e-12 if dtype == "float64" else 1e-5 * np.abs(grad).max()
    np.testing.assert_allclose(grad[0, :4], golden["grad_row0_first4"], atol=atol, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(grad), golden["grad_fro"], rtol=rtol * 10)
    np.testing.assert_allclose(grad.sum(), golden["grad_sum"], atol=atol * 10, rtol=0)
    # Normalising inside leaves no radial component.
    assert np.abs((grad * x).sum(1)).max() < (1e-15 if dtype == "float64" else 1e-7)


@pytest.mark.parametrize("dtype,rtol", [("float32", F32_RTOL), ("float64", F64_RTOL)])
def test_batch32_class_balanced(batch32, dtype, rtol):
    x, labels, cases = batch32
    golden = cases["class_balanced"]
    np.testing.assert_array_equal(np.bincount(labels), golden["counts"])
    value = APLoss(class_balanced=True, dtype=dtype)(labels, x)
    np.testing.assert_allclose(value, golden["ref_loss"], rtol=rtol)
    assert abs(float(APLoss(dtype=dtype)(labels, x)) - golden["ref_loss"]) > 1e-3


@pytest.mark.parametrize("case", ["G1", "G2"])
def test_hand_cases_values_and_dlds(aploss_goldens, case):
    golden = aploss_goldens["tie_and_protocol_cases"][case]
    s = tf.constant(golden["S"], tf.float64)
    y = tf.constant(golden["Y"]) > 0
    for key, expected in golden.items():
        if not key.startswith("nq") or key.endswith(("_qw", "AP_only")):
            continue
        num_bins, score_range = _setting(key.replace("_m1_", "_-1_"))
        with tf.GradientTape() as tape:
            tape.watch(s)
            ap = histogram_ap(s, y, None, num_bins, score_range)
            loss = 1.0 - tf.reduce_mean(ap)
        np.testing.assert_allclose(ap.numpy(), expected["AP"], rtol=F64_RTOL)
        np.testing.assert_allclose(loss.numpy(), expected["loss"], rtol=F64_RTOL)
        # dL/dS is stored with 12 decimals.
        np.testing.assert_allclose(tape.gradient(loss, s).numpy(), expected["dL_dS"],
                                   atol=1e-11, rtol=0)
        tap = tie_aware_histogram_ap(s, y, None, num_bins, score_range, simplified=False)
        taps = tie_aware_histogram_ap(s, y, None, num_bins, score_range, simplified=True)
        np.testing.assert_allclose(tap.numpy(), expected["TAP"], rtol=F64_RTOL)
        np.testing.assert_allclose(taps.numpy(), expected["TAP_simplified"], rtol=F64_RTOL)
        # float32 within the goldens' float32 tolerance.
        ap32 = histogram_ap(tf.cast(s, tf.float32), y, None, num_bins, score_range)
        np.testing.assert_allclose(ap32.numpy(), expected["AP"], rtol=F32_RTOL)
    if case == "G1":
        ap = histogram_ap(s, y, None, 11, (0.0, 1.0)).numpy()
        np.testing.assert_allclose(ap, golden["nq11_0_1_AP_only"], rtol=F64_RTOL)


@pytest.mark.parametrize("case", ["A", "B", "D"])
@pytest.mark.parametrize("dtype,rtol", [("float32", F32_RTOL), ("float64", F64_RTOL)])
def test_roadmap_softbinap_value(smooth_rank_goldens, case, dtype, rtol):
    inputs = smooth_rank_goldens["inputs"][case]
    value = APLoss(include_self=True, dtype=dtype)(inputs["y"], np.array(inputs["X"]))
    golden = smooth_rank_goldens["results"]["roadmap_softbinap"][case]["loss"]
    np.testing.assert_allclose(value, golden, rtol=rtol)


def test_exact_on_distinct_bin_centres():
    rng = np.random.default_rng(3)
    num_bins = 20
    centres = 1.0 - np.arange(num_bins) * 2.0 / (num_bins - 1)
    for _ in range(5):
        s = rng.permutation(centres)[:12]
        rel = rng.random(12) < 0.4
        rel[0] = True
        ap = histogram_ap(tf.constant(s[None]), tf.constant(rel[None]), None, num_bins).numpy()
        np.testing.assert_allclose(ap[0], reference.average_precision(s, rel), rtol=1e-12)


def test_partition_of_unity_two_adjacent_bins_and_flat_outside():
    s = tf.constant(np.linspace(-1.7, 1.7, 341), tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(s)
        q = soft_bins_dense(s, 20, (-1.0, 1.0))
        probe = tf.reduce_sum(q * tf.range(20, dtype=tf.float64))
    qn = q.numpy()
    np.testing.assert_allclose(qn.sum(1), 1.0, atol=1e-15)
    for row in qn:  # at most two non-zero entries, adjacent
        nz = np.flatnonzero(row > 0)
        assert len(nz) <= 2 and (len(nz) < 2 or nz[1] - nz[0] == 1)
    np.testing.assert_allclose(qn, reference.soft_bins_dense(s.numpy(), 20), atol=1e-14)
    grad = tape.gradient(probe, s).numpy()
    outside = np.abs(s.numpy()) > 1.0
    assert np.all(grad[outside] == 0.0)
    assert np.all(grad[~outside & (np.abs(s.numpy()) < 0.999)] != 0.0)
    np.testing.assert_array_equal(qn[s.numpy() > 1.0, 0], 1.0)  # top bin saturates
    np.testing.assert_array_equal(qn[s.numpy() < -1.0, -1], 1.0)
    index, frac = two_bin_assignment(tf.constant([1.0, 0.9, -1.0]), 20)
    np.testing.assert_array_equal(index.numpy(), [0, 0, 18])
    np.testing.assert_allclose(frac.numpy(), [0.0, 0.95, 1.0], rtol=1e-6)


def test_negatives_never_get_negative_gradient():
    rng = np.random.default_rng(0)
    for _ in range(5):
        s = tf.constant(np.tanh(rng.normal(size=(16, 40))), tf.float64)
        rel = rng.random((16, 40)) < 0.3
        rel[:, 0] = True
        with tf.GradientTape() as tape:
            tape.watch(s)
            loss = 1.0 - tf.reduce_mean(histogram_ap(s, tf.constant(rel)))
        g = tape.gradient(loss, s).numpy()
        assert g[~rel].min() >= -1e-15
        assert g[~rel].max() > 0  # the property is not vacuous


def _dense_histogram_ap_tf(scores, rel, num_bins, score_range, tie=None):
    """The paper's dense (Q, M, N) quantiser in TF, for comparing values and gradients."""
    lo, hi = score_range
    delta = (hi - lo) / (num_bins - 1)
    centres = hi - delta * tf.range(num_bins, dtype=scores.dtype)
    q = tf.nn.relu(1.0 - tf.abs(scores[:, None, :] - centres[None, :, None]) / delta)
    top = tf.where(scores[:, None, :] >= hi, tf.ones_like(q[:, :1]), q[:, :1])
    bottom = tf.where(scores[:, None, :] <= lo, tf.ones_like(q[:, -1:]), q[:, -1:])
    q = tf.concat([top, q[:, 1:-1], bottom], axis=1)
    relf = tf.cast(rel, scores.dtype)
    c = tf.reduce_sum(q, -1)
    cp = tf.reduce_sum(q * relf[:, None, :], -1)
    big_c, big_cp = tf.cumsum(c, 1), tf.cumsum(cp, 1)
    if tie is None:
        terms = big_cp / (big_c + 1e-16) * cp
    else:
        terms = cp * (big_cp - cp + big_cp + 1) / (big_c - c + big_c + 1)
    return tf.reduce_sum(terms, 1) / tf.reduce_sum(relf, 1)


@pytest.mark.parametrize("tie", [None, "simplified"])
def test_two_bin_form_equals_dense_reference(tie):
    rng = np.random.default_rng(1)
    s = tf.constant(np.clip(rng.normal(0.1, 0.6, size=(12, 30)), -1.3, 1.3), tf.float64)
    rel = tf.constant(rng.random((12, 30)) < 0.3) | tf.eye(12, 30, dtype=tf.bool)
    for num_bins, score_range in [(20, (-1.0, 1.0)), (7, (0.0, 1.0))]:
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(s)
            dense = _dense_histogram_ap_tf(s, rel, num_bins, score_range, tie)
            if tie is None:
                fast = histogram_ap(s, rel, None, num_bins, score_range)
            else:
                fast = tie_aware_histogram_ap(s, rel, None, num_bins, score_range, True)
            w = tf.constant(rng.normal(size=12))
            dense_probe, fast_probe = tf.reduce_sum(w * dense), tf.reduce_sum(w * fast)
        np.testing.assert_allclose(fast.numpy(), dense.numpy(), rtol=1e-13)
        np.testing.assert_allclose(tape.gradient(fast_probe, s).numpy(),
                                   tape.gradient(dense_probe, s).numpy(), atol=1e-13)
        np.testing.assert_allclose(
            fast.numpy(),
            reference.histogram_ap_dense(s.numpy(), rel.numpy(), None, num_bins, score_range,
                                         tie_aware=tie), rtol=1e-13)
    full = tie_aware_histogram_ap(s, rel, None, 20, (-1.0, 1.0), simplified=False)
    np.testing.assert_allclose(
        full.numpy(), reference.histogram_ap_dense(s.numpy(), rel.numpy(), tie_aware="full"),
        rtol=1e-12)


def test_queries_without_positives_are_left_out():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(10, 6))
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3, 4])  # 3 and 4: no positive
    x_t = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x_t)
        value = APLoss(dtype="float64")(labels, x_t)
    grad = tape.gradient(value, x_t).numpy()
    assert np.all(np.isfinite(grad))
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = xn @ xn.T
    off = ~np.eye(10, dtype=bool)
    aps = [reference.histogram_ap_dense(s[i][off[i]][None], (labels == labels[i])[off[i]][None])[0]
           for i in range(8)]
    np.testing.assert_allclose(value.numpy(), 1.0 - np.mean(aps), rtol=1e-12)


@pytest.mark.parametrize("loss", [APLoss(dtype="float64"),
                                  TieAwareAPLoss(simplified=True, dtype="float64")],
                         ids=["APLoss", "TieAwareAPLoss-simplified"])
def test_all_positive_batch_zero_loss_zero_grad(loss):
    x = tf.constant(np.random.default_rng(4).normal(size=(8, 5)))
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = loss(np.zeros(8, np.int32), x)
    assert abs(float(value)) < 1e-12
    assert np.abs(tape.gradient(value, x).numpy()).max() < 1e-12


def test_tie_aware_full_form_on_all_positive_list_is_its_approximation():
    # The authors' default replaces the harmonic sum by a logarithm, so an
    # all-positive list does not score exactly 1 (goldens: all_equal_tap).
    x = np.random.default_rng(4).normal(size=(8, 5))
    value = TieAwareAPLoss(dtype="float64")(np.zeros(8, np.int32), x).numpy()
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    off = ~np.eye(8, dtype=bool)
    s = (xn @ xn.T)[off].reshape(8, 7)
    expected = 1.0 - np.mean(reference.histogram_ap_dense(s, np.ones_like(s, bool),
                                                          tie_aware="full"))
    np.testing.assert_allclose(value, expected, rtol=1e-12)
    assert 0 < value < 0.1


def test_memory_bank_call_equals_batch_call():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(12, 8))
    labels = rng.integers(0, 3, 12)
    loss = APLoss(dtype="float64")
    off_diagonal = ~np.eye(12, dtype=bool)
    bank = loss.query_database_loss(labels, x, labels, x, candidates=off_diagonal)
    np.testing.assert_allclose(bank.numpy(), loss(labels, x).numpy(), rtol=1e-13)
    # A bank without the queries: every bank item is a candidate.
    q_labels, db_labels = labels[:4], labels[4:]
    value = loss.query_database_loss(q_labels, x[:4], db_labels, x[4:])
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = xn[:4] @ xn[4:].T
    rel = q_labels[:, None] == db_labels[None]
    aps = reference.histogram_ap_dense(s, rel)
    np.testing.assert_allclose(value.numpy(), 1.0 - np.nanmean(aps), rtol=1e-12)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_bins"):
        APLoss(num_bins=1)
    with pytest.raises(ValueError, match="score_range"):
        APLoss(score_range=(1.0, 0.0))


def test_roadmap_softbinap_gradient_case_a(smooth_rank_goldens):
    # The README keeps this golden "value only" (some scores sit on a bin kink), but our
    # two-bin form picks the same one-sided derivative: the tangential part matches.
    inputs = smooth_rank_goldens["inputs"]["A"]
    x = np.array(inputs["X"])
    _, grad = _loss_and_grad(APLoss(include_self=True, dtype="float64"), inputs["y"], x,
                             "float64")
    full = np.array(smooth_rank_goldens["full_grad_case_A"]["roadmap_softbinap"])
    tangential = full - (full * x).sum(1, keepdims=True) * x
    np.testing.assert_allclose(grad, tangential, atol=1e-12)
