"""SupRecallLoss and SupNDCGLoss against goldens of the authors' code
(github.com/elias-ramzi/SupRank, tests/goldens/suprank.json), on the backend the tests
run on, float64 (float32 on PyTorch, see ``backend.FLOAT64``).

Cases (tests/goldens/README.md): ``A`` 32 items of 11 classes of unequal sizes with
three singletons and exactly tied scores (the full gradient is stored); ``E`` 32 items,
8 classes of 4 (the only layout the authors' ``SupRecallLoss`` class accepts; its result
is stored beside the per-query form); ``L`` 256 items, 60 classes with 7 singletons and
ties (loss, gradient norm and projection). The goldens ran the authors' losses on
``F.normalize(X)`` and differentiated with respect to ``X``, so ``normalize=True``
matches the whole gradient.

The tests marked ``tensorflow`` use TensorFlow APIs and run in the TensorFlow run only:
SupRecallLoss and SupNDCGLoss (TensorFlow): rankings worked out by hand, the blocked
computation against a dense Q×N×N reference, graded relevance through the internal hook
against the authors' code, serialization and argument errors. The goldens of the
authors' code on every backend are in tests/losses/test_suprank.py.
"""

import functools
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.losses.test_smooth_rank import (
    awkward_batch,
    batch_masks,
    dense_heaviside,
    dense_rank_terms,
    dense_upper,
    loss_and_grad,
)
from tests.support.backend import (
    DTYPE,
    FLOAT64,
    MODES,
    load_golden,
    loss_value_and_grad,
)
from tfaploss import losses
from tfaploss.losses import SupNDCGLoss, SupRecallLoss

GOLDENS = load_golden("suprank.json")
# 1e-6 relative: the authors' SupNDCG computes its IDCG in float32 even on float64
# inputs (~4e-8 relative); SupRecall agrees to ~1e-14. PyTorch runs in float32 here.
RTOL = 1e-6 if FLOAT64 else 1e-5

# the authors' argument names -> ours
_NAMES = {"tau": "temperature", "rho": "rho", "delta": "delta", "start": "start",
          "offset": "offset", "at_k": "at_k", "temp": "recall_temperature"}


def make_loss(key):
    setting = GOLDENS["settings"][key]
    kwargs = {_NAMES[name]: value for name, value in setting["kwargs"].items()}
    if key.endswith("classdefault"):
        kwargs["offset"] = None  # the authors' class default (ours follow their configs)
    cls = losses.SupRecallLoss if setting["kind"] == "recall" else losses.SupNDCGLoss
    return cls(dtype=DTYPE, **kwargs)


def _inputs(case):
    data = GOLDENS["inputs"][case]
    return np.asarray(data["X"], dtype=np.float64), np.asarray(data["y"])


def test_golden_settings_cover_the_shipped_configs():
    settings = GOLDENS["settings"]
    assert {"suprecall_sop", "suprecall_inat", "suprecall_at10", "supndcg_sop",
            "supndcg_inat"} <= set(settings)
    # our defaults are the SOP configs'
    for key, cls in (("suprecall_sop", losses.SupRecallLoss),
                     ("supndcg_sop", losses.SupNDCGLoss)):
        config = cls().get_config()
        for name, value in settings[key]["kwargs"].items():
            expected = list(value) if isinstance(value, list) else value
            assert config[_NAMES[name]] == expected, (key, name)


# Every setting on A (singletons, ties, unequal classes); the SOP settings also on E
# and on the 256-item L (kept short: JAX compiles every loss's loops).
CHECKS = ([(key, "A") for key in sorted(GOLDENS["settings"])]
          + [(key, case) for key in ("suprecall_sop", "supndcg_sop") for case in "EL"])


@functools.cache
def _eager(key, case):
    x, y = _inputs(case)
    return loss_value_and_grad(make_loss(key), y, x)


