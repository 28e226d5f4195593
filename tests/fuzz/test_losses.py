"""Fuzz: every loss of ``tfaploss.losses``, on any finite batch.

Batches are drawn small (B <= 16, D <= 8) and hostile: ties and exact duplicates (rows
drawn from a small pool of directions), one class, all singletons, pairs, one item,
zero rows, row norms from 1e-6 to 1e6, and float16 / bfloat16 inputs. For each
``keras.losses.Loss`` that ``tfaploss.losses`` exports:

1. the value and its gradient are finite;
2. permuting the batch permutes nothing else: the same value, the gradient's rows
   permuted alike;
3. the reduction agrees with the per-query terms: ``reduction=None`` gives the terms
   that ``call`` returns (0 where masked), the default mean is their sum over the
   number of unmasked terms, and the gradient of that sum is the loss's gradient;
4. a float16 or bfloat16 batch gives the value of the same numbers in float32 (the
   losses compute in float32 whatever the input).

Left out, with the reason: the gradient is taken with respect to the float32 values of
a narrow batch, not the narrow tensor itself. A normalising loss's gradient grows as
``1 / |x|``, so for a float16 row of norm 1e-5 it is ~1e5, past float16's 65504: that
is the dtype's range, not the loss's, and a mixed-precision model keeps its loss input
in float32 for this reason. Gradients are compared within float32's resolution, which
the normalisation scales by ``1 / |x|`` per row (:func:`_close_grad`). ``XBMLoss`` has
no per-query terms of its own (it adds two reductions, the batch's and the memory's;
the wrapped loss's terms are checked under its own class), so property 3 is not asked
of it. The losses with a jump at a score tie (a sort, a hard step, hard mining, a
distance's kink: :data:`TIE_JUMPS`) are asked property 2 only for batches without
ties: float32 matrix products round one pair's score differently (by one ulp) at
different positions in the batch, and at a tie that decides the step.
``BlackBoxAPLoss``'s backward perturbs the scores by lambda x the incoming gradient, so
it is not linear in that gradient and the gradient half of property 3 is not asked of
it either.

Backend-agnostic (``keras.ops`` and :mod:`tests.support.backend`): ``make fuzz`` also
runs this module on PyTorch, and on JAX with three batch shapes (:data:`JAX_SHAPES`;
JAX compiles every op again for each new shape) and without ``XBMLoss`` (whose memory
must be part of a trained model on JAX).
"""

from __future__ import annotations

import inspect
import warnings

import keras
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from keras.src.backend import get_keras_mask  # the mask Keras reads from a loss's terms

import tfaploss.losses as losses_module
from tests.fuzz import harness
from tests.fuzz.profiles import examples
from tests.support.backend import BACKEND, NUM_PROXIES, PROXY_LOSSES, make_loss, to_numpy
from tests.support.backend import value_and_grad as _value_and_grad
from tests.support.timing import speed_factor

LOSS_CLASSES = sorted(
    (obj for name in losses_module.__all__
     if inspect.isclass(obj := getattr(losses_module, name))
     and issubclass(obj, keras.losses.Loss) and obj is not losses_module.RetrievalLoss),
    key=lambda cls: cls.__name__)
MAX_BATCH, MAX_DIM = 16, 8
# On JAX every new shape compiles every op again (seconds a case; the 57 cases of the
# short slice took 9 minutes with free shapes), so there the batches take these shapes.
JAX_SHAPES = ((1, 1), (5, 3), (16, 8))
# float16 holds up to 65504: its rows stay below 10**4.5 (the components of a row are
# at most its norm).
LOG_NORMS = {"float32": (-6.0, 6.0), "float16": (-6.0, 4.5), "bfloat16": (-6.0, 6.0)}
NARROW = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Losses with a jump at a score tie: a hard step or a sort (BlackBox), the smoothed
# upper step that starts at 0.5 (SupAP and the losses built on it), hard mining
# (Triplet, MultiSimilarity), the Euclidean distance's kink at 0 (Contrastive: the
# gradient of a negative pair at distance ~1e-4 is ~1e4, at exactly 0 it is 0). At an
# exact tie their value or gradient depends on which side of the tie each score falls,
# and float32 matrix products round the same pair's score differently (by 1 ulp) at
# different positions in the batch, so the permutation property is asked of them only
# for batches without ties.
TIE_JUMPS = {"BlackBoxAPLoss", "ContrastiveLoss", "HAPLoss", "MultiSimilarityLoss",
             "ROADMAPLoss", "SupAPLoss", "SupNDCGLoss", "SupRecallLoss", "TripletLoss"}
