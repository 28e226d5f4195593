"""Multi-staged backpropagation: one MultiStageModel step equals one plain step.

Every exactness test trains the same small model from the same weights on the same
batch with plain SGD (lr 1), once with an ordinary single-pass ``keras.Model`` step and
once with ``MultiStageModel``, and compares the updated weights. The loss x chunk-size
matrix runs eagerly (tracing costs more than these tiny steps; ``tf.while_loop`` runs
as a Python loop); graph mode, XLA and MirroredStrategy have their own tests.
"""

import functools
import warnings

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
from tfaploss.losses import APLoss, FastAPLoss, SmoothAPLoss
from tfaploss.training import (
    FrozenBatchNormalization,
    MultiStageModel,
    NondeterministicModelWarning,
)

LOSSES = {"ap": APLoss, "smooth_ap": SmoothAPLoss, "fastap": FastAPLoss}
BATCH = 12


@functools.cache
def reference(loss_name):
    """Initial weights, weights after one plain step on the batch, and its logs."""
    initial = build_exactness_model().get_weights()
    images, labels = make_batch(BATCH)
    updated, logs = plain_fit(initial, LOSSES[loss_name](), images, labels)
    return initial, updated, logs


def multistage_fit(initial, loss, images, labels, batch_size=BATCH, jit_compile=False,
                   optimizer=None, run_eagerly=False, **kwargs):
    model = build_exactness_model()
    model.set_weights(initial)
    wrapper = MultiStageModel(model, **kwargs)
    wrapper.compile(optimizer=optimizer or keras.optimizers.SGD(1.0), loss=loss,
                    jit_compile=jit_compile, run_eagerly=run_eagerly)
    history = wrapper.fit(images, labels, batch_size=batch_size, epochs=1, shuffle=False,
                          verbose=0)
    return wrapper, model.get_weights(), history.history


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("chunk_size", [1, 3, BATCH])
def test_multistage_step_equals_plain_step(loss_name, chunk_size):
    initial, expected, plain_logs = reference(loss_name)
    # The update must be large enough that a wrong gradient cannot pass.
    assert max_abs_diff(initial, expected) > 1e-3
    images, labels = make_batch(BATCH)
    wrapper, updated, logs = multistage_fit(initial, LOSSES[loss_name](), images, labels,
                                            chunk_size=chunk_size, run_eagerly=True)
    assert_weights_close(updated, expected, rtol=1e-5, atol=1e-6)
    assert logs["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-5)
    assert int(wrapper.optimizer.iterations.numpy()) == 1


def test_graph_mode_step_equals_plain_step_batch_not_divisible():
    initial, expected, plain_logs = reference("smooth_ap")
    images, labels = make_batch(BATCH)
    # check_stages: the debug check measures stage-1 vs stage-3 embeddings (equal here).
    _, updated, logs = multistage_fit(initial, SmoothAPLoss(), images, labels, chunk_size=5,
                                      check_stages=True)
    assert_weights_close(updated, expected, rtol=1e-5, atol=1e-6)
    assert logs["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-5)
    assert logs["stage_max_abs_diff"][0] <= 1e-6


def test_learned_gem_p_and_frozen_bn_affine_are_updated():
    initial, expected, _ = reference("ap")
    model = build_exactness_model()
    names = [v.path for v in model.weights]
    changed = {n for n, a, b in zip(names, initial, expected) if np.max(np.abs(a - b)) > 0}
    assert any("gem" in n and n.endswith("/p") for n in changed), changed
    assert any("bn" in n and "gamma" in n for n in changed), changed
    assert not any("moving" in n for n in changed), changed


def test_single_pass_step_equals_plain_step():
    initial, expected, _ = reference("ap")
    images, labels = make_batch(BATCH)
    _, updated, _ = multistage_fit(initial, APLoss(), images, labels, chunk_size=None,
                                   run_eagerly=True)
    assert_weights_close(updated, expected, rtol=1e-5, atol=1e-6)


def test_jit_compile_with_batch_not_divisible_by_chunk():
    initial, expected, _ = reference("fastap")
    images, labels = make_batch(BATCH)
    _, updated, _ = multistage_fit(initial, FastAPLoss(), images, labels, chunk_size=5,
                                   jit_compile=True)
    assert_weights_close(updated, expected, rtol=1e-5, atol=1e-6)


@pytest.fixture
def mixed_float16():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_mixed_precision_step_equals_plain_step(loss_name, mixed_float16):
    initial = build_exactness_model().get_weights()
    images, labels = make_batch(BATCH)

    def optimizer():
        # Keras's default initial scale (2**15) overflows float16 on the first step,
        # which is then skipped; a smaller scale makes the step (and the test) real.
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0),
                                                   initial_scale=2.0**7)

    expected, _ = plain_fit(initial, LOSSES[loss_name](), images, labels,
                            optimizer=optimizer())
    assert max_abs_diff(initial, expected) > 1e-2
    wrapper, updated, logs = multistage_fit(initial, LOSSES[loss_name](), images, labels,
                                            chunk_size=5, optimizer=optimizer(),
                                            run_eagerly=True)
    assert isinstance(wrapper.optimizer, keras.optimizers.LossScaleOptimizer)
    assert wrapper.embedding_model.layers[1].compute_dtype == "float16"
    assert np.isfinite(logs["loss"][0])
    assert_weights_close(updated, expected, rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("loss_name", ["ap", "fastap"])
def test_two_replicas_give_the_update_of_one_replica(loss_name, two_replica_strategy):
    initial, expected, plain_logs = reference(loss_name)
    images, labels = make_batch(BATCH)
    with two_replica_strategy.scope():
        model = build_exactness_model()
        model.set_weights(initial)
        # Local batch 6, chunk 4: one full chunk and a tail of 2 on each replica.
        wrapper = MultiStageModel(model, chunk_size=4)
        wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=LOSSES[loss_name]())
    history = wrapper.fit(images, labels, batch_size=BATCH, epochs=1, shuffle=False,
                          verbose=0)
    assert wrapper.distribute_strategy.num_replicas_in_sync == 2
    # Ranking each replica's half separately would give another update; the global
    # batch gives the single-replica one.
    assert_weights_close(model.get_weights(), expected, rtol=1e-5, atol=1e-6)
    assert history.history["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-5)


def test_replicas_need_a_batch_level_ranking_loss(two_replica_strategy):
    images, _ = make_batch(BATCH)
    with two_replica_strategy.scope():
        wrapper = MultiStageModel(build_exactness_model(), chunk_size=4)
        wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    targets = np.zeros((BATCH, 5), "float32")  # shaped for mse, so only our check fails
    with pytest.raises(ValueError, match="global batch"):
        wrapper.fit(images, targets, batch_size=BATCH, verbose=0)


def test_iterations_and_learning_rate_schedule_count_batches():
    images, labels = make_batch(3 * BATCH, seed=1)
    initial = build_exactness_model().get_weights()

    def optimizer():
        # lr 1 for the first update, 0.1 after: counting chunks would switch too early.
        schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1], [1.0, 0.1])
        return keras.optimizers.SGD(schedule)

    expected, _ = plain_fit(initial, APLoss(), images, labels, batch_size=BATCH,
                            optimizer=optimizer())
    wrapper, updated, _ = multistage_fit(initial, APLoss(), images, labels,
                                         chunk_size=5, optimizer=optimizer(),
                                         run_eagerly=True)
    assert int(wrapper.optimizer.iterations.numpy()) == 3
    assert_weights_close(updated, expected, rtol=1e-5, atol=1e-6)


