"""RecallAtKLoss (RS@k) and its SiMix against the authors' code (tests/goldens/recall_at_k.json),
on the backend the tests run on (TensorFlow, JAX, PyTorch).

The goldens were computed on unit-norm X without re-normalising it, so
``normalize=False`` must give their full gradient and ``normalize=True`` its tangential
part (``G - (G·x)x``). Both tau2 conventions: ``tau2_1`` (paper, current code) and
``tau2_k`` (the code of 2022-2024).

The tests marked ``tensorflow`` use TensorFlow APIs and run in the TensorFlow run only:
RecallAtKLoss (TensorFlow only): a dense NumPy reference of the formula for the settings
the goldens do not cover (the query left out of the ranking, several blocks), argument
errors, the config round trip, sample weights under SiMix, and one MultiStageModel step
with SiMix equal to the single-pass step.

The goldens from the authors' code are checked on every backend in
tests/losses/test_recall_at_k.py.
"""

import functools
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support.backend import (
    BACKEND,
    DTYPE,
    FLOAT64,
    GRAD_RTOL,
    LOSS_RTOL,
    MODES,
    load_golden,
    to_numpy,
    value_and_grad,
)
from tests.support.exactness import (
    assert_weights_close,
    build_exactness_model,
    make_batch,
    max_abs_diff,
    plain_fit,
)
from tfaploss.losses import RecallAtKLoss
from tfaploss.ops.recall_rank import simix_coefficients, simix_pairs
from tfaploss.training import MultiStageModel

GOLDEN = load_golden("recall_at_k.json")
TAU2 = {"tau2_1": 1.0, "tau2_k": [1, 2, 4, 8, 16]}


def _inputs(case):
    data = GOLDEN[case]
    return np.asarray(data["X"], dtype=np.float64), np.asarray(data["y"])


def _tangential(grad, x):
    return grad - np.sum(grad * x, axis=1, keepdims=True) * x


def _assert_grad(grad, golden):
    np.testing.assert_allclose(grad, golden, rtol=0,
                               atol=GRAD_RTOL * max(np.abs(golden).max(), 1e-3))


# Tracing and compiling cost seconds. TensorFlow and PyTorch run every combination
# eagerly, one also in TensorFlow's graph and XLA modes. JAX's eager mode compiles each op
# for each input size (~5 s per size), so there every golden input is evaluated in one
# ``jax.jit`` holding all its settings (one compile per input size; its eager mode is
# checked by test_per_query_terms_and_singletons).
FIRST = "jit" if BACKEND == "jax" else "eager"
OTHER_MODES = [mode for mode in MODES if mode not in (FIRST, "eager")]


def _values_and_grads(fns, x, mode):
    """``value_and_grad`` of each of ``fns`` at ``x``, as NumPy; on JAX under "jit",
    all of them in one compiled call."""
    if BACKEND == "jax" and mode == "jit":
        import jax

        run = jax.jit(lambda z: [jax.value_and_grad(fn)(z) for fn in fns])
        return [(np.asarray(v), np.asarray(g)) for v, g in run(jax.numpy.asarray(x))]
    return [value_and_grad(fn, x, mode) for fn in fns]


def _forward(fn, x):
    """``fn(x)`` as NumPy; compiled on JAX (see FIRST)."""
    if BACKEND == "jax":
        import jax

        return np.asarray(jax.jit(fn)(jax.numpy.asarray(x)))
    return to_numpy(fn(x))


# Settings (tau2, normalize) evaluated on each golden input in the mode FIRST.
SETTINGS = {"small": (("tau2_1", False), ("tau2_k", False), ("tau2_1", True)),
            "mixed_sizes": (("tau2_1", False), ("tau2_k", False)),
            "large": (("tau2_1", False), ("tau2_k", False))}


@functools.cache
def _runs(case, mode, settings=None):
    """``{(tau2 key, normalize): (value, grad)}`` on golden input ``case``."""
    x, y = _inputs(case)
    settings = settings or SETTINGS[case]

    def loss_fn(key, normalize):
        loss = RecallAtKLoss(tau2=TAU2[key], normalize=normalize, dtype=DTYPE)
        return lambda z: loss(y, z)

    fns = [loss_fn(key, normalize) for key, normalize in settings]
    return dict(zip(settings, _values_and_grads(fns, x, mode)))


