"""The ranking losses honour Keras's loss contract: ``reduction`` and ``sample_weight``.

``call`` returns one term per query (0, and masked, for a query without positives) and
Keras's ``Loss.__call__`` reduces the terms. Every expected value here is computed from
first principles (a hand-worked batch, NumPy loops) or with the float64 references of
:mod:`tests.support.reference`; that the default reduction still gives the published values is
checked by ``test_goldens.py`` and ``test_lone_queries.py``.
"""

import inspect
import warnings

import keras
import numpy as np
import pytest

from tests.support import reference
from tests.support.backend import (
    DTYPE,
    FLOAT64,
    LOSS_RTOL,
    MODES,
    make_loss,
    to_numpy,
    value_and_grad,
)
from tfaploss import losses
from tfaploss.losses import APLoss, SmoothAPLoss, TripletLoss

REDUCTIONS = ["sum_over_batch_size", "mean", "mean_with_sample_weight", "sum", "none"]
GRAD_RTOL = 1e-6 if FLOAT64 else 1e-3  # of max |G|, against finite differences
VALUE_RTOL = LOSS_RTOL if FLOAT64 else 1e-5


def _expected(terms, valid, reduction, sample_weight=None):
    """Keras's reductions of per-query ``terms`` (0 where not ``valid``), written out."""
    s = np.ones(len(terms)) if sample_weight is None else np.asarray(sample_weight, float)
    weighted = s * terms
    if reduction in ("none", None):
        return weighted
    if reduction == "sum":
        return weighted.sum()
    if reduction == "mean_with_sample_weight":
        return weighted.sum() / (s * valid).sum()
    return weighted.sum() / valid.sum()  # "sum_over_batch_size", "mean": over valid queries


# -- a batch small enough to work out by hand -----------------------------------------
#
# APLoss(num_bins=3, score_range=(-1, 1)): bin centres 1, 0, -1, and every cosine below
# is exactly one of them, so each score falls in one bin and the histogram AP is
# sum_m C+_m / C_m * c+_m / |P| over the bins (cumulative counts from the top):
#   query 0 (A): e2 (neg) at 1; e1 (pos), e4 (neg) at 0; e3 at -1  -> AP = 1/3
#   query 1 (A): e0 (pos), e2, e3 at 0; e4 at -1                    -> AP = 1/3
#   query 2 (B): e0 at 1; e1, e4 at 0; e3 (pos) at -1               -> AP = 1/4
#   query 3 (B): e1, e4 at 0; e0, e2 (pos) at -1                    -> AP = 1/4
#   query 4 (C): no other item of class C: no positive, left out.
HAND_X = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [-1.0, 0.0], [0.0, -1.0]])
HAND_Y = np.array([0, 0, 1, 1, 2])
HAND_TERMS = np.array([2 / 3, 2 / 3, 3 / 4, 3 / 4, 0.0])
HAND_VALID = np.array([True, True, True, True, False])
HAND_WEIGHTS = np.array([1.0, 2.0, 0.0, 3.0, 5.0])


def _hand_loss(reduction="sum_over_batch_size"):
    return APLoss(num_bins=3, score_range=(-1.0, 1.0), reduction=reduction, dtype=DTYPE)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_hand_worked_batch(reduction):
    loss = _hand_loss(reduction)
    for weights in (None, HAND_WEIGHTS):
        got = to_numpy(loss(HAND_Y, HAND_X, sample_weight=weights))
        want = _expected(HAND_TERMS, HAND_VALID, reduction, weights)
        np.testing.assert_allclose(got, want, rtol=VALUE_RTOL, atol=1e-12)
    # The numbers, written out: the default divides by the 4 queries with positives.
    if reduction == "sum_over_batch_size":
        assert float(loss(HAND_Y, HAND_X)) == pytest.approx(17 / 24, rel=VALUE_RTOL)
        assert float(loss(HAND_Y, HAND_X, sample_weight=HAND_WEIGHTS)) == pytest.approx(
            (2 / 3 + 4 / 3 + 9 / 4) / 4, rel=VALUE_RTOL)


