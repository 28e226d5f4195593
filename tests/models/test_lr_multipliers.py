"""Per-variable learning-rate multipliers (models.lr_multipliers)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfaploss import models

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only

K = 4.0
LR = 0.05


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return models.build_embedding_model("small_cnn", pooling="gem", embedding_dim=8,
                                        freeze_bn=True, input_shape=(8, 8, 3),
                                        backbone_kwargs={"widths": (4, 8)})


def _data():
    rng = np.random.default_rng(0)
    return rng.uniform(0, 255, (4, 8, 8, 3)).astype("float32")


def _loss(embeddings):
    # Any differentiable function of the embeddings that depends on all of them.
    return tf.reduce_sum(embeddings * tf.roll(embeddings, 1, axis=0)) + tf.reduce_sum(
        embeddings[:, 0])


def _is_head(v):
    return v.path.startswith("head/")


def test_sgd_head_update_is_k_times_the_backbone_rule_via_apply():
    model = _model()
    x = _data()
    with tf.GradientTape() as tape:
        loss = _loss(model(x, training=True))
    variables = model.trainable_variables
    grads = tape.gradient(loss, variables)
    before = [v.numpy().copy() for v in variables]
    opt = models.LRMultiplierOptimizer(keras.optimizers.SGD(LR), models.head_multipliers(K))
    opt.apply(grads, variables)
    heads = 0
    for v, g, b in zip(variables, grads, before):
        factor = K if _is_head(v) else 1.0
        heads += _is_head(v)
        assert opt.multiplier_for(v) == factor
        np.testing.assert_allclose(v.numpy() - b, -LR * factor * g.numpy(), rtol=1e-5,
                                   atol=5e-7)
    assert heads == 2  # kernel and bias
    assert int(opt.iterations.numpy()) == 1


def _fit_deltas(optimizer, seed=0):
    model = _model(seed)
    x = _data()
    before = {v.path: v.numpy().copy() for v in model.trainable_variables}
    model.compile(optimizer=optimizer, loss=lambda y_true, y_pred: _loss(y_pred))
    model.fit(x, np.zeros(4, "float32"), batch_size=4, epochs=1, verbose=0, shuffle=False)
    return {v.path: v.numpy() - before[v.path] for v in model.trainable_variables}


@pytest.mark.slow
def test_compiled_fit_with_adam_scales_the_learning_rate_not_the_gradient():
    # Adam is invariant to a gradient's scale: a k-times larger head step proves that
    # the learning rate is scaled.
    plain = _fit_deltas(keras.optimizers.Adam(1e-3))
    scaled = _fit_deltas(models.LRMultiplierOptimizer(keras.optimizers.Adam(1e-3),
                                                      models.head_multipliers(K)))
    assert set(plain) == set(scaled)
    for path, delta in plain.items():
        factor = K if path.startswith("head/") else 1.0
        assert np.abs(delta).max() > 0
        # Same gradients (same model, data and seed); Adam's first step is linear in
        # the learning rate. atol: a few float32 ulps of the weights.
        np.testing.assert_allclose(scaled[path], factor * delta, rtol=1e-4, atol=5e-7)


def test_include_gem_and_config_round_trip():
    opt = models.LRMultiplierOptimizer(keras.optimizers.Adam(1e-4),
                                       models.head_multipliers(10.0, include_gem=True))
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(clone, models.LRMultiplierOptimizer)
    assert clone.multipliers == opt.multipliers
    assert isinstance(clone.inner_optimizer, keras.optimizers.Adam)
    np.testing.assert_allclose(float(clone.learning_rate.numpy()), 1e-4)
    model = _model()
    by_path = {v.path: clone.multiplier_for(v) for v in model.trainable_variables}
    assert by_path["gem/p"] == 10.0 and by_path["head/kernel"] == 10.0
    assert by_path["stage1_block1_conv/kernel"] == 1.0
    with pytest.raises(ValueError, match="-1"):
        models.LRMultiplierOptimizer(keras.optimizers.SGD(), {"head": -1})


def test_inside_loss_scale_optimizer():
    model = _model()
    x = _data()
    with tf.GradientTape() as tape:
        loss = _loss(model(x, training=True))
    variables = model.trainable_variables
    grads = tape.gradient(loss, variables)
    before = [v.numpy().copy() for v in variables]
    opt = keras.optimizers.LossScaleOptimizer(
        models.LRMultiplierOptimizer(keras.optimizers.SGD(LR), models.head_multipliers(K)))
    # LossScaleOptimizer divides the gradients by its scale before the inner update.
    opt.apply([g * opt.initial_scale for g in grads], variables)
    for v, g, b in zip(variables, grads, before):
        factor = K if _is_head(v) else 1.0
        np.testing.assert_allclose(v.numpy() - b, -LR * factor * g.numpy(), rtol=1e-5,
                                   atol=5e-7)


def _per_sample_loss(y_true, y_pred):
    return y_pred[:, 0] + tf.reduce_sum(y_pred[:, 1:] ** 2, axis=1)


@pytest.mark.slow
def test_mirrored_strategy_two_replicas(two_replica_strategy):
    strategy = two_replica_strategy
    x = _data()
    deltas = []
    for multipliers in (None, models.head_multipliers(K)):
        with strategy.scope():
            model = _model()
            opt = models.LRMultiplierOptimizer(keras.optimizers.SGD(LR), multipliers)
            model.compile(optimizer=opt, loss=_per_sample_loss)
        before = {v.path: v.numpy().copy() for v in model.trainable_variables}
        model.fit(x, np.zeros(4, "float32"), batch_size=4, epochs=1, verbose=0,
                  shuffle=False)
        deltas.append({v.path: v.numpy() - before[v.path] for v in model.trainable_variables})
    plain, scaled = deltas
    for path, delta in plain.items():
        factor = K if path.startswith("head/") else 1.0
        assert np.abs(delta).max() > 0
        np.testing.assert_allclose(scaled[path], factor * delta, rtol=1e-4, atol=5e-7)
