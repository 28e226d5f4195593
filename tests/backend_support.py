"""Helpers for the tests that run on every Keras backend (this module holds no tests).

Keras fixes its backend at import, so these tests run once per process:
``make test`` runs them on TensorFlow (with everything else) and again with
``KERAS_BACKEND=jax`` and ``make test-torch`` with ``KERAS_BACKEND=torch``; ``make test``
runs all three.
Nothing here imports TensorFlow.
"""

import contextlib

import keras
import numpy as np
from keras import ops

BACKEND = keras.backend.backend()

if BACKEND == "jax":
    # float64 exactness tests need 64-bit arrays; Keras passes explicit dtypes
    # everywhere else, so this changes nothing for float32 code.
    import jax

    jax.config.update("jax_enable_x64", True)


@contextlib.contextmanager
def float64_policy():
    """Build and train in float64 inside the block (weights, activations, losses)."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


@keras.saving.register_keras_serializable(package="tfaploss_tests")
class SoftNeighbourLoss(keras.losses.Loss):
    """Soft nearest-neighbour (NCA-style) ranking loss, written with keras.ops only.

    Per query i: ``log sum_{j in C(i)} exp(s_ij / t) - log sum_{j in P(i)} exp(s_ij / t)``
    with ``s = q . d`` the scores, ``C(i)`` the candidates (every other item) and
    ``P(i)`` the candidates sharing i's label; mean over queries. Smooth and
    batch-level (every row's gradient depends on the whole batch), like the AP losses,
    and portable to every backend. ``query_database_loss`` has the signature
    ``MultiStageModel``'s cross-batch memory calls.
    """

    def __init__(self, temperature=0.2, name="soft_neighbour", **kwargs):
        super().__init__(name=name, **kwargs)
        self.temperature = float(temperature)

    def query_database_loss(self, query_labels, query_embeddings, db_labels, db_embeddings,
                            candidates=None):
        q = query_embeddings
        d = ops.cast(db_embeddings, q.dtype)
        scores = ops.matmul(q, ops.transpose(d)) / self.temperature
        same = ops.equal(ops.cast(ops.reshape(query_labels, (-1, 1)), "int32"),
                         ops.cast(ops.reshape(db_labels, (1, -1)), "int32"))
        if candidates is None:
            candidates = ops.ones_like(same)
        positives = ops.logical_and(same, candidates)
        floor = ops.cast(-1e9, scores.dtype)
        lse_all = ops.logsumexp(ops.where(candidates, scores, floor), axis=1)
        lse_pos = ops.logsumexp(ops.where(positives, scores, floor), axis=1)
        return ops.mean(lse_all - lse_pos)

    def call(self, y_true, y_pred):
        n = ops.shape(y_pred)[0]
        others = ops.logical_not(ops.eye(n, dtype="bool"))
        # One value per batch: Keras's mean reduction keeps it unchanged.
        value = self.query_database_loss(y_true, y_pred, y_true, y_pred, candidates=others)
        return ops.reshape(value, (1,))

    def get_config(self):
        return {**super().get_config(), "temperature": self.temperature}


class WithFixedMemory(keras.losses.Loss):
    """``base(y, E) + weight * base.query_database_loss(y, E, memory_labels, memory)``.

    The plain single-pass reference for a step with cross-batch memory.
    """

    def __init__(self, base, memory_labels, memory, weight, **kwargs):
        super().__init__(name="with_fixed_memory", **kwargs)
        self.base, self.weight = base, float(weight)
        self.memory_labels, self.memory = memory_labels, memory

    def call(self, y_true, y_pred):
        memory_term = self.base.query_database_loss(
            y_true, y_pred, ops.convert_to_tensor(self.memory_labels),
            ops.convert_to_tensor(self.memory, dtype=y_pred.dtype))
        return self.base.call(y_true, y_pred) + self.weight * memory_term