FULL_GRADIENT = [(case, key, FIRST) for case in ("small", "mixed_sizes")
                 for key in sorted(TAU2)] + [("small", "tau2_k", mode)
                                             for mode in OTHER_MODES]


@pytest.mark.parametrize(("case", "key", "mode"), FULL_GRADIENT)
def test_loss_and_full_gradient(case, key, mode):
    """``small``: 6 classes x 4 with score ties; ``mixed_sizes``: classes of 1 to 8
    items in shuffled order, two singletons (left out; NaN in the authors' code)."""
    x, _ = _inputs(case)
    ref = GOLDEN[case][key]
    golden = np.asarray(ref["grad"])
    runs = _runs(case, mode, None if mode == FIRST else ((key, False),))
    value, grad = runs[(key, False)]
    np.testing.assert_allclose(value, ref["loss"], rtol=LOSS_RTOL)
    _assert_grad(grad, golden)
    if (case, key, mode) != ("small", "tau2_1", FIRST):
        return
    value, grad = runs[(key, True)]
    np.testing.assert_allclose(value, ref["loss"], rtol=LOSS_RTOL)
    _assert_grad(grad, _tangential(golden, x))


def test_per_query_terms_and_singletons():
    x, y = _inputs("mixed_sizes")
    ref = GOLDEN["mixed_sizes"]["tau2_1"]["per_query"]
    # eager on every backend (JAX's eager mode included)
    terms = to_numpy(RecallAtKLoss(normalize=False, reduction="none", dtype=DTYPE)(y, x))
    lone = np.array([v is None for v in ref])
    assert lone.sum() == 2
    np.testing.assert_array_equal(terms[lone], 0.0)
    np.testing.assert_allclose(terms[~lone], np.array([v for v in ref if v is not None]),
                               rtol=LOSS_RTOL)


@pytest.mark.parametrize("key", sorted(TAU2))
def test_large_batch_256(key):
    x, _ = _inputs("large")
    ref = GOLDEN["large"][key]
    w = np.random.default_rng(99).standard_normal(x.shape)
    value, grad = _runs("large", FIRST)[(key, False)]
    np.testing.assert_allclose(value, ref["loss"], rtol=LOSS_RTOL)
    rtol = 1e-9 if FLOAT64 else 1e-4
    np.testing.assert_allclose(np.linalg.norm(grad), ref["grad_norm"], rtol=rtol)
    np.testing.assert_allclose(np.sum(grad * w), ref["grad_proj"], rtol=0,
                               atol=rtol * ref["grad_norm"] * np.linalg.norm(w))


SIMIX = [(m, key, FIRST) for m in (4, 3) for key in sorted(TAU2)] + [
    (4, "tau2_1", mode) for mode in OTHER_MODES[-1:]]


@functools.cache
def _simix_runs(m, mode, keys=None):
    """``{tau2 key: (value, grad)}`` of the authors' SiMix batch with ``m`` per class."""
    keys = keys or tuple(sorted(TAU2))
    case = GOLDEN[f"simix_m{m}"]
    x, y = np.asarray(case["X"]), np.asarray(case["y"])

    def loss_fn(key):
        loss = RecallAtKLoss(tau2=TAU2[key], normalize=False, dtype=DTYPE)
        return lambda z: loss.mixed_loss(y, z, case["alphas"], case["first"],
                                         case["second"])

    return dict(zip(keys, _values_and_grads([loss_fn(key) for key in keys], x, mode)))


@pytest.mark.parametrize(("m", "key", "mode"), SIMIX)
def test_simix_with_the_authors_coefficients(m, key, mode):
    """``pos_mixup``'s pairs and coefficients (np.random, seed 7) given explicitly."""
    case = GOLDEN[f"simix_m{m}"]
    value, grad = _simix_runs(m, mode, *([] if mode == FIRST else [(key,)]))[key]
    np.testing.assert_allclose(value, case[key]["loss"], rtol=LOSS_RTOL)
    _assert_grad(grad, np.asarray(case[key]["grad"]))


