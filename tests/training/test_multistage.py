"""MultiStageModel on every Keras backend: one multi-stage step equals one plain step.

Float64 throughout, so that "equal" means 1e-9, not a float32 tolerance that a slightly
wrong gradient could pass. The reference is the backend's own ``keras.Model.fit`` step
on the whole batch (TF: a tape; JAX: ``jax.value_and_grad``; torch: ``backward``), from
the same weights, with SGD(lr=1), so the update is the gradient. The loss is
``SoftNeighbourLoss`` (keras.ops only, see tests/support/backend.py); the exactness
property does not depend on which batch-level loss it is.

Runs under the process's KERAS_BACKEND: on TensorFlow in the main ``make test`` run, on
JAX and on PyTorch in its second and third runs (``make test-jax`` / ``make test-torch``).

The tests marked ``tensorflow`` use TensorFlow APIs and run in the TensorFlow run only:
Multi-staged backpropagation: one MultiStageModel step equals one plain step.

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

from tests.support.backend import (
    BACKEND,
    SoftNeighbourLoss,
    WithFixedMemory,
    float64_policy,
    to_numpy,
)
from tests.support.exactness import (
    IMAGE_SHAPE,
    assert_weights_close,
    build_exactness_model,
    make_batch,
    max_abs_diff,
    plain_fit,
)
from tfaploss import models
from tfaploss.losses import APLoss, FastAPLoss, SmoothAPLoss
from tfaploss.training import (
    FrozenBatchNormalization,
    MultiStageModel,
    NondeterministicModelWarning,
)

BATCH = 12

TOLERANCE = {"rtol": 1e-9, "atol": 1e-9}
if BACKEND == "torch":
    # Keras's torch ops compute float64 matmuls in float32 (keras.backend.result_type
    # maps float64 to float32 outside TensorFlow, and torch's `matmul` casts to it), so
    # Dense layers round to float32 in the plain step and in the chunks alike; the
    # sums then differ at float32 rounding (1e-9 after one step, 1e-7 after three).
    # A wrong gradient moves the weights by > 1e-2 (checked below).
    TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}


def build_model(seed=0, dropout=0.0):
    """The exactness model (tests/support/exactness.py) in the policy's dtype."""
    return build_exactness_model(seed, dropout=dropout, output_dtype=None)


def make_float64_batch(n=BATCH, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n,) + IMAGE_SHAPE), (np.arange(n) % classes).astype("int32")


def weights_of(model):
    return [np.array(w, dtype=np.float64) for w in model.get_weights()]


def assert_weights_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, **TOLERANCE)