def test_dropout_triggers_the_warning():
    model = build_exactness_model(dropout=0.5)
    with pytest.warns(NondeterministicModelWarning, match="Dropout"):
        MultiStageModel(model, chunk_size=3)
    with pytest.raises(ValueError, match="deterministic in training"):
        MultiStageModel(model, chunk_size=3, on_nondeterministic="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultiStageModel(model, chunk_size=3, on_nondeterministic="ignore")
        MultiStageModel(model, chunk_size=None)  # single pass: nothing is recomputed
        MultiStageModel(build_exactness_model(), chunk_size=3)


def ghost_reference_step(initial, images, labels, chunk):
    """One SGD(1) step of the network whose BatchNorm normalises each chunk on its own:
    the batch embedded chunk by chunk in training mode under ONE tape (single pass)."""
    model = build_exactness_model(freeze=False)
    model.set_weights(initial)
    with tf.GradientTape() as tape:
        parts = [model(images[i:i + chunk], training=True)
                 for i in range(0, len(images), chunk)]
        loss = APLoss()(labels, tf.concat(parts, 0)) + tf.add_n(model.losses)
    grads = tape.gradient(loss, model.trainable_variables)
    keras.optimizers.SGD(1.0).apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights(), float(loss)


@pytest.mark.parametrize("chunk_size", [4, 5])
def test_batch_statistics_batch_norm_is_exact_ghost_batch_norm(chunk_size):
    """BatchNorm with batch statistics: each stage normalises the same chunk, so the
    step is the exact gradient of the ghost-batch-norm network, with no warning."""
    images, labels = make_batch(BATCH)
    initial = build_exactness_model(freeze=False).get_weights()
    expected, _ = ghost_reference_step(initial, images, labels, chunk_size)
    whole, _ = ghost_reference_step(initial, images, labels, BATCH)
    # The chunking changes the network: a test that confused the two would fail.
    trainable = [0, 1, 2, 3]  # conv kernel/bias, BN gamma/beta
    assert max_abs_diff([expected[i] for i in trainable],
                        [whole[i] for i in trainable]) > 1e-3

    model = build_exactness_model(freeze=False)
    model.set_weights(initial)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NondeterministicModelWarning)
        wrapper = MultiStageModel(model, chunk_size=chunk_size, check_stages=True)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=APLoss(), run_eagerly=True)
    history = wrapper.fit(images, labels, batch_size=BATCH, epochs=1, shuffle=False,
                          verbose=0)
    assert history.history["stage_max_abs_diff"][0] <= 1e-6
    names = [w.path for w in model.weights]
    for name, got, want in zip(names, model.get_weights(), expected):
        if "moving" in name:
            continue  # moving statistics follow the chunks; they do not enter the step
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_stage_check_catches_a_nondeterministic_model():
    images, labels = make_batch(BATCH)
    model = build_exactness_model(dropout=0.5)
    wrapper = MultiStageModel(model, chunk_size=4, on_nondeterministic="ignore",
                              check_stages=True)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=APLoss())
    with pytest.raises(tf.errors.InvalidArgumentError, match="stage-3 embeddings differ"):
        wrapper.fit(images, labels, batch_size=BATCH, verbose=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"chunk_size": 0}, "chunk_size=0"),
        ({"chunk_size": 2.5}, "chunk_size=2.5"),
        ({"xbm_size": -1}, "xbm_size=-1"),
        ({"on_nondeterministic": "maybe"}, "on_nondeterministic='maybe'"),
        ({"xbm_size": 4, "xbm_loss": "mse"}, "query_database_loss"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiStageModel(build_exactness_model(), **kwargs)


def test_predict_evaluate_and_saving_delegate(tmp_path):
    images, labels = make_batch(BATCH)
    model = build_exactness_model()
    wrapper = MultiStageModel(model, chunk_size=5, xbm_size=6)
    wrapper.compile(optimizer=keras.optimizers.SGD(0.5), loss=APLoss(), run_eagerly=True)
    wrapper.fit(images, labels, batch_size=BATCH, verbose=0)

    embeddings = model.predict(images, verbose=0)
    np.testing.assert_allclose(wrapper.predict(images, verbose=0), embeddings, rtol=1e-6)
    expected_loss = float(APLoss()(labels, embeddings)) + float(sum(model.losses))
    logs = wrapper.evaluate(images, labels, batch_size=BATCH, verbose=0, return_dict=True)
    assert logs["loss"] == pytest.approx(expected_loss, rel=1e-5)

    path = tmp_path / "multistage.keras"
    wrapper.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, MultiStageModel)
    assert (loaded.chunk_size, loaded.xbm_size) == (5, 6)
    assert isinstance(loaded.embedding_model.get_layer("bn"), FrozenBatchNormalization)
    np.testing.assert_allclose(loaded.predict(images, verbose=0), embeddings, rtol=1e-6)
    np.testing.assert_array_equal(loaded.memory.embeddings.numpy(),
                                  wrapper.memory.embeddings.numpy())


