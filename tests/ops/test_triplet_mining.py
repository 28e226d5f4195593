"""The blocked triplet mining (tfaploss.ops.triplet_mining) against a brute force over
every (query, positive, negative) on rectangular score matrices (queries against a
larger database, as the cross-batch memory ranks them), in every execution mode of the
backend, gradients included."""

import numpy as np
import pytest
from keras import ops

from tests.support.backend import DTYPE, GRAD_RTOL, LOSS_RTOL, MODES, value_and_grad
from tfaploss.ops.triplet_mining import hinge_sums, semihard_gaps

MARGIN = 0.3


def _case(seed, queries=7, items=11):
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.0, 2.0, (queries, items))
    labels_q, labels_d = rng.integers(0, 3, queries), rng.integers(0, 3, items)
    positives = labels_q[:, None] == labels_d[None, :]
    negatives = ~positives
    negatives[0] = False  # a query with positives and no negative
    return d, positives, negatives


def _brute(d, positives, negatives):
    semihard, hinge = np.zeros_like(d), np.zeros_like(d)
    for i, k in zip(*np.nonzero(positives)):
        t = d[i, negatives[i]] - d[i, k]
        if t.size:
            semihard[i, k] = t[t > 0].min() if np.any(t > 0) else t.max()
        hinge[i, k] = np.maximum(MARGIN - t, 0.0).sum()
    return semihard, hinge


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", [None, 3])
def test_mining_matches_the_brute_force(mode, block):
    weights = np.random.default_rng(9).normal(size=(7, 11))
    weighted = lambda fn: lambda x: ops.sum(fn(x) * ops.convert_to_tensor(weights, DTYPE))
    for seed in range(3):
        d, positives, negatives = _case(seed)
        semihard, hinge = _brute(d, positives, negatives)
        mined = (lambda x, p=positives, n=negatives: semihard_gaps(x, p, n, block),
                 lambda x, p=positives, n=negatives: hinge_sums(x, p, n, MARGIN, block))
        for which, (fn, want) in enumerate(zip(mined, (semihard, hinge))):
            value, grad = value_and_grad(weighted(fn), d.astype(DTYPE), mode)
            np.testing.assert_allclose(value, np.sum(want * weights), rtol=LOSS_RTOL)
            # the brute force's gradient, by central differences (no sample sits at a kink)
            fd = np.zeros_like(d)
            for idx in np.ndindex(*d.shape):
                up, down = d.copy(), d.copy()
                up[idx] += 1e-6
                down[idx] -= 1e-6
                values = [np.sum(_brute(x, positives, negatives)[which] * weights)
                          for x in (up, down)]
                fd[idx] = (values[0] - values[1]) / 2e-6
            np.testing.assert_allclose(grad, fd, rtol=0,
                                       atol=max(1e-6, GRAD_RTOL) * np.abs(fd).max())
            assert np.all(grad[0] == 0.0)  # the query without negatives: no gradient
