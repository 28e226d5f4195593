"""``tfaploss.ops.masks.masked_mean``: the masked average the pair losses and ROADMAP's
calibration share, value and gradient against NumPy on every backend."""

import numpy as np
import pytest
from keras import ops

from tests.support.backend import MODES, value_and_grad
from tfaploss.ops.masks import masked_mean

RNG = np.random.default_rng(3)
VALUES = RNG.standard_normal((5, 7))
MASK = RNG.random((5, 7)) < 0.4
MASK[2] = False  # a row with nothing to average


def _numpy_mean(values, mask, axis):
    count = np.sum(mask, axis=axis)
    return np.sum(np.where(mask, values, 0.0), axis=axis) / np.maximum(count, 1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("axis", [None, 1, 0])
def test_value_and_gradient_match_numpy(mode, axis):
    weights = RNG.standard_normal(_numpy_mean(VALUES, MASK, axis).shape)
    value, grad = value_and_grad(
        lambda x: ops.sum(ops.multiply(masked_mean(x, MASK, axis=axis), weights)), VALUES, mode)
    expected = np.sum(_numpy_mean(VALUES, MASK, axis) * weights)
    # d/dx_ij = w_(reduced index) / count, on the mask only
    count = np.maximum(np.sum(MASK, axis=axis, keepdims=True), 1)
    w = weights if axis is None else np.expand_dims(weights, axis)
    np.testing.assert_allclose(value, expected, rtol=2e-6)
    np.testing.assert_allclose(grad, np.where(MASK, w / count, 0.0), rtol=2e-6, atol=1e-12)


def test_empty_mask_is_zero_and_a_float_mask_counts_as_boolean():
    rows = ops.convert_to_numpy(masked_mean(VALUES, MASK.astype("float32"), axis=1))
    assert rows[2] == 0.0
    np.testing.assert_allclose(rows, _numpy_mean(VALUES, MASK, 1), rtol=2e-6)


def test_non_finite_values_outside_the_mask_are_ignored_with_zero_gradient():
    values = np.where(MASK, VALUES, np.inf)
    values[0, ~MASK[0]] = np.nan
    value, grad = value_and_grad(lambda x: ops.sum(masked_mean(x, MASK, axis=1)), values)
    np.testing.assert_allclose(value, np.sum(_numpy_mean(VALUES, MASK, 1)), rtol=2e-6)
    assert np.all(np.isfinite(grad)) and np.all(grad[~MASK] == 0.0)