def fit_once(model, loss, images, labels, optimizer=None, batch_size=BATCH, **compile_kwargs):
    model.compile(optimizer=optimizer or keras.optimizers.SGD(1.0), loss=loss, **compile_kwargs)
    history = model.fit(images, labels, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return history.history


def plain_reference(initial, images, labels, loss=None, optimizer=None, batch_size=BATCH):
    model = build_model()
    model.set_weights(initial)
    logs = fit_once(model, loss or SoftNeighbourLoss(), images, labels, optimizer=optimizer,
                    batch_size=batch_size)
    return weights_of(model), logs


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [1, 5, BATCH, None])
def test_multistage_step_equals_plain_step_float64(chunk_size):
    images, labels = make_float64_batch()
    with float64_policy():
        initial = build_model().get_weights()
        assert initial[0].dtype == np.float64
        expected, plain_logs = plain_reference(initial, images, labels)
        model = build_model()
        model.set_weights(initial)
        wrapper = MultiStageModel(model, chunk_size=chunk_size)
        logs = fit_once(wrapper, SoftNeighbourLoss(), images, labels)
    # The update must be large enough that a wrong gradient cannot pass.
    assert max(np.abs(a - b).max() for a, b in zip(initial, expected)) > 1e-2
    assert_weights_equal(weights_of(model), expected)
    assert logs["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-9)
    assert int(to_numpy(wrapper.optimizer.iterations)) == 1


@pytest.mark.slow
@pytest.mark.parametrize("loss_name", ["APLoss", "FastAPLoss", "SmoothAPLoss",
                                       "MultiSimilarityLoss", "SupConLoss"])
def test_multistage_step_with_the_library_losses_float64(loss_name):
    """The AP surrogates themselves (keras.ops on every backend) through the stages."""
    import tfaploss.losses

    def make_loss():
        return getattr(tfaploss.losses, loss_name)(dtype="float64")

    images, labels = make_float64_batch()
    with float64_policy():
        initial = build_model().get_weights()
        expected, plain_logs = plain_reference(initial, images, labels, loss=make_loss())
        model = build_model()
        model.set_weights(initial)
        logs = fit_once(MultiStageModel(model, chunk_size=5), make_loss(), images, labels)
    assert max(np.abs(a - b).max() for a, b in zip(initial, expected)) > 1e-6
    assert_weights_equal(weights_of(model), expected)
    assert logs["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [5, None])
def test_proxy_anchor_proxies_get_the_exact_gradient_through_the_stages(chunk_size):
    """Proxy-Anchor's proxies (a layer of the model, read by the loss in stage 2): one
    multi-stage step moves them, and every other weight, as one plain step does."""
    from tfaploss.losses import ProxyAnchorLoss

    images, labels = make_float64_batch()
    with float64_policy():
        def model_and_loss():
            loss = ProxyAnchorLoss(4, dtype="float64", margin=0.1, alpha=8.0)
            return loss.with_proxies(build_model()), loss

        reference, loss = model_and_loss()
        initial = reference.get_weights()
        assert len(initial) == len(build_model().get_weights()) + 1  # the proxies
        fit_once(reference, loss, images, labels)
        expected = weights_of(reference)
        model, loss = model_and_loss()
        model.set_weights(initial)
        fit_once(MultiStageModel(model, chunk_size=chunk_size), loss, images, labels)
    assert np.abs(expected[-1] - initial[-1]).max() > 1e-3  # the proxies moved
    assert_weights_equal(weights_of(model), expected)


class ChunkedForward(keras.Model):
    """The single-pass reference of ghost batch norm: ``inner`` applied to each chunk of
    the batch separately (so BatchNorm uses each chunk's statistics), concatenated."""

    def __init__(self, inner, chunk, **kwargs):
        super().__init__(**kwargs)
        self.inner, self.chunk = inner, chunk

    def call(self, x, training=None):
        n = x.shape[0]
        parts = [self.inner(x[i:i + self.chunk], training=training)
                 for i in range(0, n, self.chunk)]
        return keras.ops.concatenate(parts, axis=0)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [4, 5])
def test_batch_statistics_batch_norm_gives_the_exact_ghost_batch_norm_step(chunk_size):
    """BatchNorm with batch statistics (a network trained from scratch): stage 1 and
    stage 3 normalise the same chunk, so the multi-stage step equals the plain step of
    the network that normalises chunk by chunk, on every backend."""
    images, labels = make_float64_batch()

    def trainable(model):
        return [np.array(to_numpy(v), np.float64) for v in model.trainable_weights]

    with float64_policy():
        initial = build_exactness_model(output_dtype=None, freeze=False).get_weights()
        reference = build_exactness_model(output_dtype=None, freeze=False)
        reference.set_weights(initial)
        fit_once(ChunkedForward(reference, chunk_size), SoftNeighbourLoss(), images, labels)
        whole = build_exactness_model(output_dtype=None, freeze=False)
        whole.set_weights(initial)
        fit_once(whole, SoftNeighbourLoss(), images, labels)
        model = build_exactness_model(output_dtype=None, freeze=False)
        model.set_weights(initial)
        fit_once(MultiStageModel(model, chunk_size=chunk_size), SoftNeighbourLoss(),
                 images, labels)
    # Chunk statistics differ from whole-batch ones: confusing the two would fail here.
    assert max(np.abs(a - b).max() for a, b in zip(trainable(reference),
                                                   trainable(whole))) > 1e-4
    assert_weights_equal(trainable(model), trainable(reference))


def test_gem_p_frozen_bn_affine_and_regularised_head_all_move():
    images, labels = make_float64_batch()
    with float64_policy():
        model = build_model()
        before = {v.path: to_numpy(v).copy() for v in model.weights}
        wrapper = MultiStageModel(model, chunk_size=5)
        fit_once(wrapper, SoftNeighbourLoss(), images, labels)
    changed = {v.path for v in model.weights
               if np.abs(to_numpy(v) - before[v.path]).max() > 0}
    assert any(p.endswith("gem/p") for p in changed), changed
    assert any(p.endswith("bn/gamma") for p in changed), changed
    assert not any("moving" in p for p in changed), changed


def test_three_batches_with_a_schedule_count_batches_not_chunks():
    images, labels = make_float64_batch(3 * BATCH, seed=1)

    def optimizer():
        # lr 1 for the first update, 0.1 after: counting chunks would switch too early.
        return keras.optimizers.SGD(
            keras.optimizers.schedules.PiecewiseConstantDecay([1], [1.0, 0.1]))

    with float64_policy():
        initial = build_model().get_weights()
        expected, _ = plain_reference(initial, images, labels, optimizer=optimizer())
        model = build_model()
        model.set_weights(initial)
        wrapper = MultiStageModel(model, chunk_size=5)
        fit_once(wrapper, SoftNeighbourLoss(), images, labels, optimizer=optimizer())
    assert int(to_numpy(wrapper.optimizer.iterations)) == 3
    assert_weights_equal(weights_of(model), expected)


@pytest.mark.slow
def test_cross_batch_memory_step_equals_plain_step_with_that_memory():
    images, labels = make_float64_batch(2 * BATCH, seed=3)
    first, second = slice(0, BATCH), slice(BATCH, 2 * BATCH)
    size, weight = 8, 0.5
    with float64_policy():
        initial = build_model().get_weights()
        # By hand: step 1 is plain (empty memory); the memory then holds the last 8
        # stage-1 embeddings of batch 1, computed before the update and stored in
        # float32; step 2 adds weight * loss(batch 2 vs memory), memory side fixed.
        reference = build_model()
        reference.set_weights(initial)
        memory = to_numpy(reference(images[first], training=True))[-size:]
        memory = memory.astype(np.float32).astype(np.float64)
        fit_once(reference, SoftNeighbourLoss(), images[first], labels[first])
        fit_once(reference, WithFixedMemory(SoftNeighbourLoss(), labels[first][-size:],
                                            memory, weight), images[second], labels[second])
        next_memory = to_numpy(reference(images[second], training=True))  # after step 2

        model = build_model()
        model.set_weights(initial)
        wrapper = MultiStageModel(model, chunk_size=5, xbm_size=size, xbm_weight=weight)
        logs = fit_once(wrapper, SoftNeighbourLoss(), images, labels)
    assert_weights_equal(weights_of(model), weights_of(reference))
    assert logs["xbm_loss"][0] > 0.0
    np.testing.assert_array_equal(to_numpy(wrapper.memory.labels), labels[second][-size:])
    assert int(to_numpy(wrapper.memory.filled)) == size
    # The memory holds batch 2's stage-1 embeddings (before update 2), not these.
    stored = to_numpy(wrapper.memory.embeddings)
    assert np.abs(stored - next_memory[-size:]).max() > 1e-4


def test_stage_check_catches_a_nondeterministic_model():
    images, labels = make_float64_batch()
    with pytest.warns(NondeterministicModelWarning, match="Dropout"):
        MultiStageModel(build_model(dropout=0.5), chunk_size=4)
    wrapper = MultiStageModel(build_model(dropout=0.5), chunk_size=4,
                              on_nondeterministic="ignore", check_stages=True)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=SoftNeighbourLoss())
    if BACKEND == "jax":  # a compiled JAX step cannot raise: it reports the gap
        logs = wrapper.fit(images, labels, batch_size=BATCH, verbose=0).history
        assert logs["stage_max_abs_diff"][0] > 1e-3
    else:
        with pytest.raises(Exception, match="stage-3 embeddings differ"):
            wrapper.fit(images, labels, batch_size=BATCH, verbose=0)


