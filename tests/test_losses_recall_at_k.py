"""RecallAtKLoss (TensorFlow only): a dense NumPy reference of the formula for the
settings the goldens do not cover (the query left out of the ranking, several blocks),
argument errors, the config round trip, sample weights under SiMix, and one
MultiStageModel step with SiMix equal to the single-pass step.

The goldens from the authors' code are checked on every backend in
tests/backend_agnostic/test_recall_at_k.py.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_training_common import (
    assert_weights_close,
    build_exactness_model,
    make_batch,
    max_abs_diff,
    plain_fit,
)
from tfaploss.losses import RecallAtKLoss
from tfaploss.training import MultiStageModel

BATCH = 12


def _sig(t, tau):
    return 1.0 / (1.0 + np.exp(-np.clip(t / tau, -50, 50)))


def dense_recall_loss(x, y, ks=(1, 2, 4, 8, 16), tau1=0.01, tau2=1.0, include_self=True):
    """The formula written out per query and positive (O(B^3), small B only)."""
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = x @ x.T
    b = len(y)
    tau2 = [tau2] * len(ks) if np.isscalar(tau2) else tau2
    losses = []
    for i in range(b):
        pos = [p for p in range(b) if p != i and y[p] == y[i]]
        if not pos:
            continue
        cand = [j for j in range(b) if include_self or j != i]
        ranks = {p: 1 + sum(_sig(s[i, j] - s[i, p], tau1) for j in cand if j != p)
                 for p in pos}
        recall = 0.0
        for k, t2 in zip(ks, tau2):
            k = min(k, b)
            hits = sum(_sig(k - ranks[p], t2) for p in pos)
            recall += min(hits, k) / min(k, len(pos))
        losses.append(1 - recall / len(ks))
    return np.mean(losses)


@pytest.mark.parametrize("include_self", [True, False])
def test_matches_dense_reference_with_several_blocks(include_self):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((20, 6))
    y = rng.integers(0, 5, 20)  # unsorted labels, uneven classes
    x[4] = x[9]  # a tie
    ks = (1, 2, 4, 8)
    loss = RecallAtKLoss(ks, tau1=0.05, tau2=[1, 2, 4, 8],
                         include_self=include_self, pairs_per_block=7, dtype="float64")
    expected = dense_recall_loss(x, y, ks, 0.05, [1, 2, 4, 8], include_self)
    np.testing.assert_allclose(float(loss(y, x)), expected, rtol=1e-12)
    # the query's own score shifts every rank by about one: the two settings differ
    other = dense_recall_loss(x, y, ks, 0.05, [1, 2, 4, 8], not include_self)
    assert abs(other - expected) > 1e-3


def test_gradient_matches_central_differences():
    rng = np.random.default_rng(4)
    x = tf.constant(rng.standard_normal((10, 4)))
    y = np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])
    loss = RecallAtKLoss(k=(1, 2, 4), tau1=0.3, dtype="float64")
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = loss(y, x)
    grad = tape.gradient(value, x).numpy()
    numeric = np.zeros_like(grad)
    eps = 1e-6
    for idx in np.ndindex(*grad.shape):
        d = np.zeros(grad.shape)
        d[idx] = eps
        numeric[idx] = (dense_recall_loss(x.numpy() + d, y, (1, 2, 4), 0.3)
                        - dense_recall_loss(x.numpy() - d, y, (1, 2, 4), 0.3)) / (2 * eps)
    np.testing.assert_allclose(grad, numeric, atol=1e-7 * np.abs(numeric).max() + 1e-9)
    assert np.abs(grad).max() > 1e-3


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"k": []}, "k must be"), ({"k": [0, 1]}, "k must be"), ({"k": [1.5]}, "k must be"),
    ({"k": 4}, "k must be"), ({"k": [True]}, "k must be"),
    ({"tau1": 0}, "tau1"), ({"tau1": "0.01"}, "tau1"),
    ({"tau2": -1.0}, "tau2"), ({"tau2": [1, 2]}, "tau2"), ({"tau2": [1, 2, 4, 8, 0]}, "tau2"),
    ({"simix": 1}, "simix must"), ({"simix_group": 1}, "simix_group"),
    ({"seed": 1.5}, "seed"), ({"pairs_per_block": 0}, "pairs_per_block"),
])
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=f"RecallAtKLoss: {match}.*received"):
        RecallAtKLoss(**kwargs)


def test_call_errors():
    x = np.random.default_rng(0).standard_normal((8, 3))
    y = np.repeat(np.arange(2), 4)
    loss = RecallAtKLoss()
    with pytest.raises(ValueError, match="alphas must hold one coefficient per pair"):
        loss.mixed_loss(y, x, alphas=np.zeros(5))
    with pytest.raises(ValueError, match="first and second"):
        loss.mixed_loss(y, x, alphas=np.zeros(2), first=[0, 1])
    with pytest.raises(ValueError, match="first and second must be 1-D"):
        loss.mixed_loss(y, x, alphas=np.zeros(2), first=[0, 1], second=[2])
    with pytest.raises(ValueError, match="sample_weight must hold one weight per batch"):
        RecallAtKLoss(simix=True)(y, x, sample_weight=np.ones(5))
    with pytest.raises(ValueError, match="shape \\(batch, dim\\)"):
        RecallAtKLoss(simix=True)(y, x[None])
    with pytest.raises(ValueError, match="8 embeddings"):
        RecallAtKLoss(simix=True)(y[:6], x)


def test_config_round_trip():
    loss = RecallAtKLoss(k=[1, 4, 10], tau1=0.02, tau2=[1, 4, 10], include_self=False,
                         normalize=False, simix=True, simix_group=3, seed=11,
                         pairs_per_block=5, drop_lone_queries=True, name="rk")
    config = loss.get_config()
    params = set(inspect.signature(RecallAtKLoss.__init__).parameters) - {"self"}
    assert params <= set(config)
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(loss))
    assert isinstance(clone, RecallAtKLoss)
    assert clone.get_config() == config
    x = np.random.default_rng(1).standard_normal((9, 4))
    y = np.repeat(np.arange(3), 3)
    # same seed, same first draw of the mixing coefficients
    np.testing.assert_allclose(float(clone(y, x)), float(loss(y, x)), rtol=1e-6)


def test_simix_sample_weight_extends_to_mixed_items():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 4))
    y = np.repeat(np.arange(2), 4)
    w = rng.uniform(0.5, 2.0, 8)
    alphas = rng.uniform(size=12)
    loss = RecallAtKLoss(dtype="float64")
    terms = loss.mixed_loss(y, x, alphas)  # default reduction: mean of all 20 terms
    per_query = RecallAtKLoss(dtype="float64", reduction="none").mixed_loss(y, x, alphas)
    assert per_query.shape == (20,)
    np.testing.assert_allclose(float(terms), np.mean(per_query), rtol=1e-12)
    first = [0, 0, 0, 1, 1, 2, 4, 4, 4, 5, 5, 6]  # the loss's pairs: groups of 4
    second = [1, 2, 3, 2, 3, 3, 5, 6, 7, 6, 7, 7]
    weights = np.concatenate([w, (w[first] + w[second]) / 2])
    weighted = loss.mixed_loss(y, x, alphas, first, second, sample_weight=w)
    np.testing.assert_allclose(float(weighted), np.sum(weights * per_query) / 20,
                               rtol=1e-12)


def _simix_loss():
    # make_batch: 4 classes x 3 images; one SiMix group per class
    return RecallAtKLoss(simix=True, simix_group=3, seed=5, tau1=0.1)


@pytest.mark.parametrize("chunk_size", [1, 5])
def test_multistage_step_with_simix_equals_plain_step(chunk_size):
    initial = build_exactness_model().get_weights()
    images, labels = make_batch(BATCH)
    expected, plain_logs = plain_fit(initial, _simix_loss(), images, labels)
    assert max_abs_diff(initial, expected) > 1e-3
    without, _ = plain_fit(initial, RecallAtKLoss(tau1=0.1), images, labels)
    assert max_abs_diff(without, expected) > 1e-4  # the mixed items change the step
    model = build_exactness_model()
    model.set_weights(initial)
    wrapper = MultiStageModel(model, chunk_size=chunk_size)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=_simix_loss(),
                    run_eagerly=chunk_size == 1)  # chunk 5: graph mode
    logs = wrapper.fit(images, labels, batch_size=BATCH, epochs=1, shuffle=False,
                       verbose=0).history
    assert_weights_close(model.get_weights(), expected, rtol=1e-5, atol=1e-6)
    assert logs["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-5)


def test_simix_coefficients_under_xla_are_the_eager_ones():
    """No state: under XLA the loss mixes with ``simix_coefficients`` of the batch (the
    same bits as eagerly); the same batch twice gives the same loss, another batch
    other coefficients."""
    loss = RecallAtKLoss(simix=True, seed=0)
    x = tf.constant(np.random.default_rng(0).standard_normal((8, 4)), "float32")
    y = np.repeat(np.arange(2), 4)
    step = tf.function(lambda z: (loss(y, z), loss.simix_coefficients(y, z)),
                       jit_compile=True)
    value, alphas = step(x)
    np.testing.assert_array_equal(alphas.numpy(), loss.simix_coefficients(y, x).numpy())
    expected = float(RecallAtKLoss().mixed_loss(y, x, alphas))
    assert np.isfinite(expected)
    assert float(value) == pytest.approx(expected, rel=1e-6)
    assert float(step(x)[0]) == float(value)
    moved = step(x + 0.05)[1].numpy()
    assert np.mean(np.abs(moved - alphas.numpy())) > 0.1
