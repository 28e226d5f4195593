"""Queries alone in their class, as the original implementations treat them.

With the query in its own ranking (``include_self=True``) a query whose class has no
other item in the batch still has one positive, itself. The originals of histogram
AP, Smooth-AP, SupAP and BlackBox AP keep it in the mean; the references here follow
their code (float64, dense, :mod:`tests.support.reference`), loss and gradient.
"""

import numpy as np
import pytest

from tests.support import reference
from tests.support.backend import DTYPE, GRAD_RTOL, LOSS_RTOL, MODES, loss_value_and_grad
from tfaploss.losses import APLoss, BlackBoxAPLoss, PNPLoss, SmoothAPLoss, SupAPLoss, TieAwareAPLoss

# Three classes of one image (labels 5, 9 and 11) among 14; not contiguous.
LABELS = np.array([7, 7, 5, 2, 7, 2, 40_000_001, 9, 7, 2, 40_000_001, 11, 7, 3, 3])


def _batch(seed=0, dim=6):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((len(LABELS), dim))


LONE = np.array([np.sum(LABELS == v) == 1 for v in LABELS])


def _histogram(tie_aware, **kw):
    return lambda x, queries=None: reference.histogram_ap_loss_reference(
        x, LABELS, tie_aware=tie_aware, queries=queries, **kw)


def _smooth(pos, neg):
    return lambda x, queries=None: reference.smooth_rank_ap_loss_reference(
        x, LABELS, pos, neg, queries=queries)


# loss constructor keyword arguments -> reference of the original's loss.
CASES = {
    "APLoss": (APLoss, {"include_self": True}, _histogram(None)),
    "APLoss-authors-bins": (APLoss, {"include_self": True, "num_bins": 25,
                                     "score_range": (0.0, 1.0)},
                            _histogram(None, num_bins=25, score_range=(0.0, 1.0))),
    "TieAwareAPLoss": (TieAwareAPLoss, {"include_self": True}, _histogram("full")),
    "TieAwareAPLoss-simplified": (TieAwareAPLoss, {"include_self": True, "simplified": True},
                                  _histogram("simplified")),
    "SmoothAPLoss": (SmoothAPLoss, {}, _smooth(reference.sigmoid_step(0.01),
                                              reference.sigmoid_step(0.01))),
    "SupAPLoss": (SupAPLoss, {}, _smooth(reference.heaviside_step,
                                         reference.sup_ap_upper_step())),
}


def _close(value, grad, ref_value, ref_grad, grad_rtol):
    np.testing.assert_allclose(value, ref_value, rtol=LOSS_RTOL)
    atol = max(grad_rtol, GRAD_RTOL) * np.abs(ref_grad).max()
    np.testing.assert_allclose(grad, ref_grad, rtol=0, atol=atol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drop", [False, True], ids=["kept", "dropped"])
@pytest.mark.parametrize("key", sorted(CASES))
def test_smooth_and_histogram_losses_match_original(key, drop, mode):
    cls, kwargs, ref = CASES[key]
    x = _batch()
    loss = cls(dtype=DTYPE, drop_lone_queries=drop, **kwargs)
    value, grad = loss_value_and_grad(loss, LABELS, x, mode)
    queries = ~LONE if drop else None
    ref_grad = reference.numerical_gradient(lambda z: ref(z, queries), x)
    _close(value, grad, ref(x, queries), ref_grad, 1e-6)


def test_lone_queries_change_the_loss():
    """The references do see the lone queries (so the tests above can fail)."""
    x = _batch()
    for _, _, ref in CASES.values():
        assert abs(ref(x) - ref(x, ~LONE)) > 1e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drop", [False, True], ids=["kept", "dropped"])
def test_blackbox_matches_original(drop, mode):
    x = _batch(1)
    loss = BlackBoxAPLoss(margin=0.0, dtype=DTYPE, drop_lone_queries=drop)
    value, grad = loss_value_and_grad(loss, LABELS, x, mode)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    ref_value, d_scores = reference.blackbox_ap_reference(
        xn @ xn.T, LABELS[:, None] == LABELS[None, :], queries=~LONE if drop else None)
    ref_grad = reference.score_gradient_to_embeddings(x, d_scores)
    _close(value, grad, ref_value, ref_grad, 1e-12)
    assert abs(ref_value - reference.blackbox_ap_reference(
        xn @ xn.T, LABELS[:, None] == LABELS[None, :], queries=None if drop else ~LONE)[0]
    ) > 1e-6


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drop", [None, True, False], ids=["default", "dropped", "kept"])
def test_pnp_drops_lone_queries_by_default(drop, mode):
    """The PNP original drops them: that stays PNPLoss's default."""
    x = _batch(2)
    kwargs = {} if drop is None else {"drop_lone_queries": drop}
    value, grad = loss_value_and_grad(PNPLoss(dtype=DTYPE, **kwargs), LABELS, x, mode)
    queries = None if drop is False else ~LONE

    def ref(z):
        return reference.pnp_dq_loss_reference(z, LABELS, queries=queries)

    _close(value, grad, ref(x), reference.numerical_gradient(ref, x), 1e-6)


@pytest.mark.parametrize("cls", [APLoss, TieAwareAPLoss, SmoothAPLoss, SupAPLoss,
                                 BlackBoxAPLoss, PNPLoss])
def test_switch_round_trips_and_all_lone_batch_is_zero(cls):
    loss = cls(drop_lone_queries=True)
    assert cls.from_config(loss.get_config()).drop_lone_queries is True
    x = _batch(3)[:5]
    value, grad = loss_value_and_grad(cls(dtype=DTYPE, include_self=True), np.arange(5), x)
    assert value == 0.0 and np.all(grad == 0.0)