def test_deterministic_model_passes_the_stage_check():
    images, labels = make_float64_batch()
    wrapper = MultiStageModel(build_model(), chunk_size=5, check_stages=True)
    logs = fit_once(wrapper, SoftNeighbourLoss(), images.astype("float32"), labels)
    assert logs["stage_max_abs_diff"][0] <= 1e-6


def test_save_and_load_keep_the_wrapper_and_its_memory(tmp_path):
    images, labels = make_float64_batch()
    images = images.astype("float32")
    model = build_model()
    wrapper = MultiStageModel(model, chunk_size=5, xbm_size=6)
    fit_once(wrapper, SoftNeighbourLoss(), images, labels)
    path = tmp_path / "multistage.keras"
    wrapper.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, MultiStageModel)
    assert (loaded.chunk_size, loaded.xbm_size) == (5, 6)
    assert isinstance(loaded.embedding_model.get_layer("bn"), models.FrozenBatchNormalization)
    np.testing.assert_allclose(to_numpy(loaded.predict(images, verbose=0)),
                               to_numpy(model.predict(images, verbose=0)), rtol=1e-6)
    np.testing.assert_array_equal(to_numpy(loaded.memory.embeddings),
                                  to_numpy(wrapper.memory.embeddings))


@pytest.mark.skipif(BACKEND != "jax", reason="the lax.scan chunk loop is JAX's")
def test_jax_scan_chunk_loop_equals_plain_step(monkeypatch):
    # On CPU the chunks are unrolled; accelerators use lax.scan: check that path here.
    from tfaploss.training import multistage_jax

    monkeypatch.setattr(multistage_jax, "SCAN_CHUNKS", True)
    images, labels = make_float64_batch()
    with float64_policy():
        initial = build_model().get_weights()
        expected, _ = plain_reference(initial, images, labels)
        model = build_model()
        model.set_weights(initial)
        fit_once(MultiStageModel(model, chunk_size=5), SoftNeighbourLoss(), images, labels)
    assert_weights_equal(weights_of(model), expected)