@pytest.mark.parametrize("key,case", CHECKS)
def test_losses_and_gradient_summaries(key, case):
    ref = GOLDENS["results"][key][case]
    x, _ = _inputs(case)
    value, grad = _eager(key, case)
    np.testing.assert_allclose(value, ref["loss"], rtol=RTOL)
    np.testing.assert_allclose(np.linalg.norm(grad), ref["grad_fro"], rtol=RTOL)
    w = np.random.default_rng(99).standard_normal(x.shape)
    np.testing.assert_allclose(np.sum(grad * w), ref["grad_dot_W"], rtol=0,
                               atol=RTOL * ref["grad_fro"] * np.sqrt(x.size))
    np.testing.assert_allclose(grad[0, :4], ref["grad_row0_first4"], rtol=0,
                               atol=RTOL * np.abs(grad).max())


def test_authors_class_equals_per_query_form():
    """On E (equal classes) the stored result of the authors' SupRecallLoss class is the
    per-query form the other cases use, so those goldens are the class's formula."""
    for key, setting in GOLDENS["settings"].items():
        if setting["kind"] == "recall":
            results = GOLDENS["results"][key]
            assert results["E_authors_class"]["loss"] == pytest.approx(
                results["E"]["loss"], rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key", ["suprecall_sop", "supndcg_sop"])
def test_full_gradient_case_a(key, mode):
    ref = GOLDENS["results"][key]["A"]
    golden = np.asarray(ref["grad"])
    x, y = _inputs("A")
    value, grad = (_eager(key, "A") if mode == "eager"
                   else loss_value_and_grad(make_loss(key), y, x, mode))
    np.testing.assert_allclose(value, ref["loss"], rtol=RTOL)
    np.testing.assert_allclose(grad, golden, rtol=0, atol=RTOL * np.abs(golden).max())


# --------------------------------------------------------------------------------------
# TensorFlow only
# --------------------------------------------------------------------------------------

def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.clip(z, -50.0, 50.0)))


def _per_query(loss, scores, positives):
    scores = tf.constant(scores, tf.float64)
    positives = tf.constant(positives)
    values, weights = loss.per_query(scores, positives, tf.ones_like(positives))
    return values.numpy(), weights.numpy()


# One query, 8 items: 3 positives, 5 negatives.
POSITIVES = np.array([[True, True, True, False, False, False, False, False]])
PERFECT = np.array([[0.9, 0.8, 0.7, 0.1, 0.0, -0.1, -0.2, -0.3]])
REVERSED = np.array([[-0.7, -0.8, -0.9, 0.5, 0.4, 0.3, 0.2, 0.1]])


@pytest.mark.tensorflow
def test_perfect_ranking_by_hand():
    # Negatives are >= 0.6 below every positive: H-(t) = sigmoid(t / 0.01) ~ e^-50, so
    # the positives' ranks are 1, 2, 3.
    values, weights = _per_query(SupRecallLoss(dtype="float64"), PERFECT, POSITIVES)
    ranks = np.array([1.0, 2.0, 3.0])
    recall = np.mean([_sigmoid(k - ranks).sum() / min(3, k) for k in (1, 2, 4, 8, 16)])
    np.testing.assert_allclose(values, [1.0 - recall], rtol=1e-12)
    np.testing.assert_array_equal(weights, [1.0])
    assert 0.1 < values[0] < 0.11  # a positive at rank k counts 1/2 for R@k
    values, _ = _per_query(SupNDCGLoss(dtype="float64"), PERFECT, POSITIVES)
    np.testing.assert_allclose(values, [0.0], atol=1e-12)


