"""Non-finite embeddings and label/embedding count mismatches, for EVERY loss class.

Non-finite embeddings must give a non-finite loss value (never a finite loss with a
non-finite gradient, never a crash inside a binning op) in every execution mode of
the backend; a label count that differs from the embedding count is a ValueError
naming both sizes.
"""

import inspect

import numpy as np
import pytest

import tfaploss.losses as losses_module
from tests.support.backend import (
    BACKEND,
    MODES,
    PROXY_LOSSES,
    loss_value_and_grad,
    make_loss,
    value_and_grad,
)
from tfaploss.losses.base import RetrievalLoss

LOSS_CLASSES = sorted(
    (obj for name in losses_module.__all__
     if inspect.isclass(obj := getattr(losses_module, name))
     and issubclass(obj, RetrievalLoss) and obj is not RetrievalLoss),
    key=lambda cls: cls.__name__,
)
params = pytest.mark.parametrize("cls", LOSS_CLASSES, ids=lambda c: c.__name__)
LABELS = np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3])


def _batch(seed=1, dim=6):
    return np.random.default_rng(seed).normal(size=(len(LABELS), dim)).astype("float32")


def _make(cls):
    """An instance without randomness (BlackBox's stochastic margin off)."""
    return cls(margin=0.0) if cls.__name__ == "BlackBoxAPLoss" else make_loss(cls)


# NaN in every mode; infinities in one mode (the guard is the same code).
CASES = [(mode, np.nan) for mode in MODES] + [(MODES[-1], np.inf), (MODES[-1], -np.inf)]


@pytest.mark.slow
@params
@pytest.mark.parametrize("mode,bad", CASES, ids=[f"{m}-{b}" for m, b in CASES])
def test_non_finite_embedding_gives_non_finite_loss(cls, mode, bad):
    x = _batch()
    x[4, 2] = bad
    value, grad = loss_value_and_grad(_make(cls), LABELS, x, mode)
    assert not np.isfinite(value), (value, grad)


@params
@pytest.mark.parametrize("mode", MODES[-1:])
def test_non_finite_memory_bank_gives_non_finite_loss(cls, mode):
    q, db = _batch(2)[:5], _batch(3)
    db[7, 0] = np.nan
    loss = make_loss(cls)
    if cls.__name__ in PROXY_LOSSES:  # scores against its proxies: no memory bank
        with pytest.raises(ValueError, match="no query-vs-database form"):
            loss.query_database_loss(LABELS[:5], q, LABELS, db)
        return
    value, _ = value_and_grad(
        lambda z: loss.query_database_loss(LABELS[:5], z, LABELS, db), q, mode)
    assert not np.isfinite(value)


@params
@pytest.mark.parametrize("n_labels,n_rows", [(1, 8), (8, 1)])
def test_label_count_mismatch_names_both_sizes(cls, n_labels, n_rows):
    x = _batch()[:n_rows]
    labels = LABELS[:n_labels]
    with pytest.raises(ValueError, match=rf"{n_labels} labels.*{n_rows} embeddings"):
        make_loss(cls)(labels, x)
    if cls.__name__ in PROXY_LOSSES:
        return
    with pytest.raises(ValueError, match=rf"{n_labels} labels.*{n_rows} embeddings"):
        cls().query_database_loss(labels, x, LABELS, _batch())


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "tensorflow", reason="only TF graphs have unknown batch sizes")
@params
def test_label_count_mismatch_unknown_sizes_fails_at_run_time(cls):
    import tensorflow as tf

    loss = _make(cls)
    fn = tf.function(loss, input_signature=[tf.TensorSpec([None], tf.int32),
                                            tf.TensorSpec([None, 6], tf.float32)])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"differ in size.*\[1 8\]"):
        fn(LABELS[:1].astype("int32"), _batch()[:8])
    np.testing.assert_allclose(fn(LABELS.astype("int32"), _batch()).numpy(),
                               loss(LABELS, _batch()).numpy(), rtol=1e-5)
