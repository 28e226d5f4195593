"""RecallAtKLoss with SiMix in training, on every Keras backend: the mixing coefficients
change from step to step under ``keras.Model.fit`` and under ``MultiStageModel`` (their
JAX trainers carry no loss state: the coefficients are a hash of the batch, see
``tfaploss.ops.recall_rank.simix_coefficients``), each step is the step with explicit
coefficients ``loss.simix_coefficients`` of that step's embeddings, and a multi-stage
step equals the single-pass step.

Runs under the process's KERAS_BACKEND (like tests/training/test_multistage.py), float64.
"""

import keras
import numpy as np
import pytest

from tests.support.backend import BACKEND, float64_policy, to_numpy
from tests.support.exactness import IMAGE_SHAPE, build_exactness_model
from tfaploss.losses import RecallAtKLoss
from tfaploss.training import MultiStageModel

BATCH = 12
SEED = 5
# Torch computes the float64 model's matmuls in float32 (tests/training/test_multistage.py).
TOLERANCE = ({"rtol": 1e-6, "atol": 1e-6} if BACKEND == "torch"
             else {"rtol": 1e-9, "atol": 1e-9})


def make_batch():
    rng = np.random.default_rng(0)
    images = rng.normal(size=(BATCH,) + IMAGE_SHAPE)
    return images, (np.arange(BATCH) % 4).astype("int32")  # 4 classes x 3: one group each


def simix_loss():
    return RecallAtKLoss(simix=True, simix_group=3, seed=SEED, tau1=0.1, dtype="float64")


class GivenCoefficients(RecallAtKLoss):
    """RecallAtKLoss mixing with fixed coefficients (the reference step)."""

    def __init__(self, alphas, **kwargs):
        super().__init__(**kwargs)
        self.alphas = np.asarray(alphas)

    def __call__(self, y_true, y_pred, sample_weight=None):
        return self.mixed_loss(y_true, y_pred, self.alphas, sample_weight=sample_weight)


def given(alphas):
    return GivenCoefficients(alphas, simix_group=3, tau1=0.1, dtype="float64")


def weights_of(model):
    return [np.array(w, dtype=np.float64) for w in model.get_weights()]


def fit(weights, loss, images, labels, epochs=1, chunk_size=0):
    """``epochs`` steps on the one batch; ``chunk_size`` 0: plain ``keras.Model``."""
    model = build_exactness_model(output_dtype=None)
    model.set_weights(weights)
    trainer = model if chunk_size == 0 else MultiStageModel(model, chunk_size=chunk_size)
    trainer.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
    trainer.fit(images, labels, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return weights_of(model), model


def coefficients(model, images, labels):
    return to_numpy(simix_loss().simix_coefficients(labels, model(images, training=False)))


def assert_weights_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, **TOLERANCE)


def max_abs_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def two_reference_steps():
    """Two plain steps with the coefficients of each step's embeddings given explicitly,
    and the second step redone with the first step's coefficients (the JAX trainers'
    behaviour with a SeedGenerator: its state never advanced)."""
    images, labels = make_batch()
    with float64_policy():
        model = build_exactness_model(output_dtype=None)
        initial = weights_of(model)
        first = coefficients(model, images, labels)
        after_one, model = fit(initial, given(first), images, labels)
        second = coefficients(model, images, labels)
        expected, _ = fit(after_one, given(second), images, labels)
        stale, _ = fit(after_one, given(first), images, labels)
    return {"images": images, "labels": labels, "initial": initial, "first": first,
            "second": second, "expected": expected, "stale": stale}


@pytest.mark.slow
def test_reference_steps_use_new_coefficients(two_reference_steps):
    ref = two_reference_steps
    assert ref["first"].shape == (12,)  # 4 groups of 3: 3 pairs each
    assert np.mean(np.abs(ref["first"] - ref["second"])) > 0.1
    # reusing the first step's coefficients gives a different second step
    assert max_abs_diff(ref["expected"], ref["stale"]) > 1e-4
    assert max_abs_diff(ref["initial"], ref["expected"]) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [0, 5, None])
def test_two_steps_draw_new_coefficients(two_reference_steps, chunk_size):
    """``fit`` (chunk_size 0) and MultiStageModel (chunks of 5; one chunk) over two steps
    equal the reference: each step mixed with its own embeddings' coefficients."""
    ref = two_reference_steps
    with float64_policy():
        weights, _ = fit(ref["initial"], simix_loss(), ref["images"], ref["labels"],
                         epochs=2, chunk_size=chunk_size)
    assert_weights_equal(weights, ref["expected"])
