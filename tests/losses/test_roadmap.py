"""ROADMAP: calibration and SupAP + calibration against the authors' code.

The calibration reference (pytorch-metric-learning's contrastive loss with cosine
similarity) re-normalises inside, so its gradient has no radial part and our default
``normalize=True`` reproduces it whole. The totals add that to SupAP's reference
gradient, which was computed on the given X *without* re-normalising: the golden total
is our ``normalize=True`` gradient plus the radial part of SupAP's ``normalize=False``
gradient.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.losses.test_smooth_rank import (
    assert_grad_summary,
    awkward_batch,
    golden_inputs,
    loss_and_grad,
    tangential,
)
from tfaploss.losses import CalibrationLoss, ROADMAPLoss, SupAPLoss
from tfaploss.ops.calibration import calibration_loss

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only

TOTALS = {
    "roadmap_total_sop": {"offset": 1.44},
    "roadmap_total_inat": {"start": 0.0, "offset": 1.0},
}


def test_calibration_goldens(smooth_rank_goldens):
    results = smooth_rank_goldens["results"]["roadmap_calibration"]
    golden = np.asarray(smooth_rank_goldens["full_grad_case_A"]["roadmap_calibration"])
    for case in ("A", "B", "D"):
        x, y = golden_inputs(smooth_rank_goldens, case)
        value, grad = loss_and_grad(CalibrationLoss(dtype="float64"), y, x)
        np.testing.assert_allclose(value, results[case]["loss"], rtol=1e-9)
        assert_grad_summary(grad, results[case])
        value32 = float(CalibrationLoss()(y, tf.constant(x, tf.float32)))
        np.testing.assert_allclose(value32, results[case]["loss"], rtol=1e-5)
        # Without re-normalisation the value is the same; the gradient gains a radial part.
        raw_value, raw = loss_and_grad(CalibrationLoss(normalize=False, dtype="float64"), y, x)
        np.testing.assert_allclose(raw_value, results[case]["loss"], rtol=1e-9)
        if case == "A":
            np.testing.assert_allclose(tangential(raw, x), golden, rtol=0, atol=1e-12)
    x, y = golden_inputs(smooth_rank_goldens, "A")
    np.testing.assert_allclose(loss_and_grad(CalibrationLoss(dtype="float64"), y, x)[1],
                               golden, rtol=0, atol=1e-12)
    _, grad32 = loss_and_grad(CalibrationLoss(), y, x, dtype="float32")
    np.testing.assert_allclose(grad32, golden, rtol=0, atol=1e-5 * np.abs(golden).max())


@pytest.mark.parametrize("key", sorted(TOTALS))
def test_twice_roadmap_equals_authors_total(smooth_rank_goldens, key):
    """The authors' code sums SupAP and calibration with weight 1: 2 x (lambda_=0.5)."""
    kwargs = TOTALS[key]
    results = smooth_rank_goldens["results"][key]
    for case in ("A", "B", "D"):
        x, y = golden_inputs(smooth_rank_goldens, case)
        value, grad = loss_and_grad(ROADMAPLoss(dtype="float64", **kwargs), y, x)
        np.testing.assert_allclose(2.0 * value, results[case]["loss"], rtol=1e-9)
        _, sup_raw = loss_and_grad(SupAPLoss(normalize=False, dtype="float64", **kwargs), y, x)
        radial = sup_raw - tangential(sup_raw, x)
        assert_grad_summary(2.0 * grad + radial, results[case])
        value32 = float(ROADMAPLoss(**kwargs)(y, tf.constant(x, tf.float32)))
        np.testing.assert_allclose(2.0 * value32, results[case]["loss"], rtol=1e-5)
    golden = np.asarray(smooth_rank_goldens["full_grad_case_A"][key])
    x, y = golden_inputs(smooth_rank_goldens, "A")
    _, grad = loss_and_grad(ROADMAPLoss(dtype="float64", **kwargs), y, x)
    np.testing.assert_allclose(2.0 * grad, tangential(golden, x), rtol=0, atol=1e-12)
    _, grad32 = loss_and_grad(ROADMAPLoss(**kwargs), y, x, dtype="float32")
    np.testing.assert_allclose(2.0 * grad32, tangential(golden, x), rtol=0,
                               atol=1e-5 * np.abs(golden).max())


