"""HAPLoss against HAPPIER's own ``HAPLoss`` (tests/goldens/hap.json), on the backend the
tests run on (TensorFlow, JAX, PyTorch): loss values, full gradients of the small cases,
gradient norm and projection of the B = 256 cases.

The goldens' relevance matrix went through float32 in the authors' code
(``get_relevances_pop``), so float64 results agree to ~1e-8, not to rounding: the
tolerance here is 1e-6 relative (1e-5 where the backend computes in float32).

The tests marked ``tensorflow`` use TensorFlow APIs and run in the TensorFlow run only:
HAPLoss on TensorFlow: serialization, argument errors, one level == SupAP, the base
class's conventions (mask, reduction, sample_weight, non-finite input), the clustering
term, the (B, levels) data path into ``model.fit``, and the hierarchical metrics.
"""

import json
import math
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfaploss.data as D
from tests.support import miniature as mini
from tests.support.backend import DTYPE, FLOAT64, MODES, load_golden, loss_value_and_grad
from tfaploss.config import ConfigError, config_from_dict
from tfaploss.evaluation import hierarchical_metrics
from tfaploss.losses import ClusterProxies, HAPLoss, SupAPLoss

GOLDENS = load_golden("hap.json")
RTOL = 1e-6 if FLOAT64 else 1e-5
# The B = 256 cases run compiled where the backend compiles (JAX's eager dispatch of
# the block loop's ops is slow; TensorFlow's XLA compile is too).
FAST = "jit" if "jit" in MODES else "eager"


def _case(name):
    case = GOLDENS["cases"][name]
    constants = GOLDENS["constants"][case["constants"]]
    return case, np.asarray(case["X"], np.float64), np.asarray(case["y"]), constants


def _projection_matrix(shape):
    return np.sin(np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + 1.0)


def _tangential(grad, x):
    return grad - np.sum(grad * x, axis=1, keepdims=True) * x


def test_goldens_cover_the_requested_settings():
    assert GOLDENS["commit"] == "5af91b3ac6c216a936232da33b42af7efaba5c6b"
    levels = {name: np.asarray(c["y"]).shape[1] for name, c in GOLDENS["cases"].items()}
    assert levels == {"A": 3, "B": 2, "C": 4, "N": 3}
    _, xb, yb, _ = _case("B")
    assert xb.shape[0] >= 256
    _, counts = np.unique(yb[:, 0], return_counts=True)
    assert (counts == 1).any()  # singleton fine classes
    scores = xb @ xb.T
    assert len(np.unique(scores[0])) < scores.shape[1] - 3  # exact ties


@pytest.mark.parametrize(("name", "mode"), [("A", mode) for mode in MODES] + [("N", FAST)])
def test_loss_and_full_gradient(name, mode):
    case, x, y, constants = _case(name)
    value, grad = loss_value_and_grad(HAPLoss(**constants, normalize=False, dtype=DTYPE),
                                      y, x, mode)
    golden = np.asarray(case["grad"])
    np.testing.assert_allclose(value, case["loss"], rtol=RTOL)
    np.testing.assert_allclose(grad, golden, rtol=0, atol=RTOL * np.abs(golden).max())


def test_normalize_true_matches_the_tangential_gradient():
    # The authors' loss takes the network's unit-norm output as is; re-normalising
    # removes the radial part of the gradient only.
    case, x, y, constants = _case("N")
    value, grad = loss_value_and_grad(HAPLoss(**constants, dtype=DTYPE), y, x, FAST)
    golden = np.asarray(case["grad"])
    np.testing.assert_allclose(value, case["loss"], rtol=RTOL)
    np.testing.assert_allclose(grad, _tangential(golden, x), rtol=0,
                               atol=RTOL * np.abs(golden).max())


@pytest.mark.parametrize("name", ["B", "C"])
def test_batch_256_loss_gradient_norm_and_projection(name):
    case, x, y, constants = _case(name)
    value, grad = loss_value_and_grad(HAPLoss(**constants, normalize=False, dtype=DTYPE),
                                      y, x, FAST)
    w = _projection_matrix(x.shape)
    np.testing.assert_allclose(value, case["loss"], rtol=RTOL)
    np.testing.assert_allclose(np.linalg.norm(grad), case["grad_norm"], rtol=RTOL)
    np.testing.assert_allclose(np.sum(grad * w), case["grad_projection"], rtol=0,
                               atol=RTOL * case["grad_norm"] * np.linalg.norm(w))


