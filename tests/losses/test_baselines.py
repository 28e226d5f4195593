"""ContrastiveLoss and TripletLoss against literal NumPy ports of TF Addons' definitions."""

import numpy as np
import pytest
import tensorflow as tf

from tests.support import reference
from tfaploss.losses import ContrastiveLoss, TripletLoss

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only

REFERENCES = {
    "semihard": reference.triplet_semihard_reference,
    "hard": reference.triplet_hard_reference,
    "all": reference.triplet_all_reference,
}


def _batch(seed, n=14, d=5, classes=4):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    labels[:2] = 0  # at least one positive pair
    return rng.normal(size=(n, d)), labels


def _fd_grad(fn, x, h=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        g[idx] = (fn(xp) - fn(xm)) / (2 * h)
    return g


def _value_and_grad(loss, labels, x):
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        value = loss(labels, xt)
    return value.numpy(), tape.gradient(value, xt).numpy()


@pytest.mark.parametrize("mining", ["semihard", "hard", "all"])
@pytest.mark.parametrize("margin", [1.0, 0.3])
def test_triplet_matches_tf_addons_definition(mining, margin):
    ref = REFERENCES[mining]
    for seed in range(3):
        x, labels = _batch(seed)
        loss = TripletLoss(margin=margin, mining=mining, dtype="float64")
        value, grad = _value_and_grad(loss, labels, x)
        np.testing.assert_allclose(value, ref(x, labels, margin), rtol=1e-12)
        if seed == 0:
            fd = _fd_grad(lambda v, labels=labels: ref(v, labels, margin), x)
            np.testing.assert_allclose(grad, fd, atol=1e-6)
    assert value > 0


def test_semihard_falls_back_to_farthest_negative():
    # Anchor 0's negatives are all closer than its positive: no semi-hard negative.
    x = np.array([[1.0, 0.0], [-1.0, 0.05], [0.9, 0.3], [0.8, -0.4]])
    labels = np.array([0, 0, 1, 1])
    value = TripletLoss(mining="semihard", dtype="float64")(labels, x).numpy()
    np.testing.assert_allclose(value, reference.triplet_semihard_reference(x, labels), rtol=1e-12)


def test_float32_matches_float64():
    x, labels = _batch(5, n=40, d=8)
    for mining in ("semihard", "hard", "all"):
        v32 = TripletLoss(mining=mining)(labels, x.astype(np.float32)).numpy()
        v64 = TripletLoss(mining=mining, dtype="float64")(labels, x).numpy()
        np.testing.assert_allclose(v32, v64, rtol=1e-5)


@pytest.mark.parametrize("mining", ["semihard", "all"])
def test_triplet_blocks_do_not_change_value_or_gradient(mining):
    # Blocks of 1, 5 and 7 pairs against one block of every pair: padding of the last
    # block, pairs that straddle blocks and queries split between them.
    x, labels = _batch(11, n=24, d=6, classes=5)
    value, grad = _value_and_grad(TripletLoss(mining=mining, dtype="float64",
                                              pairs_per_block=10_000), labels, x)
    for block in (1, 5, 7):
        v, g = _value_and_grad(TripletLoss(mining=mining, dtype="float64",
                                           pairs_per_block=block), labels, x)
        np.testing.assert_allclose(v, value, rtol=1e-12)
        np.testing.assert_allclose(g, grad, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(value, REFERENCES[mining](x, labels, 1.0), rtol=1e-12)
    assert TripletLoss(pairs_per_block=5).get_config()["pairs_per_block"] == 5


def test_contrastive_matches_tf_addons_definition():
    for seed in range(3):
        x, labels = _batch(seed)
        for margin in (1.0, 0.5):
            value, grad = _value_and_grad(ContrastiveLoss(margin=margin, dtype="float64"),
                                          labels, x)
            np.testing.assert_allclose(value, reference.contrastive_reference(x, labels, margin),
                                       rtol=1e-12)
    fd = _fd_grad(lambda v: reference.contrastive_reference(v, labels, 0.5), x)
    np.testing.assert_allclose(grad, fd, atol=1e-6)


def test_contrastive_per_query_weighs_positives_as_much_as_negatives():
    for seed in range(3):
        x, labels = _batch(seed)
        for margin in (1.0, 0.5):
            loss = ContrastiveLoss(margin=margin, averaging="per_query", dtype="float64")
            value, grad = _value_and_grad(loss, labels, x)
            np.testing.assert_allclose(
                value, reference.contrastive_per_query_reference(x, labels, margin),
                rtol=1e-12)
    fd = _fd_grad(lambda v: reference.contrastive_per_query_reference(v, labels, 0.5), x)
    np.testing.assert_allclose(grad, fd, atol=1e-6)
    # include_self ranks each query against itself, which is no positive pair.
    np.testing.assert_allclose(
        ContrastiveLoss(averaging="per_query", include_self=True, dtype="float64")(
            labels, x).numpy(),
        reference.contrastive_per_query_reference(x, labels), rtol=1e-12)

    # The property the option exists for: with m images per class in a batch of B,
    # "pairs" gives a query's positive pairs (m - 1) / (B - 1) of its weight, so the
    # positives' pull (margin 0: no negative term) shrinks with B; "per_query" keeps it.
    for classes in (2, 16, 64):
        labels = np.repeat(np.arange(classes), 4)
        x = np.random.default_rng(classes).normal(size=(len(labels), 6))
        pairs = _value_and_grad(ContrastiveLoss(margin=0.0, dtype="float64"), labels, x)
        balanced = _value_and_grad(
            ContrastiveLoss(margin=0.0, averaging="per_query", dtype="float64"), labels, x)
        share = 3 / (len(labels) - 1)
        np.testing.assert_allclose(pairs[0], share * balanced[0], rtol=1e-12)
        np.testing.assert_allclose(pairs[1], share * balanced[1], rtol=1e-10, atol=1e-15)
    with pytest.raises(ValueError, match="averaging must be one of .*received averaging='mean'"):
        ContrastiveLoss(averaging="mean")


def test_unnormalised_distances_are_euclidean():
    x, labels = _batch(6)
    value = TripletLoss(mining="hard", normalize=False, dtype="float64")(labels, x).numpy()
    d = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
    same = labels[:, None] == labels[None]
    out = []
    for a in range(len(labels)):
        pos = same[a] & (np.arange(len(labels)) != a)
        if pos.any():
            out.append(max(d[a, pos].max() - d[a, ~same[a]].min() + 1.0, 0.0))
    np.testing.assert_allclose(value, np.mean(out), rtol=1e-12)


def test_batch_without_triplets_is_zero():
    x, _ = _batch(7, n=6)
    for labels in (np.zeros(6, int), np.arange(6)):
        value, grad = _value_and_grad(TripletLoss(dtype="float64"), labels, x)
        assert value == 0.0 and np.all(grad == 0.0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mining"):
        TripletLoss(mining="easy")
    for bad in (0, -3, 2.5, "8"):
        with pytest.raises(ValueError, match="pairs_per_block"):
            TripletLoss(pairs_per_block=bad)