def test_per_query_terms_of_call_are_masked():
    """``call`` gives the terms; queries without positives get 0 (and a Keras mask)."""
    loss = _hand_loss()
    terms = to_numpy(loss.call(HAND_Y, HAND_X))
    np.testing.assert_allclose(terms, HAND_TERMS, rtol=VALUE_RTOL, atol=1e-12)


# -- random batches against the references --------------------------------------------

# Class sizes 4, 3, 2, 1 and 2: a lone query (label 3) and unequal positive counts.
LABELS = np.array([0, 1, 0, 2, 1, 0, 3, 4, 2, 1, 0, 4])
LONE = np.array([np.sum(LABELS == v) == 1 for v in LABELS])
WEIGHTS = np.linspace(0.25, 3.0, len(LABELS))[::-1].copy()


def _batch(seed=0, dim=4):
    return np.random.default_rng(seed).standard_normal((len(LABELS), dim))


def _ap_terms(x):
    """APLoss (query left out of its ranking): ``1 - AP_i``, the dense histogram."""
    s = reference._unit_scores(x)
    others = ~np.eye(len(LABELS), dtype=bool)
    ap = reference.histogram_ap_dense(s, LABELS[:, None] == LABELS[None, :], others)
    valid = ~LONE
    return np.where(valid, 1.0 - np.nan_to_num(ap), 0.0), valid


def _class_balanced_ap_terms(x):
    """APLoss(class_balanced=True): weights 1 / class size, relative to their mean."""
    values, valid = _ap_terms(x)
    w = np.where(valid, 1.0 / np.array([np.sum(LABELS == v) for v in LABELS]), 0.0)
    return values * w / w[valid].mean(), valid


def _smooth_ap_terms(x):
    """SmoothAPLoss(drop_lone_queries=True): ``1 - AP_i`` of the Smooth-AP original."""
    step = reference.sigmoid_step(0.01)
    eye = np.eye(len(LABELS), dtype=bool)
    values = np.array([reference.smooth_rank_ap_loss_reference(x, LABELS, step, step,
                                                                queries=eye[i])
                       for i in range(len(LABELS))])
    return np.where(~LONE, values, 0.0), ~LONE


def _triplet_terms(x, margin=1.0):
    """TripletLoss (semihard), per anchor, from the definition.

    Anchor a's loss is the mean over its positives p of ``max(margin + d_ap - d_an, 0)``
    (n: the closest negative farther than p, else the farthest); its built-in weight
    is its number of positives, so the term is ``l_a * P_a / mean_valid(P)`` and the
    mean over anchors is TF Addons' mean over positive pairs.
    """
    d = reference.pairwise_distances(x)
    values, counts = np.zeros(len(LABELS)), np.zeros(len(LABELS))
    for a in range(len(LABELS)):
        negatives = d[a, LABELS != LABELS[a]]
        pair_losses = []
        for p in range(len(LABELS)):
            if p != a and LABELS[p] == LABELS[a]:
                farther = negatives[negatives > d[a, p]]
                n = farther.min() if farther.size else negatives.max()
                pair_losses.append(max(margin + d[a, p] - n, 0.0))
        if pair_losses:
            values[a], counts[a] = np.mean(pair_losses), len(pair_losses)
    valid = counts > 0
    return values * counts / counts[valid].mean(), valid


