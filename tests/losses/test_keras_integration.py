"""Keras integration of EVERY loss class exported by ``tfaploss.losses``.

compile + fit, serialisation (config and a saved ``.keras`` model), ``tf.function``
with and without XLA, input validation, degenerate batches, permutation equivariance.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfaploss.losses as losses_module
from tfaploss.losses.base import RetrievalLoss

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only

LOSS_CLASSES = sorted(
    (obj for name in losses_module.__all__
     if inspect.isclass(obj := getattr(losses_module, name))
     and issubclass(obj, RetrievalLoss) and obj is not RetrievalLoss),
    key=lambda cls: cls.__name__,
)
# Losses whose value on an all-positive batch is not 0 by definition: pair/calibration
# terms still pull positives together; the authors' tie-aware AP uses a logarithmic
# approximation that is not exactly 1 on an all-positive list.
NOT_ZERO_ON_ALL_POSITIVE = {"ContrastiveLoss", "CalibrationLoss", "ROADMAPLoss",
                            "TieAwareAPLoss"}
# SupRecall's sigmoid of k - rank counts a positive at rank k only 1/2 (as its
# authors'), so an all-positive batch keeps a loss, but with no negative to push away
# its gradient is exactly 0.
ZERO_GRADIENT_ONLY_ON_ALL_POSITIVE = {"SupRecallLoss"}
# RS@k's "rank <= k" sigmoid has temperature 1 and the query itself counts in its
# positives' ranks (as its authors' code): an all-positive batch keeps a loss and a
# gradient that spreads the positives' ranks.
LOSS_AND_GRADIENT_ON_ALL_POSITIVE = {"RecallAtKLoss"}
# Losses that take (B, levels) labels (one column per level of a label hierarchy).
MULTI_LEVEL_LABELS = {"HAPLoss"}
# Losses whose positive term pulls positives together until they coincide (a
# multi-similarity positive has the margin ``base``, a proxy its class proxy): an
# all-positive batch keeps a loss and a gradient.
PULL_ON_ALL_POSITIVE = {"MultiSimilarityLoss", "ProxyAnchorLoss"}
# Losses that score the batch against learnable class proxies (labels are class ids
# 0..num_classes-1; the model holds the proxies): no pair is needed.
PROXY_LOSSES = {"ProxyAnchorLoss"}

params = pytest.mark.parametrize("cls", LOSS_CLASSES, ids=lambda c: c.__name__)


def _make(cls, num_classes=4, **kwargs):
    """``cls(**kwargs)``; a proxy loss with ``num_classes`` proxies given (seeded), so
    that it scores a batch outside a model."""
    if cls.__name__ not in PROXY_LOSSES:
        return cls(**kwargs)
    loss = cls(num_classes, **kwargs)
    loss.proxies_layer.set_proxies(np.random.default_rng(7).normal(size=(num_classes, 6)))
    return loss


def _deterministic(cls, **kwargs):
    """An instance without the stochastic parts (BlackBox's random margin)."""
    if "margin" in inspect.signature(cls).parameters and cls.__name__ == "BlackBoxAPLoss":
        kwargs.setdefault("margin", 0.0)
    return _make(cls, **kwargs)


def _toy_data(batches=2, classes=8, per_class=4, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim))
    labels = np.tile(np.repeat(np.arange(classes), per_class), batches)
    x = centres[labels] + 1.5 * rng.normal(size=(len(labels), dim))
    return x.astype("float32"), labels.astype("int32")


def _batch(seed=1, n=12, dim=6):
    rng = np.random.default_rng(seed)
    labels = np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3][:n])
    return rng.normal(size=(n, dim)), labels


def _value_and_grad(loss, labels, x):
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        value = loss(labels, xt)
    return value.numpy(), tape.gradient(value, xt).numpy()


