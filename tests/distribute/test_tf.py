"""Ranking losses under ``tf.distribute``: a plain ``compile``/``fit`` ranks the GLOBAL batch.

The batch (64 items, 16 classes) is laid out so that each of 4 replicas' shards holds
one item of every class: no shard holds a positive pair, so ranking each shard on its
own gives loss 0 and no update. With the global batch gathered, 4 replicas give the
loss and the weights of one device, step by step, for a plain Keras model and for
MultiStageModel, with and without ``sample_weight``. Unsupported contexts raise.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support.shard_layout import CLASSES, DIM, dense_model, layout
from tfaploss.losses import APLoss, HAPLoss, ProxyAnchorLoss, SmoothAPLoss, XBMLoss
from tfaploss.training import MultiStageModel

REPLICAS = 4
BATCH = REPLICAS * CLASSES
STEPS = 3

# tests/conftest.py configures 2 logical CPUs; 4 are needed here. Possible only while
# TensorFlow has not initialised its devices (the test below says so otherwise).
try:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
except RuntimeError:
    pass

LOSSES = {"ap": APLoss, "smooth_ap": SmoothAPLoss}


class _MirroredStrategyOwnKeys(tf.distribute.MirroredStrategy):
    """A MirroredStrategy whose collectives use group keys of their own.

    Every MirroredStrategy numbers its collective groups from 1, and the runtime
    refuses one group key for groups of two sizes, so this 4-replica strategy would
    break the 2-replica one of tests/conftest.py in the same process. TensorFlow's
    own tests offset the keys with this class attribute.
    """

    _collective_key_base = 1000


@pytest.fixture(scope="module")
def strategy():
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(devices) < REPLICAS:
        pytest.fail(f"{REPLICAS} logical CPU devices needed, found {len(devices)}: TensorFlow "
                    "initialised its devices before this module was imported")
    return _MirroredStrategyOwnKeys(devices[:REPLICAS])


def _data(seed=0):
    # Replica r gets rows 16r..16r+15 (Keras splits the global batch in order).
    return layout(REPLICAS, seed)


_model = dense_model


def _fit(loss, multistage=False, strategy=None, sample_weight=None):
    """Per-step losses and final weights of STEPS SGD steps on the one batch (a sum
    over the batch takes a step as large as a mean's)."""
    learning_rate = 0.5 / BATCH if loss.reduction == "sum" else 0.5
    x, y = _data()
    with strategy.scope() if strategy is not None else _nothing():
        model = _model()
        trainer = MultiStageModel(model, chunk_size=8) if multistage else model
        trainer.compile(optimizer=keras.optimizers.SGD(learning_rate), loss=loss)
    history = trainer.fit(x, y, sample_weight=sample_weight, batch_size=BATCH,
                          epochs=STEPS, shuffle=False, verbose=0)
    if strategy is not None:
        assert trainer.distribute_strategy.num_replicas_in_sync == REPLICAS
    return np.array(history.history["loss"]), model.get_weights()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_no_shard_holds_a_positive_pair():
    x, y = _data()
    embeddings = _model()(x)
    shards = [float(APLoss()(y[r * CLASSES:(r + 1) * CLASSES],
                             embeddings[r * CLASSES:(r + 1) * CLASSES]))
              for r in range(REPLICAS)]
    assert shards == [0.0] * REPLICAS  # what per-replica ranking would give
    assert float(APLoss()(y, embeddings)) > 0.1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("multistage", [False, True], ids=["plain", "multistage"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_replicas_give_the_steps_of_one_device(loss_name, multistage, strategy):
    expected_losses, expected = _fit(LOSSES[loss_name]())
    losses, weights = _fit(LOSSES[loss_name](), multistage, strategy)
    assert np.all(expected_losses > 0.05)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    initial = _model().get_weights()
    assert max(np.abs(e - i).max() for e, i in zip(expected, initial)) > 1e-3  # it trains
    for w, e in zip(weights, expected):
        np.testing.assert_allclose(w, e, rtol=1e-5, atol=1e-6)


def _fit_proxy_anchor(multistage=False, strategy=None, sample_weight=None):
    """As ``_fit`` with ProxyAnchorLoss, its proxies (a layer of the model) made in the
    strategy's scope: per-step losses and final weights, the proxies last."""
    x, y = _data()
    with strategy.scope() if strategy is not None else _nothing():
        loss = ProxyAnchorLoss(CLASSES, alpha=8.0)
        model = loss.with_proxies(_model())
        model.get_layer("class_proxies").set_proxies(
            np.random.default_rng(5).normal(size=(CLASSES, DIM)))
        trainer = MultiStageModel(model, chunk_size=8) if multistage else model
        trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    history = trainer.fit(x, y, sample_weight=sample_weight, batch_size=BATCH,
                          epochs=STEPS, shuffle=False, verbose=0)
    return np.array(history.history["loss"]), model.get_weights()


@pytest.mark.slow
@pytest.mark.parametrize("multistage", [False, True], ids=["plain", "multistage"])
def test_replicas_give_the_proxy_anchor_steps_of_one_device(multistage, strategy):
    """Every replica scores the global batch against the same (mirrored) proxies, and
    the proxies take the one-device step."""
    weight = np.linspace(0.2, 2.0, BATCH).astype("float32")
    expected_losses, expected = _fit_proxy_anchor(sample_weight=weight)
    losses, weights = _fit_proxy_anchor(multistage, strategy, sample_weight=weight)
    assert np.abs(expected[-1] - np.random.default_rng(5).normal(size=(CLASSES, DIM))
                  ).max() > 1e-3  # the proxies trained
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    for w, e in zip(weights, expected):
        np.testing.assert_allclose(w, e, rtol=1e-5, atol=1e-6)


def _fit_xbm(strategy=None):
    """Per-step losses, final weights (the memory's included), the loss and the model
    after STEPS SGD steps with an XBMLoss whose memory (96 slots) wraps on step 2."""
    x, y = _data()
    with strategy.scope() if strategy is not None else _nothing():
        xbm = XBMLoss(APLoss(), size=96, weight=0.5)
        model = _model()
        model = keras.Model(model.input, xbm.memory(model.output))
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=xbm)
    history = model.fit(x, y, batch_size=BATCH, epochs=STEPS, shuffle=False, verbose=0)
    return np.array(history.history["loss"]), model.get_weights(), xbm, model


@pytest.mark.slow
def test_replicas_give_the_xbm_steps_of_one_device(strategy):
    """Each replica ranks the global batch against the memory and enqueues it: the
    losses, the weights and the memory after each step are those of one device."""
    x, y = _data()
    expected_losses, expected, xbm, _ = _fit_xbm()
    losses, weights, replicated, model = _fit_xbm(strategy)
    # Step 1 ranks against an empty memory: the plain loss.
    assert expected_losses[0] == pytest.approx(float(APLoss()(y, _model()(x))), rel=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert (int(xbm.memory.filled.numpy()), int(xbm.memory.pointer.numpy())) == (96, 0)
    np.testing.assert_array_equal(replicated.memory.labels.numpy(), xbm.memory.labels.numpy())
    for w, e in zip(weights, expected):
        np.testing.assert_allclose(w, e, rtol=1e-5, atol=1e-6)
    # The filled memory counts in the loss.
    embeddings = model(x, training=False)
    assert abs(float(replicated(y, embeddings)) - float(APLoss()(y, embeddings))) > 1e-3


# The mean reductions with weights: test_unequal_shards_... (loss and gradient).
@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["sum"])
def test_replicas_honour_sample_weight(reduction, strategy):
    weight = np.linspace(0.2, 2.0, BATCH).astype("float32")
    expected_losses, expected = _fit(SmoothAPLoss(reduction=reduction),
                                     sample_weight=weight)
    unweighted_losses, _ = _fit(SmoothAPLoss(reduction=reduction))
    assert abs(unweighted_losses[0] - expected_losses[0]) > 1e-3  # the weights count
    losses, weights = _fit(SmoothAPLoss(reduction=reduction), strategy=strategy,
                           sample_weight=weight)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    for w, e in zip(weights, expected):
        np.testing.assert_allclose(w, e, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight",
                                       "sum", "none"])
def test_unequal_shards_give_the_one_device_loss_and_gradient(reduction, strategy):
    """strategy.run on shards of 17, 16, 16 and 15 rows; the replicas' losses summed
    (concatenated for "none") and their embedding gradients concatenated."""
    _, y = _data(seed=3)
    embeddings = np.random.default_rng(4).normal(size=(BATCH, DIM)).astype("float32")
    weight = np.linspace(0.5, 1.5, BATCH).astype("float32")
    bounds = [0, 17, 33, 49, BATCH]
    loss = APLoss(reduction=reduction)

    def value_and_grad(labels, e, w):
        e = tf.convert_to_tensor(e)
        with tf.GradientTape() as tape:
            tape.watch(e)
            value = loss(labels, e, sample_weight=w)
        return value, tape.gradient(value, e)

    expected_value, expected_grad = value_and_grad(y, embeddings, weight)

    def shard(ctx):
        a, b = bounds[ctx.replica_id_in_sync_group], bounds[ctx.replica_id_in_sync_group + 1]
        return y[a:b], embeddings[a:b], weight[a:b]

    shards = strategy.experimental_distribute_values_from_function(shard)
    values, grads = strategy.run(tf.function(value_and_grad), args=shards)
    values = [v.numpy() for v in strategy.experimental_local_results(values)]
    grads = np.concatenate([g.numpy() for g in strategy.experimental_local_results(grads)])
    if reduction == "none":
        assert [len(v) for v in values] == [17, 16, 16, 15]
        np.testing.assert_allclose(np.concatenate(values), expected_value, rtol=1e-5,
                                   atol=1e-7)
    else:
        assert float(expected_value) > 0.1
        np.testing.assert_allclose(sum(values), expected_value, rtol=1e-5)
    assert np.abs(expected_grad).max() > 1e-3
    np.testing.assert_allclose(grads, expected_grad, rtol=1e-4, atol=1e-6)


def test_cross_replica_call_raises(strategy):
    x, y = _data()
    message = "cross-replica context of _MirroredStrategyOwnKeys \\(4 replicas"
    with strategy.scope(), pytest.raises(RuntimeError, match=message):
        APLoss()(y, x[:, :DIM])


def test_unsupported_strategy_raises():
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:REPLICAS]
    central = tf.distribute.experimental.CentralStorageStrategy(devices, devices[0])
    x, y = _data()
    with pytest.raises(ValueError, match="received CentralStorageStrategy with 4 replicas"):
        central.run(lambda: APLoss()(y, x[:, :DIM]))


def test_a_loss_with_its_own_call_refuses_to_rank_per_replica(strategy):
    x, y = _data()
    labels = np.stack([y, y // 4], axis=1)  # two-level hierarchy
    with pytest.raises(ValueError, match="HAPLoss: its own __call__.*MultiStageModel"):
        strategy.run(lambda: HAPLoss()(labels, x[:, :DIM]))