@pytest.mark.tensorflow
def test_reversed_ranking_by_hand_and_larger_loss():
    # Every negative is above every positive by t > delta: H-(t) = rho (t - delta) + offset.
    rho, delta, offset = 100.0, 0.05, 1.44
    pos, neg = REVERSED[0, :3], REVERSED[0, 3:]
    ranks = np.array([1.0 + np.sum(pos > p) + np.sum(rho * (neg - p - delta) + offset)
                      for p in pos])
    recall = np.mean([_sigmoid(k - ranks).sum() / min(3, k) for k in (1, 2, 4, 8, 16)])
    rec_rev, _ = _per_query(SupRecallLoss(dtype="float64"), REVERSED, POSITIVES)
    np.testing.assert_allclose(rec_rev, [1.0 - recall], rtol=1e-12)
    idcg = np.sum(1.0 / np.log2(1.0 + np.arange(1, 4)))
    ndcg_rev, _ = _per_query(SupNDCGLoss(dtype="float64"), REVERSED, POSITIVES)
    np.testing.assert_allclose(ndcg_rev, [1.0 - np.sum(1.0 / np.log2(1.0 + ranks)) / idcg],
                               rtol=1e-12)
    rec_perfect, _ = _per_query(SupRecallLoss(dtype="float64"), PERFECT, POSITIVES)
    ndcg_perfect, _ = _per_query(SupNDCGLoss(dtype="float64"), PERFECT, POSITIVES)
    assert rec_rev[0] > 0.99 > rec_perfect[0]
    assert ndcg_rev[0] > 0.8 and ndcg_perfect[0] < 1e-12


@pytest.mark.tensorflow
def test_separated_classes_give_near_zero_ndcg_loss_and_zero_gradient_direction():
    # Orthogonal classes, distinct members: every query's positives rank first.
    rng = np.random.default_rng(3)
    y = np.repeat(np.arange(4), 4)
    x = np.eye(8)[2 * y] + 0.05 * np.eye(8)[2 * y + 1] * rng.uniform(0.1, 1.0, 16)[:, None]
    value, grad = loss_and_grad(SupNDCGLoss(dtype="float64"), y, x)
    assert value < 1e-9 and np.abs(grad).max() < 1e-9
    shuffled, _ = loss_and_grad(SupNDCGLoss(dtype="float64"), rng.permutation(y), x)
    assert shuffled > 0.2


def _dense_ranks(scores, positives, candidates, upper):
    pos, neg = dense_rank_terms(scores, positives, candidates, dense_heaviside, upper)
    return 1.0 + pos + neg


@pytest.mark.tensorflow
@pytest.mark.parametrize("include_self", [True, False])
def test_blocked_losses_equal_dense_reference_with_gradient(include_self):
    x, y = awkward_batch(5)  # unequal classes, singletons, a huge label id
    upper = dense_upper(start=0.0, offset=1.0)
    kw = {"start": 0.0, "offset": 1.0, "include_self": include_self, "pairs_per_block": 7,
          "dtype": "float64"}
    positives, candidates = batch_masks(y, include_self)
    pos_f = tf.cast(positives, tf.float64)
    count = tf.reduce_sum(pos_f, 1)
    valid = count > 0
    for loss in (SupRecallLoss(at_k=[1, 3], recall_temperature=0.5, **kw),
                 SupNDCGLoss(**kw)):
        value, grad = loss_and_grad(loss, y, x)
        xv = tf.Variable(x)
        with tf.GradientTape() as tape:
            xn = xv / tf.norm(xv, axis=1, keepdims=True)
            rank = _dense_ranks(xn @ tf.transpose(xn), positives, candidates, upper)
            if isinstance(loss, SupRecallLoss):
                score = sum(tf.reduce_sum(pos_f * tf.sigmoid((k - rank) / 0.5), 1)
                            / tf.maximum(tf.minimum(count, k), 1.0) for k in (1, 3)) / 2
            else:
                n = int(x.shape[0])
                ideal = tf.cumsum(1.0 / tf.math.log(2.0 + tf.range(n, dtype=tf.float64))
                                  * np.log(2.0))
                idcg = tf.gather(tf.concat([[0.0], ideal], 0), tf.cast(count, tf.int32))
                dcg = tf.reduce_sum(pos_f * np.log(2.0) / tf.math.log(1.0 + rank), 1)
                score = dcg / tf.where(valid, idcg, 1.0)
            ref = 1.0 - tf.reduce_mean(tf.boolean_mask(score, valid))
        np.testing.assert_allclose(value, float(ref), rtol=1e-12)
        np.testing.assert_allclose(grad, tape.gradient(ref, xv).numpy(), rtol=0, atol=1e-12)