CASES = {
    "APLoss": (lambda r: APLoss(reduction=r, dtype=DTYPE), _ap_terms),
    "APLoss-class-balanced": (lambda r: APLoss(class_balanced=True, reduction=r,
                                               dtype=DTYPE), _class_balanced_ap_terms),
    "SmoothAPLoss": (lambda r: SmoothAPLoss(drop_lone_queries=True, reduction=r,
                                            dtype=DTYPE), _smooth_ap_terms),
    "TripletLoss": (lambda r: TripletLoss(reduction=r, dtype=DTYPE), _triplet_terms),
}


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "sample_weight"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("key", sorted(CASES))
def test_reductions_match_the_reference(key, reduction, weighted):
    make, ref = CASES[key]
    x = _batch()
    terms, valid = ref(x)
    weights = WEIGHTS if weighted else None
    got = to_numpy(make(reduction)(LABELS, x, sample_weight=weights))
    want = _expected(terms, valid, reduction, weights)
    np.testing.assert_allclose(got, want, rtol=VALUE_RTOL, atol=1e-12)
    if reduction == "none":
        assert got.shape == (len(LABELS),)
        assert np.all(got[~valid] == 0.0)


@pytest.mark.parametrize("key", sorted(CASES))
def test_default_is_the_mean_over_queries_with_positives(key):
    """Lone queries are masked out: the default is not ``sum / B``."""
    make, ref = CASES[key]
    x = _batch(seed=1)
    terms, valid = ref(x)
    assert not valid.all()
    default = float(make("sum_over_batch_size")(LABELS, x))
    np.testing.assert_allclose(default, terms[valid].mean(), rtol=VALUE_RTOL)
    total = float(make("sum")(LABELS, x))
    np.testing.assert_allclose(default, total / valid.sum(), rtol=VALUE_RTOL)
    assert abs(default - total / len(LABELS)) > 1e-3


def test_builtin_weights_keep_the_published_means():
    x = _batch(seed=2)
    np.testing.assert_allclose(float(TripletLoss(dtype=DTYPE)(LABELS, x)),
                               reference.triplet_semihard_reference(x, LABELS),
                               rtol=VALUE_RTOL)
    values, valid = _ap_terms(x)
    w = np.where(valid, 1.0 / np.array([np.sum(LABELS == v) for v in LABELS]), 0.0)
    np.testing.assert_allclose(float(APLoss(class_balanced=True, dtype=DTYPE)(LABELS, x)),
                               np.sum(w * values) / np.sum(w), rtol=VALUE_RTOL)


def test_sample_weight_does_not_change_the_rankings():
    """Weight 0 on an item drops its own term only; it is still in every ranking."""
    x = _batch(seed=3)
    loss = APLoss(reduction="none", dtype=DTYPE)
    plain = to_numpy(loss(LABELS, x))
    weights = np.ones(len(LABELS))
    weights[0] = 0.0
    weighted = to_numpy(loss(LABELS, x, sample_weight=weights))
    np.testing.assert_allclose(weighted[1:], plain[1:], rtol=VALUE_RTOL)
    assert weighted[0] == 0.0 and plain[0] > 0.0
    # Removing item 0 from the batch instead changes the other queries' APs.
    removed = to_numpy(loss(LABELS[1:], x[1:]))
    assert np.abs(removed - plain[1:]).max() > 1e-3


def test_sample_weight_shapes():
    x = _batch()
    loss = APLoss(dtype=DTYPE)
    column = float(loss(LABELS, x, sample_weight=WEIGHTS[:, None]))
    np.testing.assert_allclose(column, float(loss(LABELS, x, sample_weight=WEIGHTS)),
                               rtol=1e-12)
    np.testing.assert_allclose(float(loss(LABELS, x, sample_weight=2.0)),
                               2.0 * float(loss(LABELS, x)), rtol=VALUE_RTOL)
    for bad in (np.ones(len(LABELS) - 1), np.ones((len(LABELS), 2)),
                np.ones((2, len(LABELS), 1))):
        shape = ", ".join(str(n) for n in bad.shape) + ("," if bad.ndim == 1 else "")
        with pytest.raises(ValueError, match=rf"sample_weight of shape \({shape}\)"):
            loss(LABELS, x, sample_weight=bad)
    with pytest.raises(ValueError, match="sample_weight"):
        loss.query_database_loss(LABELS, x, LABELS, x, sample_weight=np.ones(3))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_query_database_loss_reduces_the_same_way(reduction):
    """A batch ranked against itself as a database (self left out) equals the loss."""
    x = _batch(seed=4)
    loss = APLoss(reduction=reduction, dtype=DTYPE)
    others = ~np.eye(len(LABELS), dtype=bool)
    for weights in (None, WEIGHTS):
        bank = loss.query_database_loss(LABELS, x, LABELS, x, candidates=others,
                                        sample_weight=weights)
        np.testing.assert_allclose(to_numpy(bank),
                                   to_numpy(loss(LABELS, x, sample_weight=weights)),
                                   rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight",
                                       "sum"])