def test_small_blocks_give_the_same_loss_and_gradient():
    case, x, y, constants = _case("A")
    value, grad = loss_value_and_grad(
        HAPLoss(**constants, normalize=False, pairs_per_block=7, dtype=DTYPE), y, x, FAST)
    np.testing.assert_allclose(value, case["loss"], rtol=RTOL)
    golden = np.asarray(case["grad"])
    np.testing.assert_allclose(grad, golden, rtol=0, atol=RTOL * np.abs(golden).max())


def test_one_level_is_sup_ap():
    _, x, y, _ = _case("A")
    sup = loss_value_and_grad(SupAPLoss(offset=1.44, dtype=DTYPE), y[:, 0], x, FAST)
    for labels in (y[:, 0], y[:, :1]):
        hap = loss_value_and_grad(HAPLoss(offset=1.44, dtype=DTYPE), labels, x, FAST)
        np.testing.assert_allclose(hap[0], sup[0], rtol=1e-9 if FLOAT64 else 1e-5)
        np.testing.assert_allclose(hap[1], sup[1], rtol=0,
                                   atol=RTOL * np.abs(sup[1]).max())


# --------------------------------------------------------------------------------------
# TensorFlow only
# --------------------------------------------------------------------------------------

GOLDENS_TF = json.loads((Path(__file__).parents[1] / "goldens" / "hap.json").read_text())


def _case_tf(name):
    case = GOLDENS_TF["cases"][name]
    return (case, np.asarray(case["X"]), np.asarray(case["y"]),
            GOLDENS_TF["constants"][case["constants"]])


def _value_and_grad(loss, y, x, sample_weight=None):
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = loss(y, x, sample_weight=sample_weight)
    return value.numpy(), tape.gradient(value, x).numpy()


def _mask(loss, y, x):
    """The Keras mask ``call`` attaches to the per-query terms (the valid queries)."""
    return loss.call(y, x)._keras_mask.numpy()


# -- serialization and arguments ---------------------------------------------------------

@pytest.mark.tensorflow
def test_config_round_trip_and_serialization():
    loss = HAPLoss(tau=0.02, rho=50.0, delta=0.1, start=0.0, offset=1.0, alpha=2.0,
                   clustering_weight=0.1, num_classes=7, cluster_temperature=0.1,
                   include_self=False, normalize=False, pairs_per_block=64,
                   reduction="sum", name="h", dtype="float64", drop_lone_queries=True)
    config = loss.get_config()
    expected = {"tau": 0.02, "rho": 50.0, "delta": 0.1, "start": 0.0, "offset": 1.0,
                "alpha": 2.0, "clustering_weight": 0.1, "num_classes": 7,
                "cluster_temperature": 0.1, "include_self": False, "normalize": False,
                "pairs_per_block": 64, "reduction": "sum", "name": "h",
                "drop_lone_queries": True}
    for key, value in expected.items():
        assert config[key] == value, key
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(loss))
    assert isinstance(again, HAPLoss) and again.get_config() == config
    _, x, y, constants = _case_tf("A")
    a = HAPLoss(**constants, normalize=False, dtype="float64")
    b = HAPLoss.from_config(a.get_config())
    assert float(a(y, x)) == float(b(y, x))


@pytest.mark.tensorflow
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tau": 0}, "HAPLoss: tau must be a positive number; received 0"),
    ({"rho": -1.0}, "HAPLoss: rho must be a non-negative number; received -1.0"),
    ({"offset": "x"}, "HAPLoss: offset must be a number or None; received 'x'"),
    ({"alpha": 0.0}, "HAPLoss: alpha must be a number > 0; received alpha=0.0"),
    ({"clustering_weight": 1.0}, ("HAPLoss: clustering_weight must be a number >= 0 and "
                                  "< 1; received clustering_weight=1.0")),
    ({"clustering_weight": 0.1}, ("HAPLoss: num_classes must be a positive int when "
                                  "clustering_weight > 0; received num_classes=None")),
    ({"cluster_temperature": -1}, ("HAPLoss: cluster_temperature must be a number > 0; "
                                   "received cluster_temperature=-1")),
])
def test_bad_arguments_name_argument_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HAPLoss(**kwargs)