@pytest.mark.parametrize("m", [4])
def test_simix_own_pairs_are_the_authors_pairs(m):
    """With m per class, the loss's own pairing mixes exactly the authors' pairs; with
    the coefficients matched pair by pair the loss is the authors'."""
    case = GOLDEN[f"simix_m{m}"]
    x, y = np.asarray(case["X"]), np.asarray(case["y"])
    first, second, valid = (to_numpy(t) for t in simix_pairs(keras.ops.convert_to_tensor(y),
                                                              m))
    assert valid.all()
    ours = [tuple(sorted(p)) for p in zip(first.tolist(), second.tolist())]
    theirs = {tuple(sorted(p)): i for i, p in enumerate(zip(case["first"], case["second"]))}
    assert sorted(ours) == sorted(theirs)
    alphas = np.asarray(case["alphas"])
    # pos_mixup weighs its first index by alpha; flip where our order differs.
    mine = np.array([alphas[theirs[tuple(sorted(p))]] if p[0] == case["first"][
        theirs[tuple(sorted(p))]] else 1 - alphas[theirs[tuple(sorted(p))]]
        for p in zip(first.tolist(), second.tolist())])
    loss = RecallAtKLoss(normalize=False, simix_group=m, dtype=DTYPE)
    value = _forward(lambda z: loss.mixed_loss(y, z, mine), x)
    np.testing.assert_allclose(value, case["tau2_1"]["loss"], rtol=LOSS_RTOL)


_M32 = 0xFFFFFFFF


def _mix32(x):
    """NumPy ``lowbias32`` on uint64 arrays of 32-bit words (the reference of the ops')."""
    x = np.asarray(x, np.uint64) & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _M32
    return x ^ (x >> np.uint64(16))


def _reference_coefficients(x, y, num, seed):
    """simix_coefficients written out in NumPy with unsigned 64-bit arithmetic."""
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    cells = np.floor(np.clip(x, -1, 1) * 1024).astype(np.int64).ravel()

    def cell_hash(values, salt):
        index = np.arange(values.size, dtype=np.uint64)
        return int(np.sum(_mix32(_mix32(index + np.uint64(salt))
                                 ^ (values.astype(np.int64) & _M32).astype(np.uint64)))
                   & _M32)

    batch = (cell_hash(cells, 0x3C6EF372) + cell_hash(np.asarray(y), 0xA54FF53A)) & _M32
    key = int(_mix32(_mix32(batch) ^ _mix32((seed ^ 0x510E527F) & _M32)))
    counter = (np.arange(num, dtype=np.uint64) * np.uint64(0x9E3779B9)) & _M32
    bits = _mix32(_mix32(((counter + np.uint64(key)) & _M32) ^ np.uint64(0x1F83D9AB)))
    return ((bits >> np.uint64(9)).astype(np.float64) + 0.5) / 2.0 ** 23


def _coefficients(x, y, num, seed):
    return to_numpy(simix_coefficients(keras.ops.convert_to_tensor(x, DTYPE),
                                       keras.ops.convert_to_tensor(y), num, seed))


def test_simix_coefficients_match_the_numpy_hash():
    """The int32 wrap-around arithmetic gives the unsigned hash's bits on this backend
    (so the same coefficients on TensorFlow, JAX and PyTorch)."""
    case = GOLDEN["simix_m4"]
    x, y = np.asarray(case["X"]), np.asarray(case["y"])
    for seed in (0, 3, 2**32 - 1):
        np.testing.assert_array_equal(_coefficients(x, y, 36, seed),
                                      _reference_coefficients(x, y, 36, seed))