class _GradedNDCG(SupNDCGLoss):
    """Relevance = number of label levels in common (fine, coarse), as the authors'
    ``hierarchy_level: MULTI``, for one fixed batch."""

    def __init__(self, same_coarse, **kwargs):
        super().__init__(**kwargs)
        self.same_coarse = same_coarse

    def _relevance(self, positives, candidates, dtype):
        coarse = tf.logical_and(tf.constant(self.same_coarse), candidates)
        relevance = tf.cast(tf.logical_and(positives, candidates), dtype)
        return relevance + tf.cast(coarse, dtype), (1.0, 2.0)


@pytest.mark.tensorflow
def test_graded_relevance_hook_matches_authors_multi_level_ndcg(goldens_dir):
    with open(goldens_dir / "suprank.json", encoding="utf-8") as f:
        golden = json.load(f)["graded_G"]
    x, fine, coarse = (np.asarray(golden[k]) for k in ("X", "y_fine", "y_coarse"))
    loss = _GradedNDCG(coarse[:, None] == coarse[None, :], dtype="float64",
                       pairs_per_block=11)
    value, grad = loss_and_grad(loss, fine, x)
    # the authors' IDCG is float32 (see SupNDCGLoss's docstring)
    np.testing.assert_allclose(value, golden["loss"], rtol=1e-6)
    ref = np.asarray(golden["grad"])
    np.testing.assert_allclose(grad, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    single, _ = loss_and_grad(SupNDCGLoss(dtype="float64"), fine, x)
    assert abs(single - value) > 1e-3  # the coarse level changes the loss


@pytest.mark.tensorflow
@pytest.mark.parametrize("loss", [
    SupRecallLoss(at_k=(10,), recall_temperature=0.5, temperature=0.02, rho=50.0,
                  delta=0.1, start=0.0, offset=1.0, include_self=False,
                  pairs_per_block=9, drop_lone_queries=True, reduction="sum"),
    SupNDCGLoss(offset=None, start=0.6, normalize=False, name="ndcg"),
])
def test_serialization_round_trip(loss):
    config = keras.saving.serialize_keras_object(loss)
    json.dumps(config)  # a plain JSON document
    clone = keras.saving.deserialize_keras_object(json.loads(json.dumps(config)))
    assert type(clone) is type(loss)
    assert clone.get_config() == loss.get_config()
    x, y = awkward_batch(2)
    np.testing.assert_allclose(float(clone(y, x)), float(loss(y, x)), rtol=1e-7)


@pytest.mark.tensorflow
@pytest.mark.parametrize("make, name, value", [
    (lambda: SupRecallLoss(at_k=[]), "at_k", "[]"),
    (lambda: SupRecallLoss(at_k=[1, 0]), "at_k", "[1, 0]"),
    (lambda: SupRecallLoss(at_k=[2.5]), "at_k", "[2.5]"),
    (lambda: SupRecallLoss(at_k=4), "at_k", "4"),
    (lambda: SupRecallLoss(recall_temperature=0.0), "recall_temperature", "0.0"),
    (lambda: SupRecallLoss(temperature=-1.0), "temperature", "-1.0"),
    (lambda: SupNDCGLoss(rho=-2.0), "rho", "-2.0"),
    (lambda: SupNDCGLoss(delta="x"), "delta", "'x'"),
    (lambda: SupNDCGLoss(offset="big"), "offset", "'big'"),
    (lambda: SupNDCGLoss(pairs_per_block=0), "pairs_per_block", "0"),
])
def test_argument_errors_name_argument_and_value(make, name, value):
    with pytest.raises(ValueError) as err:
        make()
    message = str(err.value)
    assert name in message and value in message and type(err.value) is ValueError
    assert message.startswith(("SupRecallLoss:", "SupNDCGLoss:"))
