"""``sample_weight`` through MultiStageModel: the step still equals the plain step.

The plain single-pass ``keras.Model`` step, given per-image weights, weights each
query's term of the ranking loss (tests/losses/test_reduction.py);
MultiStageModel must give the same update, in chunks, across replicas and with the
cross-batch memory term.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support.exactness import (
    assert_weights_close,
    build_exactness_model,
    make_batch,
    max_abs_diff,
)
from tfaploss.losses import APLoss, SmoothAPLoss
from tfaploss.training import MultiStageModel

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only

BATCH = 12
WEIGHTS = np.linspace(0.2, 2.0, BATCH).astype("float32")


def _fit(model, loss, images, labels, weights, strategy=None):
    """One SGD(1) epoch of one batch; returns the model's weights and logs."""
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss, run_eagerly=strategy is None)
    history = model.fit(images, labels, sample_weight=weights, batch_size=BATCH, epochs=1,
                        shuffle=False, verbose=0)
    return history.history


def _plain(initial, loss, images, labels, weights):
    model = build_exactness_model()
    model.set_weights(initial)
    logs = _fit(model, loss, images, labels, weights)
    return model.get_weights(), logs


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum"])
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_weighted_multistage_step_equals_weighted_plain_step(chunk_size, reduction):
    images, labels = make_batch(BATCH)
    initial = build_exactness_model().get_weights()
    expected, plain_logs = _plain(initial, APLoss(reduction=reduction), images, labels,
                                  WEIGHTS)
    unweighted, _ = _plain(initial, APLoss(reduction=reduction), images, labels, None)
    assert max_abs_diff(expected, unweighted) > 1e-4  # the weights do change the step

    model = build_exactness_model()
    model.set_weights(initial)
    logs = _fit(MultiStageModel(model, chunk_size=chunk_size), APLoss(reduction=reduction),
                images, labels, WEIGHTS)
    assert_weights_close(model.get_weights(), expected, rtol=1e-5, atol=1e-6)
    assert logs["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum"])
def test_two_replicas_with_sample_weight_give_the_update_of_one(reduction,
                                                                 two_replica_strategy):
    images, labels = make_batch(BATCH)
    initial = build_exactness_model().get_weights()
    loss = SmoothAPLoss(reduction=reduction)
    expected, plain_logs = _plain(initial, loss, images, labels, WEIGHTS)
    with two_replica_strategy.scope():
        model = build_exactness_model()
        model.set_weights(initial)
        wrapper = MultiStageModel(model, chunk_size=4)
        logs = _fit(wrapper, SmoothAPLoss(reduction=reduction), images, labels, WEIGHTS,
                    strategy=two_replica_strategy)
    assert wrapper.distribute_strategy.num_replicas_in_sync == 2
    # "sum" takes a B times larger step (SGD at lr 1), float32 noise included; a
    # missing or extra 1/replicas would be a factor of 2.
    atol = 1e-5 if reduction == "sum" else 1e-6
    assert_weights_close(model.get_weights(), expected, rtol=1e-5, atol=atol)
    assert logs["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-5)


def test_memory_term_weights_its_queries_too():
    """Step 2 of a memory run equals, by hand, the weighted loss plus the weighted
    query-vs-memory term (the memory holding batch 1's last stage-1 embeddings)."""
    images, labels = make_batch(24, seed=3)
    weights = np.concatenate([WEIGHTS, WEIGHTS[::-1]])
    first, second = slice(0, 12), slice(12, 24)
    initial = build_exactness_model().get_weights()
    weight, size = 0.5, 8
    loss = APLoss()

    model = build_exactness_model()
    model.set_weights(initial)
    memory = model(images[first], training=True)[-size:]
    with tf.GradientTape() as tape:
        step1 = (loss(labels[first], model(images[first], training=True),
                      sample_weight=weights[first]) + sum(model.losses))
    for v, g in zip(model.trainable_variables, tape.gradient(step1, model.trainable_variables)):
        v.assign_sub(g)
    with tf.GradientTape() as tape:
        embeddings = model(images[second], training=True)
        memory_term = loss.query_database_loss(labels[second], embeddings,
                                               labels[first][-size:], memory,
                                               sample_weight=weights[second])
        step2 = (loss(labels[second], embeddings, sample_weight=weights[second])
                 + weight * memory_term + sum(model.losses))
    for v, g in zip(model.trainable_variables, tape.gradient(step2, model.trainable_variables)):
        v.assign_sub(g)
    unweighted = loss.query_database_loss(labels[second], embeddings,
                                          labels[first][-size:], memory)
    assert abs(float(memory_term) - float(unweighted)) > 1e-4

    trained = build_exactness_model()
    trained.set_weights(initial)
    wrapper = MultiStageModel(trained, chunk_size=5, xbm_size=size, xbm_weight=weight)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=APLoss(), run_eagerly=True)
    history = wrapper.fit(images, labels, sample_weight=weights, batch_size=12,
                          shuffle=False, verbose=0)
    # float32, two SGD steps at lr 1, the second through the weighted memory term:
    # chunked and single-pass forward passes round differently (up to 4e-6 apart with
    # Keras 3.15.1, TF 2.20); the unweighted memory step is held to 1e-6 in
    # tests/losses/test_xbm.py
    assert_weights_close(trained.get_weights(), model.get_weights(), rtol=1e-5, atol=2e-5)
    assert history.history["xbm_loss"][0] == pytest.approx(float(memory_term) / 2, rel=1e-5)
