"""Value and gradient of a loss, and float64 models, on whichever Keras backend runs.

Keras fixes its backend at import, so the tests that use these helpers run once per
backend process (see the Makefile's test-jax and test-torch). Nothing here imports
TensorFlow; each backend's own import stays inside the function that needs it.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import keras
import numpy as np
from keras import ops

BACKEND = keras.backend.backend()
if BACKEND == "jax":
    import jax

    jax.config.update("jax_enable_x64", True)  # the float64 goldens need it

# Execution modes worth checking on each backend.
MODES = {"tensorflow": ("eager", "graph", "xla"), "jax": ("eager", "jit"),
         "torch": ("eager",)}[BACKEND]
GOLDENS_DIR = Path(__file__).resolve().parents[1] / "goldens"

# Keras 3.15 promotes float64 to float32 in the PyTorch backend's ops (its type lattice
# maps 64-bit results to 32-bit outside TensorFlow; JAX with x64 keeps float64). There
# the float64 goldens are checked in float32 with the float32 tolerances of
# tests/goldens/README.md.
FLOAT64 = BACKEND != "torch"
DTYPE = "float64" if FLOAT64 else "float32"
LOSS_RTOL = 1e-9 if FLOAT64 else 1e-5
GRAD_RTOL = 1e-12 if FLOAT64 else 1e-5  # of max |G|


def load_golden(name):
    with open(GOLDENS_DIR / name, encoding="utf-8") as f:
        return json.load(f)


def value_and_grad(fn, x, mode="eager"):
    """``fn(x)`` and its gradient with respect to ``x`` (a NumPy array), as NumPy."""
    x = np.asarray(x)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def run(xt):
            with tf.GradientTape() as tape:
                tape.watch(xt)
                value = fn(xt)
            return value, tape.gradient(value, xt)

        if mode != "eager":
            run = tf.function(run, jit_compile=(mode == "xla"), autograph=False)
        value, grad = run(tf.constant(x))
        return np.asarray(value), np.asarray(grad)
    if BACKEND == "jax":
        import jax

        run = jax.value_and_grad(lambda z: fn(z))
        if mode == "jit":
            run = jax.jit(run)
        value, grad = run(jax.numpy.asarray(x))
        return np.asarray(value), np.asarray(grad)
    import torch

    xt = torch.tensor(x if FLOAT64 else x.astype("float32"), requires_grad=True)
    value = fn(xt)
    (grad,) = torch.autograd.grad(value, xt)
    return value.detach().cpu().numpy(), grad.cpu().numpy()


def loss_value_and_grad(loss, labels, x, mode="eager"):
    labels = np.asarray(labels)
    return value_and_grad(lambda z: loss(labels, z), x, mode)


def to_numpy(value):
    return np.asarray(keras.ops.convert_to_numpy(value))



# Losses that score the batch against learnable class proxies: made with NUM_PROXIES
# fixed proxies (labels 0..3), given so that the loss scores a batch outside a model.
PROXY_LOSSES = ("ProxyAnchorLoss",)
NUM_PROXIES = 4


def make_loss(cls, **kwargs):
    """``cls(**kwargs)`` for any loss class of ``tfaploss.losses``; a proxy loss gets
    ``NUM_PROXIES`` fixed proxies of width ``proxy_dim`` (default 6)."""
    dim = kwargs.pop("proxy_dim", 6)
    if cls.__name__ not in PROXY_LOSSES:
        return cls(**kwargs)
    loss = cls(NUM_PROXIES, **kwargs)
    loss.proxies_layer.set_proxies(np.random.default_rng(7).normal(size=(NUM_PROXIES, dim)))
    return loss


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
