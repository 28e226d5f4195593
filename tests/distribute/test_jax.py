"""Ranking losses under ``keras.distribution.DataParallel`` on JAX: the GLOBAL batch.

Keras's JAX trainer hands the train step the global batch, sharded over the devices,
and XLA inserts the communication, so a ranking loss ranks the whole batch with no
gather of ours. These tests pin that on 4 CPU devices with the layout of
tests/distribute/test_tf.py: 64 items of 16 classes, each device's shard holding one
item of every class, so that a per-shard ranking would give loss 0. Four devices give
the loss per step and the weights after 3 steps of one device, for a plain
``compile``/``fit`` and for ``MultiStageModel``, whose ``chunk_size`` counts rows per
device (a chunk takes ``chunk_size`` rows of every device's shard).

Run in a process of its own with 4 host devices (the Makefile's test-jax does):
``KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest
--noconftest tests/distribute/test_jax.py``.
"""

import contextlib

import keras
import numpy as np
import pytest

if keras.backend.backend() != "jax":
    pytest.skip("DataParallel on the JAX backend", allow_module_level=True)

import jax

from tests.support.shard_layout import CLASSES, DIM, FEATURES, layout
from tfaploss.losses import APLoss, ProxyAnchorLoss, SmoothAPLoss, XBMLoss
from tfaploss.training import (
    MultiStageModel,
    multistage_jax,
)

DEVICES = 4
BATCH = DEVICES * CLASSES
STEPS = 3

if len(jax.devices()) < DEVICES:
    pytest.skip(f"needs {DEVICES} JAX devices (XLA_FLAGS="
                f"--xla_force_host_platform_device_count={DEVICES}), found "
                f"{len(jax.devices())}", allow_module_level=True)


def _data(seed=0):
    # device d holds rows 16d..16d+15 of the global batch: one item of every class
    return layout(DEVICES, seed)


def _model():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    outputs = keras.layers.UnitNormalization()(keras.layers.Dense(DIM)(hidden))
    return keras.Model(inputs, outputs)


def _train(loss_cls, distributed, chunk_size=None, multistage=False):
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices()[:DEVICES])
        if distributed else None)
    try:
        model = _model()
        if multistage:
            model = MultiStageModel(model, chunk_size=chunk_size)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss_cls())
        x, y = _data()
        losses = [float(model.train_on_batch(x, y)) for _ in range(STEPS)]
        weights = [np.asarray(w) for w in model.get_weights()]
    finally:
        keras.distribution.set_distribution(None)
    return losses, weights


@pytest.fixture(scope="module")
def one_device():
    return {name: _train(cls, distributed=False)
            for name, cls in (("ap", APLoss), ("smooth_ap", SmoothAPLoss))}


def test_no_shard_holds_a_positive_pair():
    x, y = _data()
    emb = keras.ops.convert_to_numpy(_model()(x))
    shards = [APLoss()(y[16 * d:16 * d + 16], emb[16 * d:16 * d + 16])
              for d in range(DEVICES)]
    assert all(float(s) == 0.0 for s in shards)
    assert float(APLoss()(y, emb)) > 0.1


@pytest.mark.parametrize("loss_name,step", [
    ("ap", "plain"), ("smooth_ap", "plain"),
    ("ap", "multistage_chunk5"),          # 16 rows per device: 3 chunks of 5 and a tail
    ("smooth_ap", "multistage_chunk8"),   # 2 chunks of 8 per device, no tail
])
def test_devices_give_the_steps_of_one_device(one_device, loss_name, step):
    loss_cls = {"ap": APLoss, "smooth_ap": SmoothAPLoss}[loss_name]
    chunk = {"plain": None, "multistage_chunk8": 8, "multistage_chunk5": 5}[step]
    losses, weights = _train(loss_cls, distributed=True, chunk_size=chunk,
                             multistage=chunk is not None)
    ref_losses, ref_weights = one_device[loss_name]
    assert min(ref_losses) > 0.05                     # per-shard ranking would give 0
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    moved = max(float(np.abs(w - w0).max())
                for w, w0 in zip(ref_weights, _model().get_weights()))
    assert moved > 1e-3
    # float32 sums in another order (per device, per chunk): ~1e-6 after 3 steps
    for w, ref in zip(weights, ref_weights):
        np.testing.assert_allclose(w, ref, rtol=1e-4, atol=1e-5)


@contextlib.contextmanager
def _distribution(distributed):
    """DataParallel over DEVICES devices inside the block (none when not ``distributed``)."""
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices()[:DEVICES])
        if distributed else None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(None)


def _train_proxy_anchor(distributed, chunk_size=None):
    """Per-step losses and weights (the proxies last) of ProxyAnchorLoss, its proxies a
    layer of the model, replicated on every device under DataParallel."""
    with _distribution(distributed):
        loss = ProxyAnchorLoss(CLASSES, alpha=8.0)
        model = loss.with_proxies(_model())
        model.get_layer("class_proxies").set_proxies(
            np.random.default_rng(5).normal(size=(CLASSES, DIM)))
        trainer = MultiStageModel(model, chunk_size=chunk_size) if chunk_size else model
        trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
        x, y = _data()
        losses = [float(trainer.train_on_batch(x, y)) for _ in range(STEPS)]
        weights = [np.asarray(w) for w in model.get_weights()]
    return losses, weights


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_devices_give_the_proxy_anchor_steps_of_one_device(chunk_size):
    ref_losses, ref_weights = _train_proxy_anchor(distributed=False)
    losses, weights = _train_proxy_anchor(distributed=True, chunk_size=chunk_size)
    initial = np.random.default_rng(5).normal(size=(CLASSES, DIM))
    assert np.abs(ref_weights[-1] - initial).max() > 1e-3  # the proxies trained
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for w, ref in zip(weights, ref_weights):
        np.testing.assert_allclose(w, ref, rtol=1e-4, atol=1e-5)


