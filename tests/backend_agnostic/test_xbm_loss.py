"""XBMLoss: a ranking loss plus its loss against a cross-batch memory, in a plain
``compile``/``fit`` on every backend (the memory layer sits on the model's output, so
Keras threads its variables through JAX's stateless step). Expected values are the
wrapped loss's own terms computed directly, the ring buffer's slots by hand, and two
SGD steps replayed by hand."""

import keras
import numpy as np
import pytest

from tests.backend_agnostic.backend import to_numpy, value_and_grad
from tfaploss.losses import APLoss, TripletLoss, XBMLoss
from tfaploss.losses.xbm import CrossBatchMemory

DIM, FEATURES = 3, 5


def _batch(seed, n=8, classes=4):
    rng = np.random.default_rng(seed)
    return (np.tile(np.arange(classes), n // classes).astype("int32"),
            rng.normal(size=(n, DIM)).astype("float32"))


def _memory(xbm):
    m = xbm.memory
    return (to_numpy(m.labels), to_numpy(m.embeddings), int(to_numpy(m.pointer)),
            int(to_numpy(m.filled)))


def test_each_training_call_adds_the_memory_term_then_enqueues():
    weight = 0.5
    xbm = XBMLoss(APLoss(), size=12, weight=weight)
    ap = APLoss()
    (y1, e1), (y2, e2), (y3, e3) = _batch(1), _batch(2), _batch(3)

    xbm.memory(e1, training=True)  # what the model's training forward pass does
    assert float(to_numpy(xbm(y1, e1))) == pytest.approx(float(to_numpy(ap(y1, e1))),
                                                        rel=1e-6)  # memory was empty
    labels, embeddings, pointer, filled = _memory(xbm)
    np.testing.assert_array_equal(labels[:8], y1)
    np.testing.assert_allclose(embeddings[:8], e1)
    assert (pointer, filled) == (8, 8)

    # Batch 2 ranks against batch 1 only (4 slots are still empty).
    xbm.memory(e2, training=True)
    value = float(to_numpy(xbm(y2, e2)))
    plain = float(to_numpy(ap(y2, e2)))
    memory_term = float(to_numpy(ap.query_database_loss(y2, e2, y1, e1)))
    assert value == pytest.approx(plain + weight * memory_term, rel=1e-5)
    assert abs(value - plain) > 1e-3
    # It fills slots 8..11, then wraps over slots 0..3 (batch 1's oldest rows).
    labels, embeddings, pointer, filled = _memory(xbm)
    np.testing.assert_array_equal(labels, np.concatenate([y2[4:], y1[4:], y2[:4]]))
    np.testing.assert_allclose(embeddings, np.concatenate([e2[4:], e1[4:], e2[:4]]))
    assert (pointer, filled) == (4, 12)

    # Evaluation (the model called with training=False) ranks against the memory but
    # leaves it as it is.
    xbm.memory(e3, training=False)
    value = float(to_numpy(xbm(y3, e3)))
    memory_term = float(to_numpy(ap.query_database_loss(y3, e3, labels, embeddings)))
    assert value == pytest.approx(float(to_numpy(ap(y3, e3))) + weight * memory_term,
                                  rel=1e-5)
    np.testing.assert_array_equal(_memory(xbm)[0], labels)
    assert _memory(xbm)[2] == 4


def test_the_loss_needs_its_memory_layer_called_before_each_call():
    xbm = XBMLoss(APLoss(), size=8)
    y, e = _batch(0)
    with pytest.raises(RuntimeError, match="memory layer"):
        xbm(y, e)
    xbm.memory(e, training=True)
    xbm(y, e)
    with pytest.raises(RuntimeError, match="memory layer"):
        xbm(y, e)  # the flag is taken by one loss call

    # A model without the memory layer is refused before its first step.
    inputs = keras.Input((DIM,))
    model = keras.Model(inputs, keras.layers.Dense(DIM)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=xbm)
    before = model.get_weights()
    with pytest.raises(RuntimeError, match="memory layer"):
        model.fit(e, y, batch_size=8, verbose=0)
    for w, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(w, b)
    assert int(to_numpy(xbm.memory.filled)) == 8  # the one call above


def test_fit_fills_the_memory_and_takes_the_hand_computed_steps():
    weight, rate, batch = 0.5, 0.5, 8
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2 * batch, FEATURES)).astype("float32")
    y = np.tile(np.arange(4), 4).astype("int32")
    kernel = rng.normal(size=(FEATURES, DIM)).astype("float32")

    xbm = XBMLoss(APLoss(), size=batch, weight=weight)
    inputs = keras.Input((FEATURES,))
    dense = keras.layers.Dense(DIM, use_bias=False)
    model = keras.Model(inputs, xbm.memory(dense(inputs)))
    dense.set_weights([kernel])
    model.compile(optimizer=keras.optimizers.SGD(rate), loss=xbm)
    history = model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)

    # By hand: step 1 is the plain loss (empty memory), step 2 adds the loss of
    # batch 2 against batch 1's embeddings from before step 1's update.
    ap, (x1, x2), (y1, y2) = APLoss(), np.split(x, 2), np.split(y, 2)
    e1 = x1 @ kernel
    loss1, g1 = value_and_grad(lambda e: ap(y1, e), e1)
    w1 = kernel - rate * x1.T @ g1
    e2 = x2 @ w1
    loss2, g2 = value_and_grad(
        lambda e: ap(y2, e) + weight * ap.query_database_loss(y2, e, y1, e1), e2)
    w2 = w1 - rate * x2.T @ g2
    assert abs(float(loss2) - float(to_numpy(ap(y2, e2)))) > 1e-3

    np.testing.assert_allclose(dense.get_weights()[0], w2, rtol=1e-4, atol=1e-5)
    assert np.abs(w2 - kernel).max() > 1e-2
    assert history.history["loss"][0] == pytest.approx((loss1 + loss2) / 2, rel=1e-4)
    # The memory holds batch 2's embeddings (from before step 2's update).
    labels, embeddings, pointer, filled = _memory(xbm)
    np.testing.assert_array_equal(labels, y2)
    np.testing.assert_allclose(embeddings, e2, rtol=1e-4, atol=1e-5)
    assert (pointer, filled) == (0, batch)
    # Evaluation (training=False) leaves the memory as it is.
    model.evaluate(x[:batch], y[:batch], batch_size=batch, verbose=0)
    np.testing.assert_array_equal(_memory(xbm)[0], y2)
    np.testing.assert_allclose(_memory(xbm)[1], embeddings)


def test_config_round_trip_and_bad_arguments():
    xbm = XBMLoss(TripletLoss(margin=0.3), size=16, embedding_dim=DIM, weight=2.0,
                  name="xbm")
    restored = XBMLoss.from_config(xbm.get_config())
    assert restored.get_config() == xbm.get_config()
    assert isinstance(restored.loss, TripletLoss) and restored.loss.margin == 0.3
    assert (restored.size, restored.memory.embedding_dim, restored.weight) == (16, DIM, 2.0)
    assert keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(xbm)).get_config() == xbm.get_config()

    with pytest.raises(ValueError, match=r"size=0"):
        XBMLoss(APLoss(), size=0)
    with pytest.raises(ValueError, match=r"weight=-1"):
        XBMLoss(APLoss(), size=4, weight=-1.0)
    with pytest.raises(ValueError, match=r"received loss=.*of type MeanSquaredError"):
        XBMLoss(keras.losses.MeanSquaredError(), size=4)
    with pytest.raises(ValueError, match=r"`size`=5 differs"):
        XBMLoss(APLoss(), size=5, memory=CrossBatchMemory(4))