@pytest.mark.tensorflow
def test_bad_labels_name_the_argument_and_shape():
    x = np.random.default_rng(0).normal(size=(6, 4))
    with pytest.raises(ValueError, match=r"HAPLoss expects y_true of shape \(batch,\) or "
                                         r"\(batch, levels\).*\(6, 2, 1\)"):
        HAPLoss()(np.zeros((6, 2, 1), "int32"), x)
    with pytest.raises(ValueError, match="HAPLoss: y_true holds 5 labels but y_pred holds 6"):
        HAPLoss()(np.zeros((5, 2), "int32"), x)
    with pytest.raises(ValueError, match="dtype float16"):
        HAPLoss()(np.zeros((6, 2), "float16"), x)
    with pytest.raises(ValueError, match="dtype string"):
        HAPLoss()(np.zeros((6, 2), "int32").astype(str), x)
    # lists work as arrays do
    np.testing.assert_allclose(float(HAPLoss()([[0, 0], [0, 0], [1, 0], [1, 0], [2, 1], [3, 1]], x)),
                               float(HAPLoss()(np.array([[0, 0], [0, 0], [1, 0], [1, 0], [2, 1],
                                                         [3, 1]]), x)), rtol=1e-7)
    with pytest.raises(ValueError, match="received proxies_layer=.cluster_proxies., never "
                                         "called in a model"):
        HAPLoss(clustering_weight=0.1, num_classes=3)(np.zeros((6, 2), "int32"), x)


# -- values --------------------------------------------------------------------------------

@pytest.mark.tensorflow
def test_one_level_equals_sup_ap_per_query():
    _, x, y, _ = _case_tf("B")
    sup = SupAPLoss(offset=1.44, reduction="none")(y[:, 0], x).numpy()
    for labels in (y[:, 0], y[:, :1]):
        hap = HAPLoss(offset=1.44, reduction="none")(labels, x).numpy()
        np.testing.assert_allclose(hap, sup, rtol=2e-6, atol=1e-6)
    # and two levels differ from it: the super-class matters
    two = HAPLoss(offset=1.44, reduction="none")(y, x).numpy()
    assert np.abs(two - sup).max() > 1e-2


@pytest.mark.tensorflow
def test_golden_in_float32_and_graph_mode():
    case, x, y, constants = _case_tf("A")  # dyadic: the scores are exact in float32 too
    loss = HAPLoss(**constants, normalize=False)
    value = tf.function(lambda z: loss(y, z))(tf.constant(x, tf.float32))
    np.testing.assert_allclose(float(value), case["loss"], rtol=1e-5)


@pytest.mark.tensorflow
def test_unknown_batch_size_in_a_graph():
    case, x, y, constants = _case_tf("A")
    loss = HAPLoss(**constants, normalize=False)
    run = tf.function(lambda labels, e: loss(labels, e), input_signature=[
        tf.TensorSpec([None, 3], tf.int64), tf.TensorSpec([None, 16], tf.float32)])
    value = run(tf.constant(y, tf.int64), tf.constant(x, tf.float32))
    np.testing.assert_allclose(float(value), case["loss"], rtol=1e-5)


@pytest.mark.tensorflow
def test_ranking_by_level_gives_one_when_relevance_grows_with_level():
    # Query 0's fine class (2 items) scores above its super-class (4 items) above the
    # rest: w = (0, 1, 2), rel = 2/3 (fine, self counted), 1/4 (super): monotone, so
    # every H-rank equals rel_j * rank and H-AP = 1 (the smooth step of the far lower
    # items is sigmoid(-50) ~ 2e-22).
    x = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.6, 0.8], [0.6, 0.8], [0.6, 0.8],
                  [0.6, 0.8], [-1.0, 0.0], [-1.0, 0.0]])
    y = np.array([[0, 0], [0, 0], [0, 0], [1, 0], [2, 0], [1, 0], [3, 0], [4, 1], [4, 1]])
    terms = HAPLoss(normalize=False, reduction="none", dtype="float64")(y, x).numpy()
    assert terms[0] == pytest.approx(0.0, abs=1e-12)
    # an item ranked above its own class by a less relevant one costs: swap one
    x2 = x.copy()
    x2[7] = [1.0, 0.0]
    assert HAPLoss(normalize=False, reduction="none", dtype="float64")(y, x2).numpy()[0] > 0.05