def test_lambda_endpoints_and_mixture(smooth_rank_goldens):
    x, y = golden_inputs(smooth_rank_goldens, "B")
    sup = float(SupAPLoss(dtype="float64")(y, x))
    calib = float(CalibrationLoss(dtype="float64")(y, x))
    np.testing.assert_allclose(float(ROADMAPLoss(lambda_=0.0, dtype="float64")(y, x)), sup,
                               rtol=1e-12)
    np.testing.assert_allclose(float(ROADMAPLoss(lambda_=1.0, dtype="float64")(y, x)), calib,
                               rtol=1e-12)
    np.testing.assert_allclose(float(ROADMAPLoss(lambda_=0.3, dtype="float64")(y, x)),
                               0.7 * sup + 0.3 * calib, rtol=1e-12)
    np.testing.assert_allclose(
        sup, smooth_rank_goldens["results"]["roadmap_supap_classdefault"]["B"]["loss"],
        rtol=1e-9)


def test_calibration_reductions_by_hand():
    # One query row, candidates j = 0..3: positives {0, 1}, negatives {2, 3}.
    scores = tf.constant([[0.95, 0.5, 0.7, 0.1], [0.2, 0.85, 0.65, 0.8]], tf.float64)
    positives = tf.constant([[True, True, False, False], [False, False, False, False]])
    candidates = tf.ones_like(positives)
    # l+: row 0 -> [0, 0.4]; l-: row 0 -> [0.1, 0], row 1 -> [0, 0.25, 0.05, 0.2].
    nonzero = calibration_loss(scores, positives, candidates)
    np.testing.assert_allclose(float(nonzero), 0.4 / 1 + (0.1 + 0.25 + 0.05 + 0.2) / 4,
                               rtol=1e-12)
    per_query = calibration_loss(scores, positives, candidates, averaging="per_query")
    # Only row 0 has a positive: (0 + 0.4) / 2 + (0.1 + 0) / 2.
    np.testing.assert_allclose(float(per_query), 0.2 + 0.05, rtol=1e-12)
    nothing = calibration_loss(scores * 0 + 0.9, positives, tf.logical_and(candidates,
                                                                          positives))
    assert float(nothing) == 0.0


def test_calibration_paper_averaging_differs_from_code(smooth_rank_goldens):
    x, y = golden_inputs(smooth_rank_goldens, "A")
    code = float(CalibrationLoss(dtype="float64")(y, x))
    paper = float(CalibrationLoss(averaging="per_query", dtype="float64")(y, x))
    assert np.isfinite(paper) and 0.0 < paper < code


def test_no_positive_pair_and_all_positive():
    from tfaploss.losses import base

    base._warned_no_positives = False
    x = np.random.default_rng(1).standard_normal((5, 4))
    for loss in (CalibrationLoss(dtype="float64"), ROADMAPLoss(dtype="float64")):
        base._warned_no_positives = False
        with pytest.warns(RuntimeWarning, match="no pair"):
            value, grad = loss_and_grad(loss, np.arange(5), x)
        assert value == 0.0
        np.testing.assert_array_equal(grad, 0.0)
    # All positives already above the margin: SupAP and calibration both exactly 0.
    tight = np.ones((4, 3)) + 1e-3 * np.random.default_rng(2).standard_normal((4, 3))
    value, grad = loss_and_grad(ROADMAPLoss(dtype="float64"), np.zeros(4, int), tight)
    assert value == 0.0
    np.testing.assert_array_equal(grad, 0.0)


def test_memory_bank_of_the_batch_equals_batch_loss():
    x, y = awkward_batch(5)
    loss = ROADMAPLoss(dtype="float64", pairs_per_block=3)
    np.testing.assert_allclose(float(loss.query_database_loss(y, x, y, x)), float(loss(y, x)),
                               rtol=1e-12)


def test_argument_errors_and_config_round_trip():
    with pytest.raises(ValueError, match="lambda_"):
        ROADMAPLoss(lambda_=1.5)
    with pytest.raises(ValueError, match="averaging"):
        CalibrationLoss(averaging="mean")
    for loss in (CalibrationLoss(pos_margin=0.8, neg_margin=0.5, averaging="per_query"),
                 ROADMAPLoss(lambda_=0.25, offset=1.44, averaging="per_query",
                             pairs_per_block=11)):
        clone = type(loss).from_config(loss.get_config())
        assert clone.get_config() == loss.get_config()