# --------------------------------------------------------------------------------------
# TensorFlow only
# --------------------------------------------------------------------------------------

LOSSES = {"ap": APLoss, "smooth_ap": SmoothAPLoss, "fastap": FastAPLoss}
BATCH_TF = 12


@functools.cache
def reference(loss_name):
    """Initial weights, weights after one plain step on the batch, and its logs."""
    initial = build_exactness_model().get_weights()
    images, labels = make_batch(BATCH_TF)
    updated, logs = plain_fit(initial, LOSSES[loss_name](), images, labels)
    return initial, updated, logs


def multistage_fit(initial, loss, images, labels, batch_size=BATCH_TF, jit_compile=False,
                   optimizer=None, run_eagerly=False, **kwargs):
    model = build_exactness_model()
    model.set_weights(initial)
    wrapper = MultiStageModel(model, **kwargs)
    wrapper.compile(optimizer=optimizer or keras.optimizers.SGD(1.0), loss=loss,
                    jit_compile=jit_compile, run_eagerly=run_eagerly)
    history = wrapper.fit(images, labels, batch_size=batch_size, epochs=1, shuffle=False,
                          verbose=0)
    return wrapper, model.get_weights(), history.history


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("chunk_size", [1, 3, BATCH_TF])
def test_multistage_step_equals_plain_step(loss_name, chunk_size):
    initial, expected, plain_logs = reference(loss_name)
    # The update must be large enough that a wrong gradient cannot pass.
    assert max_abs_diff(initial, expected) > 1e-3
    images, labels = make_batch(BATCH_TF)
    wrapper, updated, logs = multistage_fit(initial, LOSSES[loss_name](), images, labels,
                                            chunk_size=chunk_size, run_eagerly=True)
    assert_weights_close(updated, expected, rtol=1e-5, atol=1e-6)
    assert logs["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-5)
    assert int(wrapper.optimizer.iterations.numpy()) == 1


@pytest.mark.tensorflow
@pytest.mark.slow
def test_graph_mode_step_equals_plain_step_batch_not_divisible():
    initial, expected, plain_logs = reference("smooth_ap")
    images, labels = make_batch(BATCH_TF)
    # check_stages: the debug check measures stage-1 vs stage-3 embeddings (equal here).
    _, updated, logs = multistage_fit(initial, SmoothAPLoss(), images, labels, chunk_size=5,
                                      check_stages=True)
    assert_weights_close(updated, expected, rtol=1e-5, atol=1e-6)
    assert logs["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-5)
    assert logs["stage_max_abs_diff"][0] <= 1e-6


@pytest.mark.tensorflow
def test_learned_gem_p_and_frozen_bn_affine_are_updated():
    initial, expected, _ = reference("ap")
    model = build_exactness_model()
    names = [v.path for v in model.weights]
    changed = {n for n, a, b in zip(names, initial, expected) if np.max(np.abs(a - b)) > 0}
    assert any("gem" in n and n.endswith("/p") for n in changed), changed
    assert any("bn" in n and "gamma" in n for n in changed), changed
    assert not any("moving" in n for n in changed), changed


@pytest.mark.tensorflow
def test_single_pass_step_equals_plain_step():
    initial, expected, _ = reference("ap")
    images, labels = make_batch(BATCH_TF)
    _, updated, _ = multistage_fit(initial, APLoss(), images, labels, chunk_size=None,
                                   run_eagerly=True)
    assert_weights_close(updated, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.tensorflow
def test_jit_compile_with_batch_not_divisible_by_chunk():
    initial, expected, _ = reference("fastap")
    images, labels = make_batch(BATCH_TF)
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


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_mixed_precision_step_equals_plain_step(loss_name, mixed_float16):
    initial = build_exactness_model().get_weights()
    images, labels = make_batch(BATCH_TF)

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


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.parametrize("loss_name", ["ap", "fastap"])
def test_two_replicas_give_the_update_of_one_replica(loss_name, two_replica_strategy):
    initial, expected, plain_logs = reference(loss_name)
    images, labels = make_batch(BATCH_TF)
    with two_replica_strategy.scope():
        model = build_exactness_model()
        model.set_weights(initial)
        # Local batch 6, chunk 4: one full chunk and a tail of 2 on each replica.
        wrapper = MultiStageModel(model, chunk_size=4)
        wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=LOSSES[loss_name]())
    history = wrapper.fit(images, labels, batch_size=BATCH_TF, epochs=1, shuffle=False,
                          verbose=0)
    assert wrapper.distribute_strategy.num_replicas_in_sync == 2
    # Ranking each replica's half separately would give another update; the global
    # batch gives the single-replica one.
    assert_weights_close(model.get_weights(), expected, rtol=1e-5, atol=1e-6)
    assert history.history["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-5)


@pytest.mark.tensorflow
def test_replicas_need_a_batch_level_ranking_loss(two_replica_strategy):
    images, _ = make_batch(BATCH_TF)
    with two_replica_strategy.scope():
        wrapper = MultiStageModel(build_exactness_model(), chunk_size=4)
        wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    targets = np.zeros((BATCH_TF, 5), "float32")  # shaped for mse, so only our check fails
    with pytest.raises(ValueError, match="global batch"):
        wrapper.fit(images, targets, batch_size=BATCH_TF, verbose=0)


@pytest.mark.tensorflow
def test_iterations_and_learning_rate_schedule_count_batches():
    images, labels = make_batch(3 * BATCH_TF, seed=1)
    initial = build_exactness_model().get_weights()

    def optimizer():
        # lr 1 for the first update, 0.1 after: counting chunks would switch too early.
        schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1], [1.0, 0.1])
        return keras.optimizers.SGD(schedule)

    expected, _ = plain_fit(initial, APLoss(), images, labels, batch_size=BATCH_TF,
                            optimizer=optimizer())
    wrapper, updated, _ = multistage_fit(initial, APLoss(), images, labels,
                                         chunk_size=5, optimizer=optimizer(),
                                         run_eagerly=True)
    assert int(wrapper.optimizer.iterations.numpy()) == 3
    assert_weights_close(updated, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.tensorflow
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


@pytest.mark.tensorflow
@pytest.mark.parametrize("chunk_size", [4, 5])
def test_batch_statistics_batch_norm_is_exact_ghost_batch_norm(chunk_size):
    """BatchNorm with batch statistics: each stage normalises the same chunk, so the
    step is the exact gradient of the ghost-batch-norm network, with no warning."""
    images, labels = make_batch(BATCH_TF)
    initial = build_exactness_model(freeze=False).get_weights()
    expected, _ = ghost_reference_step(initial, images, labels, chunk_size)
    whole, _ = ghost_reference_step(initial, images, labels, BATCH_TF)
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
    history = wrapper.fit(images, labels, batch_size=BATCH_TF, epochs=1, shuffle=False,
                          verbose=0)
    assert history.history["stage_max_abs_diff"][0] <= 1e-6
    names = [w.path for w in model.weights]
    for name, got, want in zip(names, model.get_weights(), expected):
        if "moving" in name:
            continue  # moving statistics follow the chunks; they do not enter the step
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.tensorflow
@pytest.mark.long
def test_stage_check_catches_a_nondeterministic_model_on_tensorflow():
    images, labels = make_batch(BATCH_TF)
    model = build_exactness_model(dropout=0.5)
    wrapper = MultiStageModel(model, chunk_size=4, on_nondeterministic="ignore",
                              check_stages=True)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=APLoss())
    with pytest.raises(tf.errors.InvalidArgumentError, match="stage-3 embeddings differ"):
        wrapper.fit(images, labels, batch_size=BATCH_TF, verbose=0)


@pytest.mark.tensorflow
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


@pytest.mark.tensorflow
def test_predict_evaluate_and_saving_delegate(tmp_path):
    images, labels = make_batch(BATCH_TF)
    model = build_exactness_model()
    wrapper = MultiStageModel(model, chunk_size=5, xbm_size=6)
    wrapper.compile(optimizer=keras.optimizers.SGD(0.5), loss=APLoss(), run_eagerly=True)
    wrapper.fit(images, labels, batch_size=BATCH_TF, verbose=0)

    embeddings = model.predict(images, verbose=0)
    np.testing.assert_allclose(wrapper.predict(images, verbose=0), embeddings, rtol=1e-6)
    expected_loss = float(APLoss()(labels, embeddings)) + float(sum(model.losses))
    logs = wrapper.evaluate(images, labels, batch_size=BATCH_TF, verbose=0, return_dict=True)
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


@pytest.mark.tensorflow
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