def test_simix_coefficients_look_uniform_and_change_with_the_batch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 16))
    y = np.repeat(np.arange(16), 4)
    many = _coefficients(x, y, 200_000, 7)
    assert 0 < many.min() and many.max() < 1
    assert abs(many.mean() - 0.5) < 3e-3  # standard error 6.5e-4
    assert abs(many.std() - 1 / np.sqrt(12)) < 3e-3
    counts = np.histogram(many, bins=20, range=(0, 1))[0]
    assert np.all(np.abs(counts / 10_000 - 1) < 0.05)  # 10000 per bin, sd 1%
    assert abs(np.corrcoef(many[:-1], many[1:])[0, 1]) < 0.01
    # one step of training moves the embeddings: new coefficients, unrelated to the old
    base = _coefficients(x, y, 96, 7)
    steps = [_coefficients(x + 0.01 * rng.standard_normal(x.shape), y, 96, 7)
             for _ in range(20)]
    steps += [_coefficients(x, y, 96, seed) for seed in range(8, 28)]
    steps += [_coefficients(x, np.roll(y, 4), 96, 7)]
    for other in steps:
        assert np.mean(np.abs(other - base)) > 0.2  # 1/3 for independent draws
    firsts = np.array([s[0] for s in steps])
    assert abs(firsts.mean() - 0.5) < 0.2
    # rounding noise (a chunked forward pass) leaves them alone
    np.testing.assert_array_equal(_coefficients(x * (1 + 1e-12), y, 96, 7), base)


@pytest.mark.parametrize("mode", [FIRST, *OTHER_MODES])
def test_simix_draws_its_coefficients_from_the_batch(mode):
    """``simix=True`` mixes with ``simix_coefficients`` of the batch, in every mode (a
    bare ``jax.jit`` included): the same call twice gives the same loss and gradient, a
    different seed a different one."""
    case = GOLDEN["simix_m4"]
    x, y = np.asarray(case["X"]), np.asarray(case["y"])
    loss = RecallAtKLoss(simix=True, simix_group=4, seed=3, normalize=False, dtype=DTYPE)
    alphas = loss.simix_coefficients(y, x)
    np.testing.assert_array_equal(to_numpy(alphas), _reference_coefficients(x, y, 36, 3))
    plain = RecallAtKLoss(normalize=False, dtype=DTYPE)
    other = RecallAtKLoss(simix=True, simix_group=4, seed=4, normalize=False, dtype=DTYPE)
    # In one trace too: a stateful draw would give the two calls different coefficients.
    *runs, (value, grad), (other_value, _) = _values_and_grads(
        [lambda z: loss(y, z), lambda z: loss(y, z),
         lambda z: plain.mixed_loss(y, z, alphas), lambda z: other(y, z)], x, mode)
    for run_value, run_grad in runs:
        np.testing.assert_allclose(run_value, value, rtol=LOSS_RTOL)
        _assert_grad(run_grad, grad)
    assert abs(float(other_value) - float(value)) > 1e-4


# --------------------------------------------------------------------------------------
# TensorFlow only
# --------------------------------------------------------------------------------------

BATCH = 12


def _sig(t, tau):
    return 1.0 / (1.0 + np.exp(-np.clip(t / tau, -50, 50)))


def dense_recall_loss(x, y, ks=(1, 2, 4, 8, 16), tau1=0.01, tau2=1.0, include_self=True):
    """The formula written out per query and positive (O(B^3), small B only)."""
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = x @ x.T
    b = len(y)
    tau2 = [tau2] * len(ks) if np.isscalar(tau2) else tau2
    losses = []
    for i in range(b):
        pos = [p for p in range(b) if p != i and y[p] == y[i]]
        if not pos:
            continue
        cand = [j for j in range(b) if include_self or j != i]
        ranks = {p: 1 + sum(_sig(s[i, j] - s[i, p], tau1) for j in cand if j != p)
                 for p in pos}
        recall = 0.0
        for k, t2 in zip(ks, tau2):
            k = min(k, b)
            hits = sum(_sig(k - ranks[p], t2) for p in pos)
            recall += min(hits, k) / min(k, len(pos))
        losses.append(1 - recall / len(ks))
    return np.mean(losses)


