"""BlackBoxAPLoss against the ROADMAP repository's BlackBoxAP (goldens) and a NumPy port."""

import numpy as np
import pytest
import tensorflow as tf

from tests.support import reference
from tfaploss.losses import BlackBoxAPLoss
from tfaploss.ops import blackbox_ap, label_masks

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only

GOLDEN = "roadmap_blackboxap_margin0"


def _tangential(g, x):
    return g - (g * x).sum(1, keepdims=True) * x


def _loss_and_grad(loss, labels, x, dtype="float64"):
    x = tf.constant(x, dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = loss(np.asarray(labels), x)
    return value.numpy(), tape.gradient(value, x).numpy()


def _float32_ratio_loss(x, labels):
    """The original's forward with its float32 rank ratios (explains the 5e-9)."""
    s = x @ x.T
    t = (labels[:, None] == labels[None]).astype(float)
    n = np.float32(len(labels))
    order = np.argsort(-s, axis=1, kind="stable")
    rank = np.argsort(order, axis=1)
    within = np.take_along_axis(np.cumsum(np.take_along_axis(t, order, 1), 1), rank, 1)
    ratio = (within.astype(np.float32) / n) / ((rank + 1).astype(np.float32) / n)
    return 1.0 - np.mean((ratio.astype(np.float64) * t).sum(1) / (t.sum(1) + 1e-5))


@pytest.mark.parametrize("case", ["A", "B", "D"])
def test_goldens_margin0(smooth_rank_goldens, case):
    inputs = smooth_rank_goldens["inputs"][case]
    x, labels = np.array(inputs["X"]), np.array(inputs["y"])
    golden = smooth_rank_goldens["results"][GOLDEN][case]
    value64, grad64 = _loss_and_grad(BlackBoxAPLoss(margin=0.0, dtype="float64"), labels, x)
    # The original casts the ranks to float32 (`.float()`) before dividing them, which
    # moves its float64 loss by up to 5e-9 relative; our float64 value is the exact one:
    exact_ap = reference.batch_average_precision(x, labels, include_self=True)
    np.testing.assert_allclose(value64, 1.0 - np.mean(exact_ap * 4 / (4 + 1e-5)), rtol=1e-13)
    np.testing.assert_allclose(value64, golden["loss"], rtol=0, atol=5e-9)
    np.testing.assert_allclose(_float32_ratio_loss(x, labels), golden["loss"], rtol=1e-13)
    exact_key = "roadmap_heavisideap_exactAP_selfincluded"
    np.testing.assert_allclose(np.mean(1 - exact_ap),
                               smooth_rank_goldens["results"][exact_key][case]["loss"], rtol=1e-12)
    value32, grad32 = _loss_and_grad(BlackBoxAPLoss(margin=0.0), labels, x, "float32")
    np.testing.assert_allclose(value32, golden["loss"], rtol=1e-5)
    np.testing.assert_allclose(grad32, grad64, atol=1e-5 * np.abs(grad64).max())
    # Functional core on S = X X^T (no re-normalisation, as the original): the
    # gradient summaries match exactly.
    xt = tf.constant(x)
    pos, cand = label_masks(tf.constant(labels), tf.constant(labels))
    with tf.GradientTape() as tape:
        tape.watch(xt)
        loss = 1.0 - tf.reduce_mean(blackbox_ap(xt @ tf.transpose(xt), pos, cand))
    g = tape.gradient(loss, xt).numpy()
    np.testing.assert_allclose(np.linalg.norm(g), golden["grad_fro"], rtol=1e-12)
    np.testing.assert_allclose(g[0, :4], golden["grad_row0_first4"], atol=1e-15)
    w99 = np.random.default_rng(99).standard_normal(x.shape)
    np.testing.assert_allclose((g * w99).sum(), golden["grad_dot_W99"], rtol=1e-12)
    # The loss normalises inside: its gradient is the tangential part of the original's.
    np.testing.assert_allclose(grad64, _tangential(g, x), atol=1e-15)


def test_full_gradient_case_a(smooth_rank_goldens):
    inputs = smooth_rank_goldens["inputs"]["A"]
    x = np.array(inputs["X"])
    full = np.array(smooth_rank_goldens["full_grad_case_A"][GOLDEN])
    for dtype, atol in [("float64", 1e-15), ("float32", 1e-5 * np.abs(full).max())]:
        _, grad = _loss_and_grad(BlackBoxAPLoss(margin=0.0, dtype=dtype), inputs["y"], x, dtype)
        np.testing.assert_allclose(grad, _tangential(full, x), atol=atol)


def test_matches_numpy_port_on_irregular_labels():
    rng = np.random.default_rng(11)
    for lambda_ in (4.0, 0.5):
        s = np.tanh(rng.normal(size=(9, 25)))
        t = (rng.random((9, 25)) < 0.3).astype(float)
        t[:, 3] = 1.0
        expected_loss, expected_grad = reference.blackbox_ap_reference(s, t, lambda_)
        st = tf.constant(s)
        with tf.GradientTape() as tape:
            tape.watch(st)
            loss = 1.0 - tf.reduce_mean(blackbox_ap(st, tf.constant(t > 0), lambda_=lambda_))
        np.testing.assert_allclose(loss.numpy(), expected_loss, rtol=1e-13)
        np.testing.assert_allclose(tape.gradient(loss, st).numpy(), expected_grad, atol=1e-15)
        assert np.abs(expected_grad).max() > 0


def test_non_candidates_are_not_ranked():
    rng = np.random.default_rng(12)
    s = np.tanh(rng.normal(size=(4, 10)))
    t = rng.random((4, 10)) < 0.4
    t[:, 0] = True
    cand = np.ones_like(t)
    cand[:, 7:] = False
    full = blackbox_ap(tf.constant(s), tf.constant(t), tf.constant(cand)).numpy()
    cut = blackbox_ap(tf.constant(s[:, :7]), tf.constant(t[:, :7])).numpy()
    np.testing.assert_allclose(full, cut, rtol=1e-14)


def test_stochastic_margin_is_seeded_and_shifts_positives_down():
    rng = np.random.default_rng(13)
    x = rng.normal(size=(16, 6))
    labels = np.repeat(np.arange(4), 4)
    a = BlackBoxAPLoss(margin=0.5, seed=3, dtype="float64")(labels, x).numpy()
    b = BlackBoxAPLoss(margin=0.5, seed=3, dtype="float64")(labels, x).numpy()
    clean = BlackBoxAPLoss(margin=0.0, dtype="float64")(labels, x).numpy()
    assert a == b
    assert a > clean  # positives moved down, negatives up: AP can only drop
    s = tf.constant(np.tanh(rng.normal(size=(3, 8))))
    t = tf.constant(rng.random((3, 8)) < 0.5) | tf.eye(3, 8, dtype=tf.bool)
    noise = tf.constant(np.abs(rng.normal(size=(3, 8))))
    shifted = s - 0.1 * noise * (tf.cast(t, s.dtype) - 0.5)
    np.testing.assert_allclose(blackbox_ap(s, t, margin=0.1, noise=noise).numpy(),
                               blackbox_ap(shifted, t).numpy(), rtol=1e-14)


def test_all_positive_and_singleton_queries():
    x = np.random.default_rng(14).normal(size=(6, 3))
    value, grad = _loss_and_grad(BlackBoxAPLoss(dtype="float64"), np.zeros(6, int), x)
    assert value == 0.0 and np.all(grad == 0.0)
    value, grad = _loss_and_grad(BlackBoxAPLoss(dtype="float64"), np.arange(6), x)
    assert value == 0.0 and np.all(grad == 0.0)
    # Singleton queries (only themselves) stay in the mean, as in the original, with
    # AP 1/(1 + 1e-5); drop_lone_queries=True leaves them out.
    labels = np.array([0, 0, 0, 1, 2, 3])
    ap = reference.batch_average_precision(x, labels, include_self=True)
    value, _ = _loss_and_grad(BlackBoxAPLoss(margin=0.0, dtype="float64"), labels, x)
    np.testing.assert_allclose(value, 1.0 - np.mean(np.r_[ap[:3] * 3 / (3 + 1e-5),
                                                          ap[3:] / (1 + 1e-5)]), rtol=1e-13)
    value, _ = _loss_and_grad(BlackBoxAPLoss(margin=0.0, dtype="float64",
                                             drop_lone_queries=True), labels, x)
    np.testing.assert_allclose(value, 1.0 - np.mean(ap[:3] * 3 / (3 + 1e-5)), rtol=1e-13)


def test_bad_arguments():
    with pytest.raises(ValueError, match="lambda_"):
        BlackBoxAPLoss(lambda_=0.0)
    with pytest.raises(ValueError, match="margin"):
        BlackBoxAPLoss(margin=-1.0)
