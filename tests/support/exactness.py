"""The exactness model and batches that the multi-stage, XBM and loss tests share.

The exactness model: a small CNN with BatchNorm frozen, GeM pooling with
trainable p, a Dense head (L2 weight-regularised) and L2 normalisation, on 8x8 images.
"""

import keras
import numpy as np

from tfaploss.models.batch_norm import freeze_batch_norm
from tfaploss.models.gem import GeM

IMAGE_SHAPE = (8, 8, 3)
EMBEDDING_DIM = 5


def build_exactness_model(seed=0, dropout=0.0, freeze=True, output_dtype="float32"):
    """Small CNN -> BN -> ReLU -> CNN -> GeM(p trainable) -> Dense -> L2; random BN stats.

    ``output_dtype=None`` keeps the global dtype policy's (float64 in the exactness
    tests of every backend, tests/training/test_multistage.py).
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(IMAGE_SHAPE)
    x = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(6, 3, padding="same")(x)
    if dropout:
        x = keras.layers.Dropout(dropout)(x)
    x = GeM(name="gem")(x)
    # A weight regulariser: its gradient bypasses G = dL/dE and must still be applied.
    x = keras.layers.Dense(EMBEDDING_DIM, kernel_regularizer=keras.regularizers.L2(0.05))(x)
    # Float32 output: under mixed_float16 the loss then sees float32 embeddings.
    outputs = keras.layers.UnitNormalization(dtype=output_dtype)(x)
    model = keras.Model(inputs, outputs, name="exactness_model")
    bn = model.get_layer("bn")
    rng = np.random.default_rng(seed)
    bn.moving_mean.assign(rng.normal(size=4).astype("float32") * 0.3)
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, size=4).astype("float32"))
    if freeze:
        freeze_batch_norm(model)
    return model


def make_batch(n=12, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(n,) + IMAGE_SHAPE).astype("float32")
    labels = (np.arange(n) % classes).astype("int32")
    return images, labels


def max_abs_diff(weights_a, weights_b):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(weights_a, weights_b))


def assert_weights_close(actual, expected, rtol, atol):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def plain_fit(weights, loss, images, labels, batch_size=None, seed=0, optimizer=None,
              run_eagerly=True):
    """Ordinary single-pass ``keras.Model`` training from ``weights``; returns weights, logs.

    Eager by default: tracing costs more than the step on these tiny inputs.
    """
    model = build_exactness_model(seed)
    model.set_weights(weights)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(1.0), loss=loss,
                  run_eagerly=run_eagerly)
    history = model.fit(images, labels, batch_size=batch_size or len(images), epochs=1,
                        shuffle=False, verbose=0)
    return model.get_weights(), history.history
