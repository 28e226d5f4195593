"""Cross-batch memory: the ring buffer, a hand-computed query-vs-memory loss, and the
memory term inside a MultiStageModel step."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from tests.test_training_common import (
    assert_weights_close,
    build_exactness_model,
    make_batch,
    plain_fit,
)
from tfaploss.losses import APLoss
from tfaploss.losses.base import RetrievalLoss
from tfaploss.training import CrossBatchMemory, MultiStageModel


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


def test_memory_needs_a_query_database_loss():
    images, labels = make_batch(12)
    wrapper = MultiStageModel(build_exactness_model(), chunk_size=6, xbm_size=4)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    with pytest.raises(ValueError, match="query-vs-database"):
        wrapper.fit(images, labels, batch_size=12, verbose=0)
    assert int(wrapper.optimizer.iterations.numpy()) == 0


def test_bad_memory_arguments_are_refused():
    with pytest.raises(ValueError, match="size=0"):
        CrossBatchMemory(size=0, embedding_dim=4)
    with pytest.raises(ValueError, match="embedding_dim=0"):
        CrossBatchMemory(size=4, embedding_dim=0)