def test_batch_without_positives_gives_zero_with_any_weights(reduction):
    x = _batch()
    loss = APLoss(reduction=reduction, dtype=DTYPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "no pair of the same label"
        value, grad = value_and_grad(
            lambda z: loss(np.arange(len(LABELS)), z, sample_weight=WEIGHTS), x)
    assert float(value) == 0.0
    assert np.all(grad == 0.0)


def test_non_finite_embeddings_give_nan_for_every_reduction():
    x = _batch()
    x[2, 1] = np.nan
    for reduction in REDUCTIONS:
        value = to_numpy(APLoss(reduction=reduction, dtype=DTYPE)(LABELS, x,
                                                                  sample_weight=WEIGHTS))
        assert np.all(np.isnan(value)), reduction


# -- gradients with sample_weight -----------------------------------------------------

_NUMERICAL = {}


def _numerical_gradient(key, reduction, x):
    if (key, reduction) not in _NUMERICAL:
        _, ref = CASES[key]

        def reduced(z):
            terms, valid = ref(z)
            return _expected(terms, valid, reduction, WEIGHTS)

        _NUMERICAL[key, reduction] = (reduced(x), reference.numerical_gradient(reduced, x))
    return _NUMERICAL[key, reduction]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight",
                                       "sum"])
@pytest.mark.parametrize("key", sorted(CASES))
def test_gradient_with_sample_weight_matches_finite_differences(key, reduction, mode):
    make, _ = CASES[key]
    x = _batch(seed=5)
    loss = make(reduction)
    value, grad = value_and_grad(lambda z: loss(LABELS, z, sample_weight=WEIGHTS), x, mode)
    ref_value, ref_grad = _numerical_gradient(key, reduction, x)
    np.testing.assert_allclose(value, ref_value, rtol=VALUE_RTOL)
    np.testing.assert_allclose(grad, ref_grad, rtol=0,
                               atol=GRAD_RTOL * np.abs(ref_grad).max())


# -- configuration and Keras integration ----------------------------------------------

LOSS_CLASSES = sorted(
    (obj for name in losses.__all__
     if inspect.isclass(obj := getattr(losses, name))
     and issubclass(obj, losses.RetrievalLoss) and obj is not losses.RetrievalLoss),
    key=lambda cls: cls.__name__)


@pytest.mark.parametrize("reduction", ["sum", "none", None, "mean_with_sample_weight"])
@pytest.mark.parametrize("cls", LOSS_CLASSES, ids=lambda c: c.__name__)
def test_config_round_trip_keeps_the_reduction(cls, reduction):
    loss = make_loss(cls, reduction=reduction)
    assert loss.get_config()["reduction"] == reduction
    assert cls.from_config(loss.get_config()).reduction == reduction
    restored = keras.losses.deserialize(keras.losses.serialize(loss))
    assert type(restored) is cls and restored.reduction == reduction


def test_compiled_model_passes_sample_weight_to_the_loss():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype=DTYPE)])
    loss = APLoss(dtype=DTYPE)
    model.compile(loss=loss)
    x = _batch(seed=6)
    logs = model.evaluate(x, LABELS, sample_weight=WEIGHTS, batch_size=len(LABELS),
                          verbose=0, return_dict=True)
    want = float(loss(LABELS, model(x), sample_weight=WEIGHTS))
    assert logs["loss"] == pytest.approx(want, rel=1e-5)
    assert abs(want - float(loss(LABELS, model(x)))) > 1e-3