@pytest.mark.tensorflow
def test_mask_reduction_sample_weight_and_non_finite():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(7, 5))
    # item 6 shares no level with anyone: without self-ranking it has no relevant item
    y = np.array([[0, 0], [0, 0], [1, 0], [2, 1], [2, 1], [3, 1], [9, 9]])
    loss = HAPLoss(include_self=False, reduction="none", dtype="float64")
    terms = loss(y, x)
    assert terms.shape == (7,) and float(terms[6]) == 0.0
    np.testing.assert_array_equal(_mask(loss, y, x), [True] * 6 + [False])
    mean = HAPLoss(include_self=False, dtype="float64")(y, x)
    np.testing.assert_allclose(float(mean), terms.numpy()[:6].mean(), rtol=1e-12)
    w = np.arange(1.0, 8.0)
    weighted = HAPLoss(include_self=False, dtype="float64")(y, x, sample_weight=w)
    np.testing.assert_allclose(float(weighted), (terms.numpy() * w)[:6].sum() / 6, rtol=1e-12)
    total = HAPLoss(include_self=False, reduction="sum", dtype="float64")(y, x)
    np.testing.assert_allclose(float(total), terms.numpy().sum(), rtol=1e-12)
    # the lone item is its own only relevant item with include_self: dropped on request
    kept = _mask(HAPLoss(dtype="float64"), y, x)
    dropped = _mask(HAPLoss(drop_lone_queries=True, dtype="float64"), y, x)
    assert kept.all() and not dropped[6] and dropped[:6].all()
    bad = x.copy()
    bad[2, 1] = np.nan
    value, grad = _value_and_grad(HAPLoss(dtype="float64"), y, bad)
    assert np.isnan(value) and np.all(np.isfinite(grad) | np.isnan(grad))


# -- the clustering term ---------------------------------------------------------------------