def _fit_xbm(distributed):
    """Per-step losses, weights and memory labels of an XBMLoss (96 slots: the memory
    wraps on step 2) after STEPS SGD steps in a plain fit."""
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices()[:DEVICES])
        if distributed else None)
    try:
        xbm = XBMLoss(APLoss(), size=96, weight=0.5)
        net = _model()
        model = keras.Model(net.input, xbm.memory(net.output))
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=xbm)
        x, y = _data()
        history = model.fit(x, y, batch_size=BATCH, epochs=STEPS, shuffle=False, verbose=0)
        labels = np.asarray(xbm.memory.labels.value)
        weights = [np.asarray(w) for w in model.get_weights()]
    finally:
        keras.distribution.set_distribution(None)
    return history.history["loss"], weights, labels


def test_devices_give_the_xbm_steps_of_one_device():
    losses, weights, labels = _fit_xbm(distributed=True)
    ref_losses, ref_weights, ref_labels = _fit_xbm(distributed=False)
    _, y = _data()
    # the memory holds the last 96 rows seen: batch 2's last 32, then batch 3
    np.testing.assert_array_equal(ref_labels, np.concatenate([y, y[32:]]))
    np.testing.assert_array_equal(labels, ref_labels)
    assert ref_losses[1] != pytest.approx(ref_losses[0], rel=1e-3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for w, ref in zip(weights, ref_weights):
        np.testing.assert_allclose(w, ref, rtol=1e-4, atol=1e-5)


def test_a_chunk_takes_chunk_size_rows_of_every_device():
    rows = np.arange(BATCH)
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices()[:DEVICES]))
    try:
        shards, n_full, tail = multistage_jax.chunk_plan(BATCH, 5)
        full, tail_rows = jax.jit(lambda t: multistage_jax._split(t, n_full, 5))(rows)
        merged = jax.jit(lambda f, t: multistage_jax._merge(f, t, n_full, 5))(full, tail_rows)
        full_spec = full.sharding.spec
        with pytest.raises(ValueError, match="does not split evenly over the 4 devices"):
            multistage_jax.chunk_plan(BATCH + 2, 5)
    finally:
        keras.distribution.set_distribution(None)
    assert (shards, n_full, tail) == (4, 3, 1)        # 16 rows per device: 3 x 5 + 1
    full, tail_rows = np.asarray(full), np.asarray(tail_rows)
    # chunk i: rows 16d + 5i .. 16d + 5i + 4 of every device d, devices in order
    expected = [np.concatenate([np.arange(16 * d + 5 * i, 16 * d + 5 * i + 5)
                                for d in range(DEVICES)]) for i in range(3)]
    np.testing.assert_array_equal(full, np.stack(expected))
    np.testing.assert_array_equal(tail_rows, [15, 31, 47, 63])
    np.testing.assert_array_equal(np.asarray(merged), rows)
    assert full_spec[1] is not None                   # the chunk's rows stay sharded


def _bn_model():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(16)(inputs))
    hidden = keras.layers.Activation("tanh")(hidden)
    outputs = keras.layers.UnitNormalization()(keras.layers.Dense(DIM)(hidden))
    return keras.Model(inputs, outputs)


def _train_bn(distributed, chunk_size, order=None):
    x, y = _data()
    if order is not None:
        x, y = x[order], y[order]
    with _distribution(distributed):
        model = MultiStageModel(_bn_model(), chunk_size=chunk_size)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=APLoss())
        losses = [float(model.train_on_batch(x, y)) for _ in range(STEPS)]
        weights = [np.asarray(w) for w in model.get_weights()]
    return losses, weights


def test_batch_statistics_normalise_a_chunk_of_every_device_together():
    # With BatchNorm on batch statistics each chunk is normalised on its own (ghost
    # batch norm), and under DataParallel a chunk is chunk_size rows of every device:
    # one group of chunk_size x D images. So 4 devices with chunks of 4 equal one device
    # with chunks of 16 holding the same rows, not one device with chunks of 4.
    per_device = BATCH // DEVICES
    regrouped = np.concatenate([np.arange(per_device * d + 4 * i, per_device * d + 4 * i + 4)
                                for i in range(per_device // 4) for d in range(DEVICES)])
    losses, weights = _train_bn(True, 4)
    same_groups = _train_bn(False, 4 * DEVICES, regrouped)
    np.testing.assert_allclose(losses, same_groups[0], rtol=1e-5, atol=1e-6)
    for w, ref in zip(weights, same_groups[1]):
        np.testing.assert_allclose(w, ref, rtol=1e-4, atol=1e-5)
    smaller_groups = _train_bn(False, 4)
    assert abs(losses[0] - smaller_groups[0][0]) > 1e-4