# Losses whose backward is not linear in the incoming gradient: BlackBox perturbs the
# scores by lambda x the incoming gradient, so the gradient of the mean is not the
# gradient of the sum divided by the count (as in the original).
NONLINEAR_BACKWARD = {"BlackBoxAPLoss"}
# Losses whose rows must have a fixed width: XBM's memory and the proxies hold MAX_DIM
# columns, so their batches are padded with zero columns.
FIXED_WIDTH = {"XBMLoss", *PROXY_LOSSES}
SOFT_S = 60.0  # a case: ~7 loss calls of a 16 x 8 batch, ~0.1 s on an idle core (on
# JAX several seconds while each new shape compiles): a bound on hangs only

_SPEED = speed_factor()


def _make(cls, **kwargs):
    """A deterministic instance (BlackBox's random margin off; a memory bank of 8
    slots for XBM)."""
    if cls.__name__ == "XBMLoss":
        return cls(losses_module.SmoothAPLoss(**kwargs), size=8, embedding_dim=MAX_DIM)
    if cls.__name__ == "BlackBoxAPLoss":
        kwargs["margin"] = 0.0
    return make_loss(cls, proxy_dim=MAX_DIM, **kwargs)


@st.composite
def batches(draw, proxies: bool = False):
    """``(labels, rows in their dtype, dtype, what)``: a hostile batch (module
    docstring); ``proxies``: labels below NUM_PROXIES (a proxy loss's classes)."""
    if BACKEND == "jax":  # JAX compiles each op per shape: a few shapes, hostile contents
        size, dim = draw(st.sampled_from(JAX_SHAPES))
    else:
        size = draw(st.integers(1, MAX_BATCH))
        dim = draw(st.integers(1, MAX_DIM))
    kind = draw(st.sampled_from(["random", "one class", "singletons", "pairs"]))
    if kind == "random":
        classes = draw(st.integers(1, size))
        labels = np.array(draw(st.lists(st.integers(0, classes - 1), min_size=size,
                                        max_size=size)))
    else:
        labels = {"one class": np.zeros(size), "singletons": np.arange(size),
                  "pairs": np.arange(size) // 2}[kind].astype(int)
    if proxies:
        labels = labels % NUM_PROXIES
    # Rows are drawn from a pool of directions: a small pool makes ties and duplicates.
    pool = draw(st.integers(1, size))
    directions = draw(hnp.arrays(np.float64, (pool, dim), elements=st.sampled_from(
        [0.0, 1.0, -1.0, 0.5]) | st.floats(-1, 1, allow_nan=False, width=32)))
    rows = directions[np.array(draw(st.lists(st.integers(0, pool - 1), min_size=size,
                                             max_size=size)))]
    dtype = draw(st.sampled_from(sorted(LOG_NORMS)))
    low, high = LOG_NORMS[dtype]
    log_norms = np.array(draw(st.lists(st.sampled_from([low, -3.0, 0.0, 3.0, high])
                                       | st.floats(low, high), min_size=size,
                                       max_size=size)))
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    scaled = np.where(norms > 0, rows / np.where(norms > 0, norms, 1.0), 0.0)
    x = scaled * 10.0 ** log_norms[:, None]
    x = x.astype(NARROW.get(dtype, np.float32))
    what = (f"B={size} D={dim} {kind} pool={pool} {dtype} norms "
            f"1e{log_norms.min():.1f}..1e{log_norms.max():.1f}")
    return labels, x, dtype, what


def value_and_grad(loss, labels, x):
    with warnings.catch_warnings():
        # A batch without positives warns (once); a lone-query warning may follow.
        warnings.simplefilter("ignore")
        return _value_and_grad(lambda z: _called(loss, labels, z), x)


def _called(loss, labels, x):
    if isinstance(loss, losses_module.XBMLoss):
        # Evaluation mode: the memory is read, not written, so every call sees the
        # same memory (filled once by the test).
        loss.memory(x, training=False)
    return loss(labels, x)


def _fill_memory(loss, rng):
    """A memory bank of 8 past rows for an XBMLoss (nothing for the others)."""
    if isinstance(loss, losses_module.XBMLoss):
        past = rng.normal(size=(8, MAX_DIM)).astype("float32")
        loss.memory(past, training=True)
        loss(np.arange(8) % 3, past)


def _close(a, b, what, scale=None):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = float(np.max(np.abs(b))) if scale is None else scale
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 + 1e-4 * scale, err_msg=what)