@pytest.mark.slow
@params
def test_compile_fit_two_epochs_then_save_and_reload(cls, tmp_path):
    keras.utils.set_random_seed(0)
    x, y = _toy_data()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
    # The loss under XLA is covered by test_tf_function_matches_eager (cheaper).
    if cls.__name__ in PROXY_LOSSES:
        loss = cls(8)  # the proxies train as the model's last layer
        model = loss.with_proxies(model)
    else:
        loss = cls()
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss, jit_compile=False)
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    assert len(history["loss"]) == 2 and np.all(np.isfinite(history["loss"]))
    assert history["loss"][1] < history["loss"][0], history["loss"]

    path = tmp_path / "model.keras"
    model.save(path)
    reloaded = keras.models.load_model(path)
    assert type(reloaded.loss) is cls
    assert reloaded.loss.get_config() == model.loss.get_config()
    for w_reloaded, w in zip(reloaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(w_reloaded, w)


@params
def test_serialize_deserialize_round_trip(cls):
    loss = _make(cls)
    config = keras.losses.serialize(loss)
    restored = keras.losses.deserialize(config)
    assert type(restored) is cls
    assert restored.get_config() == loss.get_config()
    # Every constructor argument is in the config.
    args = set(inspect.signature(cls).parameters) - {"self"}
    assert args <= set(loss.get_config()), args - set(loss.get_config())
    det = _deterministic(cls, dtype="float64")
    x, labels = _batch()
    again = keras.losses.deserialize(keras.losses.serialize(det))
    np.testing.assert_allclose(again(labels, x).numpy(), det(labels, x).numpy(), rtol=1e-12)


@pytest.mark.slow
@params
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_tf_function_matches_eager(cls, jit_compile):
    loss = _deterministic(cls)
    x, labels = _batch()
    x = x.astype("float32")

    @tf.function(jit_compile=jit_compile, autograph=False)
    def step(labels, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = loss(labels, x)
        return value, tape.gradient(value, x)

    value, grad = step(tf.constant(labels), tf.constant(x))
    eager_value, eager_grad = _value_and_grad(loss, labels, x)
    np.testing.assert_allclose(value.numpy(), eager_value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad.numpy(), eager_grad, atol=1e-5 * max(np.abs(eager_grad).max(), 1))
    if jit_compile and cls.__name__ == "BlackBoxAPLoss":
        stochastic = cls(seed=1)
        noisy = tf.function(lambda l, e: stochastic(l, e), jit_compile=True)
        assert np.isfinite(noisy(tf.constant(labels), tf.constant(x)).numpy())


@params
def test_bad_labels_and_inputs_raise_clear_errors(cls):
    loss = _make(cls)
    x, labels = _batch()
    x = x.astype("float32")
    with pytest.raises(ValueError, match="float16"):
        loss(labels.astype("float16"), x)
    with pytest.raises(ValueError, match="dtype string"):
        loss(labels.astype(str), x)
    with pytest.raises(ValueError, match=r"shape \(12, 2(, 1)?\)"):
        two = np.stack([labels, labels], 1)
        loss(two[..., None] if cls.__name__ in MULTI_LEVEL_LABELS else two, x)
    with pytest.raises(ValueError, match="y_pred"):
        loss(labels, x[None])
    with pytest.raises(ValueError, match=r"sample_weight of shape \(11,\)"):
        loss(labels, x, sample_weight=np.ones(11))
    with pytest.raises(ValueError, match=r"sample_weight of shape \(12, 2\)"):
        loss(labels, x, sample_weight=np.ones((12, 2)))
    with pytest.raises(ValueError, match="bfloat16"):
        _make(cls, dtype="bfloat16")
    if cls.__name__ in PROXY_LOSSES:  # labels are class ids: 2**40 is refused
        with pytest.raises(ValueError, match="labels must be class ids in 0..3"):
            loss(labels.astype("int64") + 2**40, x)
        return
    # (B, 1) labels and large int64 ids that float32 would merge are fine.
    big = labels.astype("int64") + 2**40
    np.testing.assert_allclose(_deterministic(cls)(big[:, None], x).numpy(),
                               _deterministic(cls)(labels, x).numpy(), rtol=1e-6)


@params
def test_batch_without_positive_pair_gives_zero_loss_and_gradient(cls):
    x, _ = _batch()
    if cls.__name__ in PROXY_LOSSES:  # no pair needed: every item meets its proxy
        value, grad = _value_and_grad(_make(cls, 12, dtype="float64"), np.arange(12), x)
        assert value > 0.1 and np.abs(grad).max() > 1e-3
        return
    value, grad = _value_and_grad(cls(dtype="float64"), np.arange(12), x)
    assert value == 0.0
    assert np.all(grad == 0.0)


@params
def test_all_positive_batch(cls):
    x, _ = _batch()
    value, grad = _value_and_grad(_deterministic(cls, dtype="float64"), np.zeros(12, int), x)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    if cls.__name__ in ZERO_GRADIENT_ONLY_ON_ALL_POSITIVE:
        assert 0.0 < value < 1.0 and np.all(grad == 0.0)
        return
    if cls.__name__ in PULL_ON_ALL_POSITIVE:
        assert value > 0.01 and np.abs(grad).max() > 1e-4
        return
    if cls.__name__ in LOSS_AND_GRADIENT_ON_ALL_POSITIVE:
        assert 0.0 < value < 1.0 and np.abs(grad).max() > 1e-6
        return
    if cls.__name__ not in NOT_ZERO_ON_ALL_POSITIVE:
        assert abs(value) < 1e-9
        assert np.abs(grad).max() < 1e-9
    else:  # identical embeddings: nothing left to pull together
        same = np.tile(x[:1], (12, 1))
        value, grad = _value_and_grad(_deterministic(cls, dtype="float64"),
                                      np.zeros(12, int), same)
        assert abs(value) < 0.1 if cls.__name__ == "TieAwareAPLoss" else abs(value) < 1e-9
        assert np.all(np.isfinite(grad))


@params
def test_permutation_equivariance(cls):
    x, labels = _batch(seed=3)
    perm = np.random.default_rng(0).permutation(12)
    loss = _deterministic(cls, dtype="float64")
    value, grad = _value_and_grad(loss, labels, x)
    pvalue, pgrad = _value_and_grad(loss, labels[perm], x[perm])
    np.testing.assert_allclose(pvalue, value, rtol=1e-10)
    np.testing.assert_allclose(pgrad, grad[perm], atol=1e-10 * max(np.abs(grad).max(), 1))
    assert value > 0