@pytest.mark.tensorflow
@pytest.mark.parametrize("include_self", [True, False])
def test_matches_dense_reference_with_several_blocks(include_self):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((20, 6))
    y = rng.integers(0, 5, 20)  # unsorted labels, uneven classes
    x[4] = x[9]  # a tie
    ks = (1, 2, 4, 8)
    loss = RecallAtKLoss(ks, tau1=0.05, tau2=[1, 2, 4, 8],
                         include_self=include_self, pairs_per_block=7, dtype="float64")
    expected = dense_recall_loss(x, y, ks, 0.05, [1, 2, 4, 8], include_self)
    np.testing.assert_allclose(float(loss(y, x)), expected, rtol=1e-12)
    # the query's own score shifts every rank by about one: the two settings differ
    other = dense_recall_loss(x, y, ks, 0.05, [1, 2, 4, 8], not include_self)
    assert abs(other - expected) > 1e-3


@pytest.mark.tensorflow
def test_gradient_matches_central_differences():
    rng = np.random.default_rng(4)
    x = tf.constant(rng.standard_normal((10, 4)))
    y = np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])
    loss = RecallAtKLoss(k=(1, 2, 4), tau1=0.3, dtype="float64")
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = loss(y, x)
    grad = tape.gradient(value, x).numpy()
    numeric = np.zeros_like(grad)
    eps = 1e-6
    for idx in np.ndindex(*grad.shape):
        d = np.zeros(grad.shape)
        d[idx] = eps
        numeric[idx] = (dense_recall_loss(x.numpy() + d, y, (1, 2, 4), 0.3)
                        - dense_recall_loss(x.numpy() - d, y, (1, 2, 4), 0.3)) / (2 * eps)
    np.testing.assert_allclose(grad, numeric, atol=1e-7 * np.abs(numeric).max() + 1e-9)
    assert np.abs(grad).max() > 1e-3


@pytest.mark.tensorflow
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"k": []}, "k must be"), ({"k": [0, 1]}, "k must be"), ({"k": [1.5]}, "k must be"),
    ({"k": 4}, "k must be"), ({"k": [True]}, "k must be"),
    ({"tau1": 0}, "tau1"), ({"tau1": "0.01"}, "tau1"),
    ({"tau2": -1.0}, "tau2"), ({"tau2": [1, 2]}, "tau2"), ({"tau2": [1, 2, 4, 8, 0]}, "tau2"),
    ({"simix": 1}, "simix must"), ({"simix_group": 1}, "simix_group"),
    ({"seed": 1.5}, "seed"), ({"pairs_per_block": 0}, "pairs_per_block"),
])
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=f"RecallAtKLoss: {match}.*received"):
        RecallAtKLoss(**kwargs)


@pytest.mark.tensorflow
def test_call_errors():
    x = np.random.default_rng(0).standard_normal((8, 3))
    y = np.repeat(np.arange(2), 4)
    loss = RecallAtKLoss()
    with pytest.raises(ValueError, match="alphas must hold one coefficient per pair"):
        loss.mixed_loss(y, x, alphas=np.zeros(5))
    with pytest.raises(ValueError, match="first and second"):
        loss.mixed_loss(y, x, alphas=np.zeros(2), first=[0, 1])
    with pytest.raises(ValueError, match="first and second must be 1-D"):
        loss.mixed_loss(y, x, alphas=np.zeros(2), first=[0, 1], second=[2])
    with pytest.raises(ValueError, match="sample_weight must hold one weight per batch"):
        RecallAtKLoss(simix=True)(y, x, sample_weight=np.ones(5))
    with pytest.raises(ValueError, match="shape \\(batch, dim\\)"):
        RecallAtKLoss(simix=True)(y, x[None])
    with pytest.raises(ValueError, match="8 embeddings"):
        RecallAtKLoss(simix=True)(y[:6], x)