def _close_grad(a, b, x, unit_grad, what):
    """Gradients that agree up to float32 rounding. Normalising row i multiplies the
    gradient that reaches it (``unit_grad``, the gradient with respect to the unit
    rows) by a Jacobian of size 1 / |x_i| whose terms cancel (exactly, for D = 1): a
    row of norm 1e-6 carries rounding noise of ~1e-7 x 1e6 x that gradient, whatever
    its true gradient, and a zero row 1e12 x (the normalisation's epsilon). Each row's
    tolerance scales with it."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    norms = np.linalg.norm(np.asarray(x, np.float64), axis=1, keepdims=True)
    # At least 1: where the loss is flat its gradient is rounding noise of the inner
    # derivatives (sigmoids of temperature 0.01, bins), which one reduction may give
    # as exact zeros and another not.
    reaching = max(float(np.max(np.abs(unit_grad))), 1.0)
    # A zero row is normalised with a slope of 1 / 1e-12 (tfaploss.ops.masks).
    noise = 1e-5 * len(x) * reaching / np.maximum(norms, 1e-12)
    bound = 1e-4 * np.abs(b) + 1e-5 + 1e-4 * float(np.max(np.abs(b))) + noise
    bad = np.abs(a - b) > bound
    assert not bad.any(), (f"{what}: rows {np.flatnonzero(bad.any(axis=1)).tolist()} "
                           f"differ:\n{a[bad.any(axis=1)]}\nagainst\n{b[bad.any(axis=1)]}")


def _unit(x):
    norms = np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    return (x / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def _has_ties(x):
    """Whether two items score alike (within float32 rounding) against some query."""
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)
    scores = np.sort(unit.astype(np.float64) @ unit.T.astype(np.float64), axis=1)
    return bool(np.any(np.diff(scores, axis=1) < 1e-5))


def _pad(x):
    """Rows widened to MAX_DIM with zeros (an XBM memory has MAX_DIM columns)."""
    return np.pad(x, ((0, 0), (0, MAX_DIM - x.shape[1])))


@pytest.mark.parametrize("cls", LOSS_CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=examples("losses"))
@given(data=st.data())
def test_any_finite_batch(cls, data):
    if BACKEND == "jax" and cls.__name__ == "XBMLoss":
        pytest.skip("on JAX an XBMLoss must sit in the model that is trained, so that its "
                    "memory is threaded through the step (XBMLoss refuses a bare trace)")
    labels, narrow, dtype, what = data.draw(batches(proxies=cls.__name__ in PROXY_LOSSES))
    x = narrow.astype(np.float32)
    if cls.__name__ in FIXED_WIDTH:
        x, narrow = _pad(x), _pad(narrow)
    order = np.array(data.draw(st.permutations(range(len(labels)))))
    rng = np.random.default_rng(0)
    with harness.case(f"losses/{BACKEND}", soft_s=SOFT_S * _SPEED, label=what) as case:
        loss = _make(cls)
        _fill_memory(loss, rng)
        value, grad = value_and_grad(loss, labels, x)
        assert np.isfinite(value).all() and np.isfinite(grad).all(), (what, value, grad)
        case.outcome = "zero" if float(value) == 0 else "finite"

        # The gradient that reaches the normalisation, for the gradients' tolerance.
        _, unit_grad = value_and_grad(loss, labels, _unit(x))
        if cls.__name__ not in TIE_JUMPS or not _has_ties(x):
            permuted, permuted_grad = value_and_grad(loss, labels[order], x[order])
            _close(permuted, value, f"permuted value: {what}", scale=1.0)
            _close_grad(permuted_grad, grad[order], x[order], unit_grad,
                        f"permuted gradient: {what}")

        if dtype != "float32":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from_narrow = to_numpy(_called(loss, labels, keras.ops.convert_to_tensor(
                    narrow) if BACKEND != "torch" else _torch_narrow(narrow)))
            _close(from_narrow, value, f"{dtype} input: {what}", scale=1.0)

        if cls.__name__ != "XBMLoss":
            _check_reduction(cls, loss, labels, x, value, grad, unit_grad, what)


def _torch_narrow(x):
    import torch

    dtype = torch.float16 if x.dtype == np.float16 else torch.bfloat16
    return torch.tensor(x.astype(np.float32)).to(dtype)


def _check_reduction(cls, loss, labels, x, value, grad, unit_grad, what):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        terms = loss.call(labels, x)
        mask = get_keras_mask(terms)
        terms = to_numpy(terms)
        mask = np.ones(terms.shape, bool) if mask is None else to_numpy(mask).astype(bool)
        none = to_numpy(_make(cls, reduction=None)(labels, x))
    assert np.all(terms[~mask] == 0), (what, terms, mask)
    _close(none, terms, f"reduction=None against call(): {what}", scale=1.0)
    count = max(int(mask.sum()), 1)
    _close(value, terms.sum() / count, f"mean against the terms: {what}", scale=1.0)

    summed = _make(cls, reduction="sum")
    total, total_grad = value_and_grad(summed, labels, x)
    _close(total, terms.sum(), f"reduction='sum' against the terms: {what}", scale=1.0)
    if cls.__name__ in NONLINEAR_BACKWARD:
        return
    _close_grad(grad, total_grad / count, x, unit_grad,
                f"gradient of the mean against the sum's: {what}")
