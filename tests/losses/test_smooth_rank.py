"""Smooth-AP and SupAP: goldens from the original code, properties, and the gathered /
blocked implementation against a dense B×B×B reference.

Golden conventions (tests/goldens/README.md): the references computed the loss on
the given (unit-norm) X without re-normalising, so ``normalize=False`` must reproduce
their full gradient, and our default ``normalize=True`` its tangential part.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.support.reference import batch_average_precision
from tfaploss.losses import SmoothAPLoss, SupAPLoss
from tfaploss.ops.smooth_rank import (
    HeavisideStep,
    SigmoidStep,
    SupAPUpperStep,
    positive_rank_terms,
)

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only

CASES = ("A", "B", "D")

SMOOTH_RANK_KEYS = {
    "roadmap_smoothap": (SmoothAPLoss, {}),
    "smoothap_brown_orig": (SmoothAPLoss, {}),
    "roadmap_supap_classdefault": (SupAPLoss, {}),
    "roadmap_supap_sop": (SupAPLoss, {"offset": 1.44}),
    "roadmap_supap_inat": (SupAPLoss, {"start": 0.0, "offset": 1.0}),
}


# -- helpers shared with the PNP and ROADMAP tests ----------------------------------


def golden_inputs(goldens, case):
    data = goldens["inputs"][case]
    return np.asarray(data["X"], dtype=np.float64), np.asarray(data["y"])


def loss_and_grad(loss, y, x, dtype="float64"):
    x = tf.constant(np.asarray(x), dtype=dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = loss(y, x)
    return float(value), tape.gradient(value, x).numpy().astype(np.float64)


def tangential(grad, x):
    """Remove the radial part ``(G·x)x`` of each row (x unit-norm)."""
    return grad - np.sum(grad * x, axis=1, keepdims=True) * x


def w99(shape):
    return np.random.default_rng(99).standard_normal(shape)


def assert_grad_summary(grad, ref, rtol=1e-9):
    """Compare a gradient with a golden summary (fro, <G, W99>, row 0, arg-max)."""
    scale = max(abs(ref["grad_absmax_value"]), 1e-300)
    np.testing.assert_allclose(np.linalg.norm(grad), ref["grad_fro"], rtol=rtol)
    np.testing.assert_allclose(np.sum(grad * w99(grad.shape)), ref["grad_dot_W99"],
                               rtol=rtol, atol=rtol * scale)
    np.testing.assert_allclose(grad[0, :4], ref["grad_row0_first4"], rtol=rtol,
                               atol=rtol * scale)
    index = tuple(ref["grad_absmax_index"])
    np.testing.assert_allclose(grad[index], ref["grad_absmax_value"], rtol=rtol)
    np.testing.assert_allclose(np.max(np.abs(grad)), abs(ref["grad_absmax_value"]),
                               rtol=rtol)


def exact_ap_selfincl(x, y):
    """Exact AP of every query, the query itself a positive in its own ranking."""
    return batch_average_precision(x, y, include_self=True)


def dense_rank_terms(scores, positives, candidates, pos_step, neg_step):
    """Reference: the full Q×N×N tensor t[i, k, j] = s_ij - s_ik, autodiff gradient."""
    n = scores.shape[1]
    positives = tf.logical_and(positives, candidates)
    negatives = tf.logical_and(candidates, tf.logical_not(positives))
    t = scores[:, None, :] - scores[:, :, None]
    not_k = tf.logical_not(tf.eye(n, dtype=tf.bool))[None]
    zero = tf.zeros_like(t)
    pos = tf.reduce_sum(tf.where(tf.logical_and(positives[:, None, :], not_k),
                                 pos_step(t), zero), -1) if pos_step else tf.zeros_like(scores)
    neg = tf.reduce_sum(tf.where(negatives[:, None, :], neg_step(t), zero), -1)
    keep = positives
    return tf.where(keep, pos, tf.zeros_like(pos)), tf.where(keep, neg, tf.zeros_like(neg))


def dense_sigmoid(tau):
    return lambda t: tf.sigmoid(tf.clip_by_value(t / tau, -50.0, 50.0))


def dense_heaviside(t):
    return tf.stop_gradient(tf.cast(t >= 0, t.dtype))


def dense_upper(tau=0.01, rho=100.0, delta=0.05, start=0.5, offset=None):
    if offset is None:
        offset = start + 1.0 / (1.0 + np.exp(-min(delta / tau, 50.0)))

    def step(t):
        sig = dense_sigmoid(tau)(t)
        return tf.where(t <= 0, sig, tf.where(t <= delta, start + sig,
                                              rho * (t - delta) + offset))
    return step


def dense_ap(scores, positives, candidates, pos_step, neg_step):
    pos, neg = dense_rank_terms(scores, positives, candidates, pos_step, neg_step)
    positives = tf.logical_and(positives, candidates)
    prec = tf.where(positives, (1 + pos) / (1 + pos + neg), tf.zeros_like(pos))
    count = tf.reduce_sum(tf.cast(positives, scores.dtype), 1)
    return tf.reduce_sum(prec, 1) / tf.maximum(count, 1.0)


def awkward_batch(seed, n=14, dim=6):
    """Non-contiguous labels, unequal classes (sizes 5, 3, 2, 1, 1, 2), a huge label id."""
    rng = np.random.default_rng(seed)
    labels = np.array([7] * 5 + [2] * 3 + [40_000_001] * 2 + [5, 9] + [3] * 2)[:n]
    perm = rng.permutation(len(labels))
    x = rng.standard_normal((len(labels), dim))
    return x / np.linalg.norm(x, axis=1, keepdims=True), labels[perm]


def batch_masks(labels, include_self=True):
    same = labels[:, None] == labels[None, :]
    eye = np.eye(len(labels), dtype=bool)
    candidates = ~eye if not include_self else np.ones_like(eye)
    return tf.constant(same & candidates), tf.constant(candidates)


# -- goldens ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(SMOOTH_RANK_KEYS))
def test_losses_match_goldens_float64(smooth_rank_goldens, key):
    cls, kwargs = SMOOTH_RANK_KEYS[key]
    for case in CASES:
        if case not in smooth_rank_goldens["results"][key]:
            continue
        ref = smooth_rank_goldens["results"][key][case]
        x, y = golden_inputs(smooth_rank_goldens, case)
        for normalize in (True, False):
            value, grad = loss_and_grad(cls(dtype="float64", normalize=normalize, **kwargs),
                                        y, x)
            np.testing.assert_allclose(value, ref["loss"], rtol=1e-9)
        # normalize=False is the reference's own computation: whole gradient.
        assert_grad_summary(grad, ref)


@pytest.mark.parametrize("key", sorted(SMOOTH_RANK_KEYS))
def test_full_gradient_case_a(smooth_rank_goldens, key):
    cls, kwargs = SMOOTH_RANK_KEYS[key]
    golden = np.asarray(smooth_rank_goldens["full_grad_case_A"][key])
    x, y = golden_inputs(smooth_rank_goldens, "A")
    scale = np.abs(golden).max()
    _, raw = loss_and_grad(cls(dtype="float64", normalize=False, **kwargs), y, x)
    np.testing.assert_allclose(raw, golden, rtol=0, atol=1e-12 * scale)
    _, grad = loss_and_grad(cls(dtype="float64", **kwargs), y, x)
    np.testing.assert_allclose(grad, tangential(golden, x), rtol=0, atol=1e-12 * scale)
    value32, grad32 = loss_and_grad(cls(**kwargs), y, x, dtype="float32")
    np.testing.assert_allclose(value32, smooth_rank_goldens["results"][key]["A"]["loss"],
                               rtol=1e-5)
    np.testing.assert_allclose(grad32, tangential(golden, x), rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("key", sorted(SMOOTH_RANK_KEYS))
def test_float32_losses_cases_b_d(smooth_rank_goldens, key):
    cls, kwargs = SMOOTH_RANK_KEYS[key]
    for case in ("B", "D"):
        if case not in smooth_rank_goldens["results"][key]:
            continue
        x, y = golden_inputs(smooth_rank_goldens, case)
        value = float(cls(**kwargs)(y, tf.constant(x, tf.float32)))
        np.testing.assert_allclose(value, smooth_rank_goldens["results"][key][case]["loss"],
                                   rtol=1e-5)


def test_smooth_ap_low_temperature_is_exact_ap(smooth_rank_goldens, retrieval_goldens):
    extras = retrieval_goldens["extras"]
    for case in ("A", "B"):
        x, y = golden_inputs(smooth_rank_goldens, case)
        exact = 1.0 - exact_ap_selfincl(x, y).mean()
        np.testing.assert_allclose(exact, extras[case]["exactAP_loss_selfincl"], rtol=1e-12)
        np.testing.assert_allclose(
            exact, smooth_rank_goldens["results"]["roadmap_heavisideap_exactAP_selfincluded"]
            [case]["loss"], rtol=1e-12)
        value = float(SmoothAPLoss(temperature=1e-4, dtype="float64")(y, x))
        np.testing.assert_allclose(value, extras[case]["smoothap_selfincl_tau1e-4"], rtol=1e-9)
        assert abs(value - exact) < 1e-3


def test_self_excluded_variants_match_extras(smooth_rank_goldens, retrieval_goldens):
    extras = retrieval_goldens["extras"]
    for case in ("A", "B"):
        x, y = golden_inputs(smooth_rank_goldens, case)
        smooth = float(SmoothAPLoss(include_self=False, dtype="float64")(y, x))
        sup = float(SupAPLoss(include_self=False, offset=1.44, dtype="float64")(y, x))
        np.testing.assert_allclose(smooth, extras[case]["smoothap_selfexcl"], rtol=1e-9)
        np.testing.assert_allclose(sup, extras[case]["supap_sop_selfexcl"], rtol=1e-9)


def test_per_query_ap_matches_extras(smooth_rank_goldens, retrieval_goldens):
    from tfaploss.ops import smooth_ap_per_query, sup_ap_per_query

    x, y = golden_inputs(smooth_rank_goldens, "A")
    positives, candidates = batch_masks(y)
    scores = tf.constant(x @ x.T)
    ap, _ = smooth_ap_per_query(scores, positives, candidates)
    np.testing.assert_allclose(ap.numpy()[:8],
                               retrieval_goldens["extras"]["smoothap_perquery_AP_A_first8"],
                               rtol=1e-9)
    ap, _ = sup_ap_per_query(scores, positives, candidates, offset=1.44)
    np.testing.assert_allclose(ap.numpy()[:8],
                               retrieval_goldens["extras"]["supap_sop_perquery_AP_A_first8"],
                               rtol=1e-9)


# -- properties --------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [SmoothAPLoss, SupAPLoss])
def test_permutation_equivariance(smooth_rank_goldens, cls):
    perm = np.asarray(smooth_rank_goldens["perm_D"])
    xa, ya = golden_inputs(smooth_rank_goldens, "A")
    xd, yd = golden_inputs(smooth_rank_goldens, "D")
    np.testing.assert_array_equal(xd, xa[perm])
    loss = cls(dtype="float64")
    value_a, grad_a = loss_and_grad(loss, ya, xa)
    value_d, grad_d = loss_and_grad(loss, yd, xd)
    np.testing.assert_allclose(value_d, value_a, rtol=1e-12)
    np.testing.assert_allclose(grad_d, grad_a[perm], rtol=0, atol=1e-14)


def test_supap_bounds_exact_ap_loss():
    rng = np.random.default_rng(5)
    for trial in range(6):
        n = int(rng.integers(8, 24))
        y = rng.integers(0, int(rng.integers(2, 6)), n)
        x = rng.standard_normal((n, 5)) + trial * 0.3 * np.eye(5)[y % 5]
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        exact = 1.0 - exact_ap_selfincl(x, y).mean()
        for kwargs in ({}, {"offset": 1.44}):
            sup = float(SupAPLoss(dtype="float64", **kwargs)(y, x))
            assert sup >= exact - 1e-12, (trial, kwargs, sup, exact)
        # The iNaturalist config (start 0) is not an upper bound in general; the
        # Smooth-AP value may fall either side.


@pytest.mark.parametrize("cls", [SmoothAPLoss, SupAPLoss])
def test_all_positive_batch_zero_loss_zero_grad(cls):
    x = np.random.default_rng(0).standard_normal((6, 4))
    value, grad = loss_and_grad(cls(dtype="float64"), np.zeros(6, int), x)
    assert value == 0.0
    np.testing.assert_array_equal(grad, 0.0)


@pytest.mark.parametrize("cls", [SmoothAPLoss, SupAPLoss])
def test_no_positive_pair_gives_zero_and_warns(cls):
    x = np.random.default_rng(1).standard_normal((5, 4))
    from tfaploss.losses import base

    base._warned_no_positives = False
    with pytest.warns(RuntimeWarning, match="no pair"):
        value, grad = loss_and_grad(cls(dtype="float64"), np.arange(5), x)
    assert value == 0.0
    np.testing.assert_array_equal(grad, 0.0)
    assert np.all(np.isfinite(grad))


@pytest.mark.parametrize("cls", [SmoothAPLoss, SupAPLoss])
def test_singleton_query_stays_in_the_mean(cls):
    """A query alone in its class has AP ~ 1 and counts (the originals' convention)."""
    x, y = awkward_batch(3)
    loss = cls(dtype="float64")
    value = float(loss(y, x))
    positives, candidates = batch_masks(y)
    step = dense_sigmoid(0.01) if cls is SmoothAPLoss else dense_heaviside
    neg = dense_sigmoid(0.01) if cls is SmoothAPLoss else dense_upper()
    ap = dense_ap(tf.constant(x @ x.T), positives, candidates, step, neg).numpy()
    singles = np.array([np.sum(y == v) == 1 for v in y])
    assert singles.sum() == 2
    np.testing.assert_allclose(value, 1.0 - ap.mean(), rtol=1e-12)
    assert np.all(ap[singles] > 0.0)


def test_query_without_database_positive_is_left_out():
    rng = np.random.default_rng(2)
    q, db = rng.standard_normal((4, 5)), rng.standard_normal((9, 5))
    q_labels, db_labels = np.array([0, 1, 2, 99]), np.array([0, 0, 1, 2, 2, 2, 3, 1, 0])
    loss = SmoothAPLoss(dtype="float64")
    full = float(loss.query_database_loss(q_labels, q, db_labels, db))
    kept = float(loss.query_database_loss(q_labels[:3], q[:3], db_labels, db))
    np.testing.assert_allclose(full, kept, rtol=1e-12)
    x = tf.constant(q)
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = loss.query_database_loss(q_labels, x, db_labels, db)
    grad = tape.gradient(value, x).numpy()
    assert np.all(np.isfinite(grad)) and np.all(grad[3] == 0.0)


@pytest.mark.parametrize("cls", [SmoothAPLoss, SupAPLoss])
def test_memory_bank_of_the_batch_equals_batch_loss(cls):
    x, y = awkward_batch(4)
    loss = cls(dtype="float64")
    np.testing.assert_allclose(float(loss.query_database_loss(y, x, y, x)),
                               float(loss(y, x)), rtol=1e-12)


# -- gathered / blocked implementation against the dense B×B×B reference ------------------


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("pairs_per_block", [None, 7])
def test_blocked_terms_equal_dense_reference(include_self, pairs_per_block):
    x, y = awkward_batch(7)
    positives, candidates = batch_masks(y, include_self)
    scores0 = tf.constant(x @ x.T)
    w = tf.constant(np.random.default_rng(8).standard_normal((2,) + scores0.shape))
    for name, pos_step, neg_step, d_pos, d_neg in (
        ("smooth", SigmoidStep(0.05), SigmoidStep(0.05), dense_sigmoid(0.05),
         dense_sigmoid(0.05)),
        ("supap", HeavisideStep(), SupAPUpperStep(0.05, 3.0, 0.1), dense_heaviside,
         dense_upper(0.05, 3.0, 0.1)),
    ):
        results = []
        for fn in (lambda s, p=pos_step, n=neg_step: positive_rank_terms(
                       s, positives, candidates, p, n, pairs_per_block),
                   lambda s, p=d_pos, n=d_neg: dense_rank_terms(s, positives, candidates, p, n)):
            s = tf.Variable(scores0)
            with tf.GradientTape() as tape:
                pos, neg = fn(s)
                objective = tf.reduce_sum(w[0] * pos) + tf.reduce_sum(w[1] * neg ** 2)
            results.append((pos.numpy(), neg.numpy(), tape.gradient(objective, s).numpy()))
        for ours, ref in zip(results[0], results[1]):
            np.testing.assert_allclose(ours, ref, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("cls, steps", [
    (SmoothAPLoss, (dense_sigmoid(0.01), dense_sigmoid(0.01))),
    (SupAPLoss, (dense_heaviside, dense_upper())),
])
def test_loss_equals_dense_reference_with_gradient(cls, steps):
    x, y = awkward_batch(11)
    loss = cls(dtype="float64", pairs_per_block=5)
    value, grad = loss_and_grad(loss, y, x)
    xv = tf.Variable(x)
    positives, candidates = batch_masks(y)
    with tf.GradientTape() as tape:
        xn = xv / tf.norm(xv, axis=1, keepdims=True)
        ref = 1.0 - tf.reduce_mean(dense_ap(xn @ tf.transpose(xn), positives, candidates,
                                            *steps))
    np.testing.assert_allclose(value, float(ref), rtol=1e-12)
    np.testing.assert_allclose(grad, tape.gradient(ref, xv).numpy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_graph_and_xla_match_eager(jit_compile):
    """The blocked loop in a graph (fused, jit-compiled block kernels) and under XLA
    (data-dependent trip count, static block shapes) equals the eager computation,
    for the three step combinations (Smooth-AP, SupAP, PNP)."""
    x, y = awkward_batch(12)
    positives, candidates = batch_masks(y)
    scores = tf.constant(x @ x.T, tf.float32)
    weights = tf.constant(np.random.default_rng(13).standard_normal((2,) + scores.shape),
                          tf.float32)
    sigmoid = SigmoidStep(0.05)
    # (The Keras tests also compare every exported loss in a graph and under XLA.)
    combos = ((HeavisideStep(), SupAPUpperStep()),)
    if not jit_compile:
        combos += ((sigmoid, sigmoid), (None, sigmoid))

    def values_and_grads(s):
        out = []
        for pos_step, neg_step in combos:
            with tf.GradientTape() as tape:
                tape.watch(s)
                pos, neg = positive_rank_terms(s, positives, candidates, pos_step, neg_step,
                                               pairs_per_block=6)
                objective = (tf.reduce_sum(weights[0] * pos)
                             + tf.reduce_sum(weights[1] * tf.square(neg)))
            out += [objective, tape.gradient(objective, s)]
        return out

    eager = values_and_grads(scores)
    graph = tf.function(values_and_grads, jit_compile=jit_compile)(scores)
    for ours, ref in zip(graph, eager):
        np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=1e-5,
                                   atol=1e-5 * np.abs(ref.numpy()).max())


def test_large_classes_run_in_bounded_blocks():
    """64 items per class: ranked in blocks of pairs_per_block x N, never B x B x B."""
    from tfaploss.ops.pair_blocks import block_size

    assert block_size(4096, 4096, None) * 4096 <= 2**22
    rng = np.random.default_rng(0)
    y = rng.permutation(np.repeat(np.arange(3), 64))
    x = rng.standard_normal((192, 8))
    loss = SmoothAPLoss(dtype="float64", pairs_per_block=1000)  # 13 blocks, last padded
    value, grad = loss_and_grad(loss, y, x)
    whole, whole_grad = loss_and_grad(SmoothAPLoss(dtype="float64"), y, x)
    np.testing.assert_allclose(value, whole, rtol=1e-12)
    np.testing.assert_allclose(grad, whole_grad, rtol=0, atol=1e-14)
    assert 0.0 < value < 1.0


def test_argument_errors_and_config_round_trip():
    with pytest.raises(ValueError, match="temperature"):
        SmoothAPLoss(temperature=0.0)
    with pytest.raises(ValueError, match="rho"):
        SupAPLoss(rho=-1.0)
    with pytest.raises(ValueError, match="pairs_per_block"):
        SmoothAPLoss(pairs_per_block=0)(np.zeros(3, int), np.ones((3, 2)))
    for loss in (SmoothAPLoss(temperature=0.05, include_self=False, pairs_per_block=9),
                 SupAPLoss(offset=1.44, start=0.6, rho=50.0, delta=0.1, normalize=False)):
        clone = type(loss).from_config(loss.get_config())
        assert clone.get_config() == loss.get_config()