@pytest.mark.tensorflow
def test_config_round_trip():
    loss = RecallAtKLoss(k=[1, 4, 10], tau1=0.02, tau2=[1, 4, 10], include_self=False,
                         normalize=False, simix=True, simix_group=3, seed=11,
                         pairs_per_block=5, drop_lone_queries=True, name="rk")
    config = loss.get_config()
    params = set(inspect.signature(RecallAtKLoss.__init__).parameters) - {"self"}
    assert params <= set(config)
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(loss))
    assert isinstance(clone, RecallAtKLoss)
    assert clone.get_config() == config
    x = np.random.default_rng(1).standard_normal((9, 4))
    y = np.repeat(np.arange(3), 3)
    # same seed, same first draw of the mixing coefficients
    np.testing.assert_allclose(float(clone(y, x)), float(loss(y, x)), rtol=1e-6)


@pytest.mark.tensorflow
def test_simix_sample_weight_extends_to_mixed_items():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 4))
    y = np.repeat(np.arange(2), 4)
    w = rng.uniform(0.5, 2.0, 8)
    alphas = rng.uniform(size=12)
    loss = RecallAtKLoss(dtype="float64")
    terms = loss.mixed_loss(y, x, alphas)  # default reduction: mean of all 20 terms
    per_query = RecallAtKLoss(dtype="float64", reduction="none").mixed_loss(y, x, alphas)
    assert per_query.shape == (20,)
    np.testing.assert_allclose(float(terms), np.mean(per_query), rtol=1e-12)
    first = [0, 0, 0, 1, 1, 2, 4, 4, 4, 5, 5, 6]  # the loss's pairs: groups of 4
    second = [1, 2, 3, 2, 3, 3, 5, 6, 7, 6, 7, 7]
    weights = np.concatenate([w, (w[first] + w[second]) / 2])
    weighted = loss.mixed_loss(y, x, alphas, first, second, sample_weight=w)
    np.testing.assert_allclose(float(weighted), np.sum(weights * per_query) / 20,
                               rtol=1e-12)


def _simix_loss():
    # make_batch: 4 classes x 3 images; one SiMix group per class
    return RecallAtKLoss(simix=True, simix_group=3, seed=5, tau1=0.1)


@pytest.mark.tensorflow
@pytest.mark.parametrize("chunk_size", [1, 5])
def test_multistage_step_with_simix_equals_plain_step(chunk_size):
    initial = build_exactness_model().get_weights()
    images, labels = make_batch(BATCH)
    expected, plain_logs = plain_fit(initial, _simix_loss(), images, labels)
    assert max_abs_diff(initial, expected) > 1e-3
    without, _ = plain_fit(initial, RecallAtKLoss(tau1=0.1), images, labels)
    assert max_abs_diff(without, expected) > 1e-4  # the mixed items change the step
    model = build_exactness_model()
    model.set_weights(initial)
    wrapper = MultiStageModel(model, chunk_size=chunk_size)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=_simix_loss(),
                    run_eagerly=chunk_size == 1)  # chunk 5: graph mode
    logs = wrapper.fit(images, labels, batch_size=BATCH, epochs=1, shuffle=False,
                       verbose=0).history
    assert_weights_close(model.get_weights(), expected, rtol=1e-5, atol=1e-6)
    assert logs["loss"][0] == pytest.approx(plain_logs["loss"][0], rel=1e-5)


@pytest.mark.tensorflow
def test_simix_coefficients_under_xla_are_the_eager_ones():
    """No state: under XLA the loss mixes with ``simix_coefficients`` of the batch (the
    same bits as eagerly); the same batch twice gives the same loss, another batch
    other coefficients."""
    loss = RecallAtKLoss(simix=True, seed=0)
    x = tf.constant(np.random.default_rng(0).standard_normal((8, 4)), "float32")
    y = np.repeat(np.arange(2), 4)
    step = tf.function(lambda z: (loss(y, z), loss.simix_coefficients(y, z)),
                       jit_compile=True)
    value, alphas = step(x)
    np.testing.assert_array_equal(alphas.numpy(), loss.simix_coefficients(y, x).numpy())
    expected = float(RecallAtKLoss().mixed_loss(y, x, alphas))
    assert np.isfinite(expected)
    assert float(value) == pytest.approx(expected, rel=1e-6)
    assert float(step(x)[0]) == float(value)
    moved = step(x + 0.05)[1].numpy()
    assert np.mean(np.abs(moved - alphas.numpy())) > 0.1
