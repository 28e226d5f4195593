"""The batch layout of the data-parallel tests (this module holds no tests).

Every backend's distribution test trains on the same global batch: ``shards`` shards
(devices, replicas, ranks or workers) of ``classes`` rows each, shard ``s`` holding
rows ``classes * s .. classes * s + classes - 1``, one item of every class. No shard
holds a positive pair, so a loss that ranked each shard alone would be 0 and train
nothing; ranking the global batch gives the one-device loss. Nothing here imports a
backend.
"""

CLASSES, DIM, FEATURES = 16, 6, 8


def layout(shards: int, seed: int = 0):
    """``(x, y)``: ``(shards * CLASSES, FEATURES)`` float32 inputs and int32 labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(shards * CLASSES, FEATURES)).astype("float32")
    y = np.tile(np.arange(CLASSES), shards).astype("int32")
    return x, y


def dense_model(seed: int = 1):
    """The seeded two-layer embedding model (the same weights in every process)."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(12, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(DIM)(hidden))
