"""XBMLoss: a ranking loss plus its loss against a cross-batch memory, in a plain
``compile``/``fit`` on every backend (the memory layer sits on the model's output, so
Keras threads its variables through JAX's stateless step). Expected values are the
wrapped loss's own terms computed directly, the ring buffer's slots by hand, and two
SGD steps replayed by hand.

The tests marked ``tensorflow`` use TensorFlow APIs and run in the TensorFlow run only:
Cross-batch memory: the ring buffer, a hand-computed query-vs-memory loss, and the
memory term inside a MultiStageModel step.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from tests.support.backend import to_numpy, value_and_grad
from tests.support.exactness import (
    assert_weights_close,
    build_exactness_model,
    make_batch,
    plain_fit,
)
from tfaploss.losses import APLoss, TripletLoss, XBMLoss
from tfaploss.losses.base import RetrievalLoss
from tfaploss.losses.xbm import CrossBatchMemory
from tfaploss.training import MultiStageModel

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


# --------------------------------------------------------------------------------------
# TensorFlow only
# --------------------------------------------------------------------------------------

class CandidateMinusPositiveScore(RetrievalLoss):
    """Per query: mean score over candidates minus mean score over positives.

    Linear in the scores, so its value and gradient are easy to derive by hand.
    """

    def per_query(self, scores, positives, candidates, self_pairs=None):
        p = ops.cast(positives, scores.dtype)
        c = ops.cast(candidates, scores.dtype)
        n_p = ops.sum(p, axis=1)
        value = ops.sum(c * scores, axis=1) / ops.sum(c, axis=1) - ops.sum(
            p * scores, axis=1) / ops.maximum(n_p, 1.0)
        return value, ops.cast(n_p > 0, scores.dtype)


@pytest.mark.tensorflow
def test_ring_buffer_overwrites_the_oldest_entries():
    memory = CrossBatchMemory(size=4, embedding_dim=2)
    assert int(memory.filled.numpy()) == 0
    memory.enqueue(np.array([[1, 0], [2, 0], [3, 0]], "float32"), np.array([1, 2, 3]))
    memory.enqueue(np.array([[4, 0], [5, 0]], "float32"), np.array([4, 5]))
    np.testing.assert_array_equal(memory.embeddings.numpy()[:, 0], [5, 2, 3, 4])
    np.testing.assert_array_equal(memory.labels.numpy(), [5, 2, 3, 4])
    assert (int(memory.pointer.numpy()), int(memory.filled.numpy())) == (1, 4)
    # A batch larger than the memory keeps its last `size` rows.
    memory.enqueue(np.arange(12, dtype="float32").reshape(6, 2), np.arange(10, 16))
    # Rows labelled 12..15 go to slots 1, 2, 3, 0.
    np.testing.assert_array_equal(memory.labels.numpy(), [15, 12, 13, 14])
    np.testing.assert_array_equal(memory.embeddings.numpy()[:, 0], [10, 4, 6, 8])
    assert int(memory.pointer.numpy()) == 1
    np.testing.assert_array_equal(memory.valid_mask().numpy(), [True] * 4)


@pytest.mark.tensorflow
def test_query_vs_memory_loss_by_hand():
    loss = CandidateMinusPositiveScore(normalize=False)
    memory = CrossBatchMemory(size=3, embedding_dim=2)
    queries = tf.constant([[1.0, 0.0], [0.0, 2.0]])
    query_labels = tf.constant([0, 1])
    assert float(memory.query_loss(loss, query_labels, queries)) == 0.0  # empty memory

    # r1 = (0.5, 0.5) label 0, r2 = (1, 1) label 1; one slot still empty.
    memory.enqueue(np.array([[0.5, 0.5], [1, 1]], "float32"), np.array([0, 1]))
    # q1 . (r1, r2) = (0.5, 1): 0.75 - 0.5 = 0.25;  q2: (1, 2): 1.5 - 2 = -0.5.
    # (Counting the empty zero slot, labelled 0, would give q1 0.5 - 0.25 = 0.25 and
    # q2 1.0 - 2 = -1.)
    value = float(memory.query_loss(loss, query_labels, queries))
    assert value == pytest.approx((0.25 - 0.5) / 2, abs=1e-6)

    # r3 = (2, 0) label 0 fills slot 2, r4 = (0, -1) label 1 overwrites r1.
    memory.enqueue(np.array([[2, 0], [0, -1]], "float32"), np.array([0, 1]))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(queries)
        value = memory.query_loss(loss, query_labels, queries)
    # q1 . (r4, r2, r3) = (0, 1, 2): mean 1, positive r3: 2 -> -1.
    # q2 . (r4, r2, r3) = (-2, 2, 0): mean 0, positives r4, r2: 0 -> 0.
    assert float(value) == pytest.approx(-0.5, abs=1e-6)
    # d/dq_i = (mean of memory - mean of positives) / 2 queries.
    grad = tape.gradient(value, queries).numpy()
    np.testing.assert_allclose(grad, [[(1 - 2) / 2, 0.0], [(1 - 0.5) / 2, 0.0]], atol=1e-6)
    assert tape.gradient(value, memory.embeddings.value) is None  # memory is detached


@pytest.mark.tensorflow
def test_memory_size_zero_is_the_plain_loss():
    images, labels = make_batch(24, seed=2)
    initial = build_exactness_model().get_weights()
    expected, plain_logs = plain_fit(initial, APLoss(), images, labels, batch_size=12)
    model = build_exactness_model()
    model.set_weights(initial)
    wrapper = MultiStageModel(model, chunk_size=5, xbm_size=0)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=APLoss(), run_eagerly=True)
    history = wrapper.fit(images, labels, batch_size=12, shuffle=False, verbose=0)
    assert wrapper.memory is None
    assert_weights_close(model.get_weights(), expected, rtol=1e-5, atol=1e-6)
    assert history.history["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-5)


@pytest.mark.slow
@pytest.mark.tensorflow
def test_multistage_step_adds_the_query_vs_memory_loss():
    images, labels = make_batch(24, seed=3)
    first, second = slice(0, 12), slice(12, 24)
    initial = build_exactness_model().get_weights()
    weight, size = 0.5, 8
    loss = APLoss()

    # By hand: step 1 is plain (empty memory); the memory then holds the last 8
    # stage-1 embeddings of batch 1 (computed before the update); step 2 adds
    # weight * loss(batch 2 queries vs that memory), the memory side detached.
    model = build_exactness_model()
    model.set_weights(initial)
    memory = model(images[first], training=True)[-size:]
    with tf.GradientTape() as tape:
        step1 = loss(labels[first], model(images[first], training=True)) + sum(model.losses)
    for v, g in zip(model.trainable_variables, tape.gradient(step1, model.trainable_variables)):
        v.assign_sub(g)
    with tf.GradientTape() as tape:
        embeddings = model(images[second], training=True)
        memory_term = loss.query_database_loss(labels[second], embeddings,
                                               labels[first][-size:], memory)
        step2 = (loss(labels[second], embeddings) + weight * memory_term
                 + sum(model.losses))
    next_memory = embeddings[-size:].numpy()
    for v, g in zip(model.trainable_variables, tape.gradient(step2, model.trainable_variables)):
        v.assign_sub(g)
    assert float(memory_term) > 0.0

    trained = build_exactness_model()
    trained.set_weights(initial)
    wrapper = MultiStageModel(trained, chunk_size=5, xbm_size=size, xbm_weight=weight)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=APLoss())
    history = wrapper.fit(images, labels, batch_size=12, shuffle=False, verbose=0)
    assert_weights_close(trained.get_weights(), model.get_weights(), rtol=1e-5, atol=1e-6)
    # The logged memory loss is the mean over the two steps (0 on the first).
    assert history.history["xbm_loss"][0] == pytest.approx(float(memory_term) / 2, rel=1e-5)
    expected_loss = (float(step1) + float(step2)) / 2
    assert history.history["loss"][0] == pytest.approx(expected_loss, rel=1e-5)
    # Batch 1 filled slots 0..7 and wrapped the pointer to 0; batch 2 overwrote them.
    np.testing.assert_array_equal(wrapper.memory.labels.numpy(), labels[second][-size:])
    np.testing.assert_allclose(wrapper.memory.embeddings.numpy(), next_memory, atol=1e-6)


@pytest.mark.tensorflow
def test_memory_needs_a_query_database_loss():
    images, labels = make_batch(12)
    wrapper = MultiStageModel(build_exactness_model(), chunk_size=6, xbm_size=4)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    with pytest.raises(ValueError, match="query-vs-database"):
        wrapper.fit(images, labels, batch_size=12, verbose=0)
    assert int(wrapper.optimizer.iterations.numpy()) == 0


@pytest.mark.tensorflow
def test_bad_memory_arguments_are_refused():
    with pytest.raises(ValueError, match="size=0"):
        CrossBatchMemory(size=0, embedding_dim=4)
    with pytest.raises(ValueError, match="embedding_dim=0"):
        CrossBatchMemory(size=4, embedding_dim=0)