def dense_model():
    """Two Dense layers, no BatchNorm or dropout: stage 3 recomputes stage 1 exactly."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(12, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(6)(hidden))


@pytest.mark.parametrize("chunk_size", [8, 16])
def test_graph_step_backprops_the_last_chunk_through_the_old_weights(chunk_size):
    """The last chunk's stage-3 backprop reads the head's kernel only to pull G back into
    the hidden layer; that read must precede the optimizer's write of the kernel, which
    TensorFlow's graph optimizer once let run first (the hidden layer's update then came
    from the new head)."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(32, 8)).astype("float32")
    labels = np.tile(np.arange(16), 2).astype("int32")
    reference = dense_model()
    initial = reference.get_weights()
    with tf.GradientTape() as tape:
        loss = APLoss()(labels, reference(images, training=True))
    grads = tape.gradient(loss, reference.trainable_variables)
    keras.optimizers.SGD(0.5).apply_gradients(zip(grads, reference.trainable_variables))
    expected = reference.get_weights()
    assert max_abs_diff(initial, expected) > 1e-2

    model = dense_model()
    wrapper = MultiStageModel(model, chunk_size=chunk_size)
    wrapper.compile(optimizer=keras.optimizers.SGD(0.5), loss=APLoss(), jit_compile=False)
    wrapper.fit(images, labels, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), expected, rtol=1e-5, atol=1e-6)