@pytest.mark.tensorflow
def test_clustering_term_value_and_training_of_the_proxies():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 6)).astype("float32")
    y = np.stack([np.repeat(np.arange(4), 3), np.repeat(np.arange(4), 3) // 2], 1)
    layer = ClusterProxies(4)
    layer.set_proxies(rng.uniform(-0.4, 0.4, size=(4, 6)))  # given: used outside a model
    loss = HAPLoss(clustering_weight=0.1, num_classes=4)
    loss.proxies_layer = layer
    e = x / np.linalg.norm(x, axis=1, keepdims=True)
    p = layer.proxies.numpy()
    p = p / np.linalg.norm(p, axis=1, keepdims=True)
    logits = e @ p.T / 0.05
    ce = np.mean(np.log(np.exp(logits).sum(1)) - logits[np.arange(12), y[:, 0]])
    hap = float(HAPLoss()(y, x))
    np.testing.assert_allclose(float(loss(y, x)), 0.9 * hap + 0.1 * ce, rtol=1e-5)

    inputs = keras.Input((6,))
    outputs = ClusterProxies(4, name="proxies")(keras.layers.Dense(6)(inputs))
    model = keras.Model(inputs, outputs)
    loss = HAPLoss(clustering_weight=0.1, num_classes=4)
    loss.proxies_layer = model.get_layer("proxies")
    before = loss.proxies_layer.proxies.numpy().copy()
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    history = model.fit(x, y, batch_size=12, epochs=3, verbose=0, shuffle=False)
    assert np.all(np.isfinite(history.history["loss"]))
    assert np.abs(loss.proxies_layer.proxies.numpy() - before).max() > 1e-3


# -- the data path -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def split(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hap_split"))
    sizes = {k: 4 for k in range(8)}
    supers = {k: k % 2 for k in range(8)}
    del supers[7]  # a class without a super-class
    mini.write_split_records(d, sizes, supers, chunk_size=8, size=(12, 10))
    return d, supers


@pytest.mark.tensorflow
@pytest.mark.parametrize("sampler", ["m_per_class", "hierarchical", None])
def test_label_levels_2_gives_class_and_super_class(split, sampler):
    path, supers = split
    ds = D.make_train_dataset(path, sampler=sampler, batch_size=8, m=2, image_size=8,
                              label_levels=2, seed=1)
    for images, labels in ds.take(3):
        labels = labels.numpy()
        assert images.shape == (8, 8, 8, 3) and labels.shape == (8, 2)
        assert labels.dtype == np.int32
        expected = [supers.get(int(c), -2 - int(c)) for c in labels[:, 0]]
        np.testing.assert_array_equal(labels[:, 1], expected)
    one = next(iter(D.make_train_dataset(path, batch_size=8, m=2, image_size=8)))[1]
    assert one.shape == (8,)


@pytest.mark.tensorflow
def test_label_levels_are_checked(split, tmp_path):
    path, _ = split
    with pytest.raises(ValueError, match="label_levels must be 1 .* got 3"):
        D.make_train_dataset(path, batch_size=8, m=2, label_levels=3)
    bare = str(tmp_path / "bare")
    mini.write_split_records(bare, {k: 4 for k in range(4)}, chunk_size=8, size=(12, 10))
    with pytest.raises(ValueError, match="label_levels=2 needs super-class labels"):
        D.make_train_dataset(bare, batch_size=8, m=2, label_levels=2)


@pytest.mark.tensorflow
def test_model_fit_trains_on_hierarchical_labels(split):
    path, _ = split
    ds = D.make_train_dataset(path, sampler="hierarchical", batch_size=8, m=2, image_size=8,
                              label_levels=2, seed=0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Rescaling(1 / 255.0),
                              keras.layers.Flatten(), keras.layers.Dense(8)])
    before = [w.numpy().copy() for w in model.trainable_weights]
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=HAPLoss())
    history = model.fit(ds, steps_per_epoch=3, epochs=1, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"][-1])
    assert max(np.abs(a - w.numpy()).max() for a, w in zip(before, model.trainable_weights)) > 0


@pytest.mark.tensorflow
def test_config_label_levels():
    base = {"loss": {"name": "HAPLoss"}, "data": {"label_levels": 2}}
    assert config_from_dict(base).data.label_levels == 2
    assert config_from_dict({"loss": {"name": "HAPLoss"}}).data.label_levels == 1
    with pytest.raises(ConfigError, match="data.label_levels.*SupAPLoss takes one label"):
        config_from_dict({"loss": {"name": "SupAPLoss"}, "data": {"label_levels": 2}})
    with pytest.raises(ConfigError, match="data.label_levels"):
        config_from_dict({"loss": {"name": "HAPLoss"}, "data": {"label_levels": 3}})
    # the clustering term trains in `tfaploss train`: its proxies come from the manifest
    cfg = config_from_dict({"loss": {"name": "HAPLoss", "clustering_weight": 0.1}})
    assert cfg.loss.kwargs == {"clustering_weight": 0.1}


# -- the hierarchical metrics -------------------------------------------------------------

@pytest.mark.tensorflow
def test_hierarchical_metrics_hand_derived():
    # One query (class 0 of super-class 0) and a database ranked b, a, d, c with levels
    # 1, 2, 0, 1. L = 2: w = (0, 1, 2); rel(a) = 2/1, rel(b) = rel(c) = 1/2, rel(d) = 0.
    q = np.array([[1.0, 0.0]])
    s = np.array([0.8, 0.9, 0.6, 0.7])  # a, b, c, d
    db = np.stack([s, np.sqrt(1 - s ** 2)], 1)
    q_labels = [[0, 0]]
    db_labels = [[0, 0], [1, 0], [2, 0], [3, 1]]
    m = hierarchical_metrics(q, q_labels, db, db_labels)
    # H-ranks: b 1/2; a 2 + min(2, 1/2); d 0; c min(1/2, 2) + 2 * 1/2
    h_ap = (0.5 / 1 + 2.5 / 2 + 0.0 + 1.5 / 4) / 3.0
    # ASI at R = 3 against the ideal levels (2, 1, 1, 0): SI = 0, 2, 2 at depths 1..3
    asi = (0 / 1 + 2 / 2 + 2 / 3) / 3
    ndcg = ((1 + 3 / math.log2(3) + 0 + 1 / math.log2(5))
            / (3 + 1 / math.log2(3) + 1 / math.log2(4)))
    assert m["num_queries"] == 1
    np.testing.assert_allclose([m["h_ap"], m["asi"], m["ndcg"]], [h_ap, asi, ndcg],
                               rtol=1e-6)


@pytest.mark.tensorflow
def test_hierarchical_metrics_match_the_authors_code():
    g = GOLDENS_TF["metrics"]
    m = hierarchical_metrics(np.asarray(g["X"]), np.asarray(g["y"]))
    # The authors' relevances and metrics run in float32.
    np.testing.assert_allclose([m["h_ap"], m["asi"], m["ndcg"]],
                               [g["h_ap"], g["asi"], g["ndcg"]], rtol=1e-6)
    with pytest.raises(ValueError, match=r"`db_labels` has 2 levels but `query_labels` has 3"):
        hierarchical_metrics(np.asarray(g["X"]), np.asarray(g["y"]), np.asarray(g["X"]),
                             np.asarray(g["y"])[:, :2])
