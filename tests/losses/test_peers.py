"""MultiSimilarityLoss (with and without its miner), SupConLoss and ProxyAnchorLoss
against pytorch-metric-learning 2.9 (tests/goldens/pml_peers.json), on the backend the
tests run on, float64 (float32 on PyTorch, see ``backend.FLOAT64``).

Cases (tests/goldens/README.md): ``A`` 32 items, 9 classes of 1 to 8 with two
singletons; ``B`` 40 items, 8 classes of 2 to 8; ``S`` 12 singletons (no positive
pair); ``L`` 256 items, 58 classes of 1 to 16 (loss, gradient norm and projection).
Gradients are with respect to the raw embeddings (PML normalises inside, as
``normalize=True`` does), and for Proxy-Anchor also with respect to the raw proxies.

The tests marked ``tensorflow`` use TensorFlow APIs and run in the TensorFlow run only:
The peer losses users compare against: MultiSimilarityLoss, SupConLoss, ProxyAnchorLoss.

Their values and gradients against pytorch-metric-learning are checked on every backend
in tests/losses/test_peers.py. Here, on TensorFlow: arguments and
their errors, serialisation, Proxy-Anchor's proxies (owned by the loss, trained as a
layer of the model, kept by ``.keras`` files and checkpoints, refused when no model
trains them), and each loss through ``tfaploss train`` on the demo's digits (with a
killed and resumed Proxy-Anchor run).
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support.backend import (
    DTYPE,
    FLOAT64,
    GRAD_RTOL,
    LOSS_RTOL,
    MODES,
    load_golden,
    loss_value_and_grad,
    to_numpy,
    value_and_grad,
)
from tfaploss import losses
from tfaploss.losses import (
    ClassProxies,
    HAPLoss,
    MultiSimilarityLoss,
    ProxyAnchorLoss,
    SupConLoss,
)

GOLDENS = load_golden("pml_peers.json")
# PML agrees to ~1e-15 in float64 (measured); PyTorch runs in float32 here.
RTOL = 1e-10 if FLOAT64 else LOSS_RTOL
GTOL = 1e-10 if FLOAT64 else GRAD_RTOL


def _inputs(case):
    data = GOLDENS["inputs"][case]
    return (np.asarray(data["X"], dtype=np.float64), np.asarray(data["y"]),
            np.asarray(data["P"], dtype=np.float64), data["num_classes"])


def make_loss(key, case, **extra):
    setting = GOLDENS["settings"][key]
    family, kwargs = setting["family"], dict(setting["kwargs"])
    if family == "multi_similarity_mined":
        return losses.MultiSimilarityLoss(dtype=DTYPE, **kwargs["loss"], **kwargs["miner"],
                                          **extra)
    if family == "multi_similarity":
        return losses.MultiSimilarityLoss(dtype=DTYPE, **kwargs, **extra)
    if family == "supcon":
        return losses.SupConLoss(dtype=DTYPE, **kwargs, **extra)
    _, _, proxies, num_classes = _inputs(case)
    loss = losses.ProxyAnchorLoss(num_classes, dtype=DTYPE, **kwargs, **extra)
    loss.proxies_layer.set_proxies(proxies)
    return loss


def _tolerance(golden):
    return GTOL * max(np.abs(golden).max(), 1e-300)


def test_goldens_cover_the_defaults_and_pml_versions():
    assert GOLDENS["source"]["pml_version"] == "2.9.0"
    defaults = {"multi_similarity": losses.MultiSimilarityLoss().get_config(),
                "supcon": losses.SupConLoss().get_config(),
                "proxy_anchor": losses.ProxyAnchorLoss(3).get_config()}
    found = set()
    for setting in GOLDENS["settings"].values():
        family = setting["family"]
        if family in defaults and all(defaults[family][k] == v
                                      for k, v in setting["kwargs"].items()):
            found.add(family)
    assert found == set(defaults)  # our defaults are PML's, and goldens hold them


# Every setting on every case; the full gradient where it is stored.
CHECKS = [(key, case) for key in sorted(GOLDENS["results"]) for case in "ABSL"]


@functools.cache
def _eager(key, case):
    x, y, _, _ = _inputs(case)
    return loss_value_and_grad(make_loss(key, case), y, x)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # S: no positive pair
@pytest.mark.parametrize("key,case", CHECKS)
def test_value_and_gradient_equal_pml(key, case):
    ref = GOLDENS["results"][key][case]
    x, _, _, _ = _inputs(case)
    value, grad = _eager(key, case)
    if case == "S" and GOLDENS["settings"][key]["family"] == "multi_similarity":
        # A batch without any positive pair: every loss of the library gives 0 (with a
        # warning); PML averages the negative terms (documented in the docstring).
        assert ref["loss"] > 0.01
        assert float(value) == 0.0 and not np.any(grad)
        return
    np.testing.assert_allclose(value, ref["loss"], rtol=RTOL)
    if "grad" in ref:
        golden = np.asarray(ref["grad"])
        if np.any(golden):
            np.testing.assert_allclose(grad, golden, rtol=0, atol=_tolerance(golden))
        else:
            assert not np.any(grad)
        return
    np.testing.assert_allclose(np.linalg.norm(grad), ref["grad_fro"], rtol=RTOL * 10)
    w = np.random.default_rng(99).standard_normal(x.shape)
    np.testing.assert_allclose(np.sum(grad * w), ref["grad_dot_W"], rtol=0,
                               atol=GTOL * ref["grad_fro"] * np.sqrt(x.size))
    np.testing.assert_allclose(grad[0, :4], ref["grad_row0_first4"], rtol=0,
                               atol=_tolerance(grad))


@pytest.mark.parametrize("case", "AB")
@pytest.mark.parametrize("key", [k for k in sorted(GOLDENS["results"])
                                 if GOLDENS["settings"][k]["family"] != "proxy_anchor"])
def test_per_query_terms_equal_pml_element_losses(key, case):
    ref = GOLDENS["results"][key][case]["per_anchor"]
    x, y, _, _ = _inputs(case)
    terms = to_numpy(make_loss(key, case, reduction="none")(y, x))
    np.testing.assert_allclose(terms, np.abs(ref), rtol=RTOL, atol=1e-12 if FLOAT64 else 1e-6)


@pytest.mark.parametrize("case", "ABS")
@pytest.mark.parametrize("key", [k for k in sorted(GOLDENS["results"])
                                 if GOLDENS["settings"][k]["family"] == "proxy_anchor"])
def test_proxy_anchor_terms_and_proxy_gradient_equal_pml(key, case):
    ref = GOLDENS["results"][key][case]
    x, y, proxies, num_classes = _inputs(case)
    loss = make_loss(key, case, reduction="none")
    terms = to_numpy(loss(y, x))
    pos, neg = np.asarray(ref["pos_per_proxy"]), np.asarray(ref["neg_per_proxy"])
    expected = pos * num_classes / ref["pos_divisor"] + neg
    assert ref["neg_divisor"] == num_classes
    np.testing.assert_allclose(terms, expected, rtol=RTOL)

    loss = make_loss(key, case)
    variable = loss.proxies_layer.proxies

    def of_proxies(p):
        with keras.StatelessScope(state_mapping=[(variable, p)]):
            return loss(y, x)

    value, grad = value_and_grad(of_proxies, proxies)
    golden = np.asarray(ref["grad_proxies"])
    np.testing.assert_allclose(value, ref["loss"], rtol=RTOL)
    np.testing.assert_allclose(grad, golden, rtol=0, atol=_tolerance(golden))


@pytest.mark.parametrize("mode", [m for m in MODES if m != "eager"])
@pytest.mark.parametrize("key", ["multi_similarity_mined/alpha=2,beta=50,base=0.5,epsilon=0.1",
                                 "supcon/temperature=0.1", "proxy_anchor/margin=0.1,alpha=32"])
def test_compiled_modes_give_the_eager_gradient(key, mode):
    ref = GOLDENS["results"][key]["A"]
    x, y, _, _ = _inputs("A")
    value, grad = loss_value_and_grad(make_loss(key, "A"), y, x, mode)
    golden = np.asarray(ref["grad"])
    np.testing.assert_allclose(value, ref["loss"], rtol=RTOL)
    np.testing.assert_allclose(grad, golden, rtol=0, atol=_tolerance(golden))


def test_proxy_anchor_sample_weight_weights_items_inside_the_sums():
    """Weight 0 removes an item, weight 2 counts it twice (as a duplicated row would)."""
    x, y, _, _ = _inputs("A")
    key = "proxy_anchor/margin=0.1,alpha=32"
    weights = np.ones(len(y))
    weights[[0, 5]] = 0.0
    weights[7] = 2.0
    keep = weights > 0
    rows = np.concatenate([np.flatnonzero(keep), [7]])
    weighted = to_numpy(make_loss(key, "A")(y, x, sample_weight=weights))
    explicit = to_numpy(make_loss(key, "A")(y[rows], x[rows]))
    np.testing.assert_allclose(weighted, explicit, rtol=RTOL)
    assert abs(float(weighted) - GOLDENS["results"][key]["A"]["loss"]) > 1e-3


# --------------------------------------------------------------------------------------
# TensorFlow only
# --------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def _data(n=48, dim=6, classes=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype("float32")
    return x, (np.arange(n) % classes).astype("int32")


def _embedder(dim=6, features=6, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    return keras.Model(inputs, keras.layers.Dense(dim)(inputs), name="embedder")


# -- arguments ---------------------------------------------------------------------------

@pytest.mark.tensorflow
@pytest.mark.parametrize("make,match", [
    (lambda: MultiSimilarityLoss(alpha=0), "alpha must be a number > 0; received alpha=0"),
    (lambda: MultiSimilarityLoss(beta=-1.0), "beta must be a number > 0; received beta=-1.0"),
    (lambda: MultiSimilarityLoss(base="x"), "base must be a number; received base='x'"),
    (lambda: MultiSimilarityLoss(epsilon=-0.1), "epsilon must be a number >= 0 or None"),
    (lambda: MultiSimilarityLoss(epsilon=True), "epsilon must be a number >= 0 or None"),
    (lambda: SupConLoss(temperature=0.0), "temperature must be a number > 0; received"),
    (lambda: SupConLoss(temperature=float("nan")), "temperature must be a number > 0"),
    (lambda: ProxyAnchorLoss(0), "num_classes must be a positive int; received num_classes=0"),
    (lambda: ProxyAnchorLoss(2.5), "num_classes must be a positive int; received"),
    (lambda: ProxyAnchorLoss(True), "num_classes must be a positive int"),
    (lambda: ProxyAnchorLoss(4, alpha=0), "alpha must be a number > 0; received alpha=0"),
    (lambda: ProxyAnchorLoss(4, margin=None), "margin must be a number; received margin=None"),
    (lambda: ClassProxies(0), "num_classes must be a positive int; received num_classes=0"),
])
def test_bad_arguments_name_the_argument_and_value(make, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        make()


@pytest.mark.tensorflow
@pytest.mark.parametrize("loss", [
    MultiSimilarityLoss(alpha=1.0, beta=20.0, base=0.7, epsilon=0.3, reduction="sum"),
    SupConLoss(temperature=0.07, normalize=False),
    ProxyAnchorLoss(5, margin=0.2, alpha=16.0, reduction="sum"),
], ids=lambda loss: type(loss).__name__)
def test_config_round_trip_keeps_every_argument(loss):
    config = loss.get_config()
    again = type(loss).from_config(config)
    assert again.get_config() == config
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(loss))
    assert type(restored) is type(loss) and restored.get_config() == config


@pytest.mark.tensorflow
def test_the_losses_are_configurable_by_name():
    from tfaploss.config import loss_classes, loss_parameters

    classes = loss_classes()
    for name in ("MultiSimilarityLoss", "SupConLoss", "ProxyAnchorLoss"):
        assert name in classes
        assert "proxies_key" not in loss_parameters(classes[name])  # the loss's own
    assert "ClassProxies" not in classes  # a layer, not a loss


@pytest.mark.tensorflow
def test_multi_similarity_miner_keeps_the_hard_pairs_only():
    """A query whose positive is far closer than every negative mines nothing."""
    from tfaploss.losses.multi_similarity import hard_pairs

    scores = np.array([[1.0, 0.9, 0.2, 0.1],
                       [0.9, 1.0, 0.85, 0.1]])
    positives = np.array([[False, True, False, False], [True, False, False, False]])
    negatives = np.array([[False, False, True, True], [False, False, True, True]])
    pos, neg = hard_pairs(scores, positives, negatives, 0.1)
    # query 0: positive 0.9 - 0.1 > hardest negative 0.2; negatives 0.2 + 0.1 < 0.9
    assert not np.any(pos[0]) and not np.any(neg[0])
    # query 1: positive 0.9 - 0.1 < 0.85 kept; negative 0.85 + 0.1 > 0.9 kept, 0.1 not
    np.testing.assert_array_equal(pos[1], [True, False, False, False])
    np.testing.assert_array_equal(neg[1], [False, False, True, False])


# -- Proxy-Anchor's per-proxy terms, weights and labels ----------------------------------

def _given(loss, x, seed=1):
    loss.proxies_layer.set_proxies(np.random.default_rng(seed).normal(
        size=(loss.num_classes, x.shape[1])))
    return loss


@pytest.mark.tensorflow
def test_proxy_anchor_reductions_are_over_the_proxies():
    x, y = _data()
    terms = _given(ProxyAnchorLoss(10, reduction="none"), x)(y, x).numpy()
    assert terms.shape == (10,)
    # proxies 8 and 9 have no item: their terms are the negative sums alone
    mean = float(_given(ProxyAnchorLoss(10), x)(y, x))
    total = float(_given(ProxyAnchorLoss(10, reduction="sum"), x)(y, x))
    np.testing.assert_allclose(mean, terms.mean(), rtol=1e-6)
    np.testing.assert_allclose(total, terms.sum(), rtol=1e-6)
    # a scalar weight w adds log(w) inside every sum: not a plain scale of the loss
    scaled = float(_given(ProxyAnchorLoss(10), x)(y, x, sample_weight=2.0))
    assert scaled != pytest.approx(2.0 * mean, rel=1e-3) and scaled > mean


@pytest.mark.tensorflow
@pytest.mark.parametrize("labels", [
    lambda y: y + 2,                      # ids past num_classes
    lambda y: np.where(y == 3, -1, y),    # a negative id
    lambda y: (y + 0.5).astype("float32"),  # not whole numbers
])
def test_proxy_anchor_refuses_labels_outside_its_classes(labels):
    x, y = _data()
    loss = _given(ProxyAnchorLoss(8), x)
    with pytest.raises(ValueError, match=r"labels must be class ids in 0..7 \(num_classes=8"):
        loss(labels(y), x)
    # traced, where nothing can raise: the loss is NaN, and training stops on it
    traced = tf.function(lambda a, b: loss(a, b))
    assert np.isnan(float(traced(tf.constant(labels(y)), tf.constant(x))))
    assert np.isfinite(float(traced(tf.constant(y), tf.constant(x))))


@pytest.mark.tensorflow
def test_proxy_anchor_refuses_negative_and_misshapen_weights():
    x, y = _data()
    loss = _given(ProxyAnchorLoss(8), x)
    weights = np.ones(len(y))
    weights[4] = -1.0
    with pytest.raises(ValueError, match="sample_weight weights items .* must be >= 0"):
        loss(y, x, sample_weight=weights)
    with pytest.raises(ValueError, match=r"sample_weight must hold one weight per query"):
        loss(y, x, sample_weight=np.ones((len(y), 2)))


@pytest.mark.tensorflow
def test_proxy_anchor_non_finite_embeddings_give_nan_not_a_finite_loss():
    x, y = _data()
    x[3, 2] = np.inf
    assert np.isnan(float(_given(ProxyAnchorLoss(8), x)(y, x)))


@pytest.mark.tensorflow
def test_proxy_anchor_has_no_memory_form():
    x, y = _data()
    with pytest.raises(ValueError, match="no query-vs-database form"):
        ProxyAnchorLoss(8).query_database_loss(y, x, y, x)


# -- the proxies: owned by the loss, trained as a model layer ----------------------------

@pytest.mark.tensorflow
def test_proxies_that_no_model_trains_are_refused():
    x, y = _data()
    loss = ProxyAnchorLoss(8)
    with pytest.raises(ValueError, match=r"not part of the model, so no optimizer would "
                                         r"ever update them.*loss.with_proxies\(model\)"):
        loss(y, x)
    # a model compiled with the loss but without its layer: the same error, in fit
    model = _embedder()
    model.compile(optimizer="adam", loss=loss)
    with pytest.raises(ValueError, match="not part of the model"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    hap = HAPLoss(clustering_weight=0.1, num_classes=8)
    with pytest.raises(ValueError, match="HAPLoss: its proxies .* not part of the model"):
        hap(y, x)


@pytest.mark.tensorflow
def test_proxies_train_with_fit_and_faster_with_a_multiplier():
    from tfaploss.models.lr_multipliers import LRMultiplierOptimizer

    x, y = _data()
    moved = {}
    for factor in (1.0, 100.0):
        loss = ProxyAnchorLoss(8)
        model = loss.with_proxies(_embedder())
        assert model.layers[-1] is loss.proxies_layer and loss.proxies_layer.built
        before = loss.proxies_layer.proxies.numpy().copy()
        optimizer = LRMultiplierOptimizer(keras.optimizers.SGD(1e-3),
                                          losses.proxies_multipliers(factor))
        model.compile(optimizer=optimizer, loss=loss)
        start = float(loss(y, model(x)))
        model.fit(x, y, batch_size=48, epochs=1, verbose=0, shuffle=False)  # one step
        assert float(loss(y, model(x))) < start
        moved[factor] = loss.proxies_layer.proxies.numpy() - before
    assert np.abs(moved[1.0]).max() > 0
    np.testing.assert_allclose(moved[100.0], 100.0 * moved[1.0], rtol=1e-3, atol=1e-9)


@pytest.mark.tensorflow
def test_keras_file_restores_the_proxies_and_binds_the_loss_to_them(tmp_path):
    x, y = _data()
    loss = ProxyAnchorLoss(8, alpha=16.0)
    model = loss.with_proxies(_embedder())
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    model.fit(x, y, batch_size=48, epochs=2, verbose=0)
    trained = loss.proxies_layer.proxies.numpy().copy()
    model.save(tmp_path / "m.keras")

    first = keras.saving.load_model(tmp_path / "m.keras")
    second = keras.saving.load_model(tmp_path / "m.keras")  # loaded twice: each its own
    for loaded in (first, second):
        layer = loaded.layers[-1]
        assert isinstance(layer, ClassProxies) and loaded.loss.proxies_layer is layer
        np.testing.assert_array_equal(layer.proxies.numpy(), trained)
        assert loaded.loss.get_config() == loss.get_config()
    # training one copy moves its own proxies, and the loss reads those
    first.fit(x, y, batch_size=48, epochs=1, verbose=0)
    assert np.abs(first.layers[-1].proxies.numpy() - trained).max() > 1e-4
    np.testing.assert_array_equal(second.layers[-1].proxies.numpy(), trained)


@pytest.mark.tensorflow
def test_hap_clustering_proxies_survive_a_keras_file(tmp_path):
    x, _ = _data()
    y = np.stack([np.arange(48) % 8, (np.arange(48) % 8) // 4], 1).astype("int32")
    loss = HAPLoss(clustering_weight=0.1, num_classes=8)
    model = loss.with_proxies(_embedder())
    assert model.layers[-1].name == "cluster_proxies"
    before = loss.proxies_layer.proxies.numpy().copy()
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    model.fit(x, y, batch_size=48, epochs=2, verbose=0)
    trained = loss.proxies_layer.proxies.numpy()
    assert np.abs(trained - before).max() > 1e-3
    model.save(tmp_path / "h.keras")
    loaded = keras.saving.load_model(tmp_path / "h.keras")
    assert loaded.loss.proxies_layer is loaded.layers[-1]
    np.testing.assert_array_equal(loaded.layers[-1].proxies.numpy(), trained)
    np.testing.assert_allclose(float(loaded.loss(y, loaded(x))), float(loss(y, model(x))),
                               rtol=1e-6)


@pytest.mark.tensorflow
def test_checkpoint_restores_the_proxies(tmp_path):
    from tfaploss.durable.checkpoints import RunBackup
    from tfaploss.training import MultiStageModel

    x, y = _data()

    def trainer(seed):
        loss = ProxyAnchorLoss(8)
        model = MultiStageModel(loss.with_proxies(_embedder(seed=seed)), chunk_size=16)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
        return model, loss

    model, loss = trainer(0)
    model.fit(x, y, batch_size=48, epochs=2, verbose=0)
    RunBackup(tmp_path / "backup").save(model, 2)
    fresh, fresh_loss = trainer(1)
    assert np.abs(fresh_loss.proxies_layer.proxies.numpy()
                  - loss.proxies_layer.proxies.numpy()).max() > 1e-2
    assert RunBackup(tmp_path / "backup").restore(fresh) == 2
    np.testing.assert_array_equal(fresh_loss.proxies_layer.proxies.numpy(),
                                  loss.proxies_layer.proxies.numpy())
    np.testing.assert_array_equal(int(fresh.optimizer.iterations), 2)


# -- tfaploss train on the demo's digits ----------------------------------------------------

@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from tfaploss.demo import run_folder_job, write_digit_pngs

    root = tmp_path_factory.mktemp("digits")
    write_digit_pngs(root / "pngs")
    run_folder_job(root / "pngs", root / "records")
    return root


def _config(digits, run, loss, **model):
    from tfaploss.config import config_from_dict
    from tfaploss.demo import DEMO_CONFIG

    raw = json.loads(json.dumps(DEMO_CONFIG))
    raw["run_dir"] = str(digits / run)
    raw["data"].update(train=str(digits / "records" / "train"),
                       test=str(digits / "records" / "test"))
    raw["model"].update(model)
    raw["loss"] = loss
    raw["training"].update(epochs=2, steps_per_epoch=4)
    raw["evaluation"].update(backend="exact", at_end=True, ks=[1])
    return raw, config_from_dict(raw)


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.parametrize("loss", [
    pytest.param({"name": "MultiSimilarityLoss", "epsilon": 0.1}, marks=pytest.mark.long),
    {"name": "SupConLoss", "temperature": 0.1},
    pytest.param({"name": "HAPLoss", "clustering_weight": 0.1}, marks=pytest.mark.long),
], ids=lambda loss: loss["name"])
def test_train_runs_each_peer_on_the_digits(digits, loss):
    from tfaploss.run.trainer import train

    _, cfg = _config(digits, f"run_{loss['name']}", loss, proxy_lr_multiplier=10.0)
    summary = train(cfg, verbose=0)
    assert summary["epochs_completed"] == 2
    losses_seen = [row["loss"] for row in summary["history"]]
    assert all(np.isfinite(losses_seen))
    assert 0.0 <= summary["final_metrics"]["map@r"] <= 1.0
    model = keras.saving.load_model(digits / f"run_{loss['name']}" / "model.keras")
    names = [layer.name for layer in model.layers]
    assert ("cluster_proxies" in names) == (loss["name"] == "HAPLoss")


@pytest.mark.long
@pytest.mark.tensorflow
def test_train_builds_proxies_from_the_manifest_and_resumes_them(digits, monkeypatch):
    """A Proxy-Anchor run killed after its first checkpoint resumes with the proxies it
    had trained; the final model holds one proxy per training class."""
    from tfaploss.config import ConfigError
    from tfaploss.durable import faults
    from tfaploss.durable.checkpoints import RunBackup
    from tfaploss.run import build
    from tfaploss.run.trainer import train

    loss = {"name": "ProxyAnchorLoss", "margin": 0.1, "alpha": 32}
    raw, cfg = _config(digits, "run_pa", loss, proxy_lr_multiplier=100.0)
    assert build.build_loss(cfg).num_classes == 6  # digits 0-5
    optimizer = build.build_optimizer(cfg, 4)
    assert any("class_proxies" in pattern for pattern in optimizer.multipliers)

    config_path = digits / "pa.yaml"
    import yaml

    config_path.write_text(yaml.safe_dump(raw))
    killed = subprocess.run(
        [sys.executable, "-m", "tfaploss.cli", "train", "--config", str(config_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", faults.ENV: "epoch_end:2"})
    assert killed.returncode == faults.EXIT_CODE, killed.stdout + killed.stderr
    backup = digits / "run_pa" / "backup"
    checkpoint = sorted(backup.glob("epoch-*.weights.h5"))
    assert [p.name for p in checkpoint] == ["epoch-0001.weights.h5"]

    with h5py.File(checkpoint[0], "r") as f:
        saved = []
        f.visititems(lambda name, obj: saved.append(np.asarray(obj)) if (
            isinstance(obj, h5py.Dataset) and "class_proxies" in name) else None)
    assert len(saved) == 1 and saved[0].shape == (6, 32)

    restored = {}
    restore = RunBackup.restore

    def spy(self, model, found=None):
        epoch = restore(self, model, found)
        layer = model.embedding_model.get_layer("class_proxies")
        restored["proxies"] = layer.proxies.numpy().copy()
        return epoch

    monkeypatch.setattr(RunBackup, "restore", spy)
    summary = train(cfg, verbose=0)
    assert summary["resumed"] and summary["epochs_completed"] == 2
    np.testing.assert_array_equal(restored["proxies"], saved[0])  # the trained ones
    model = keras.saving.load_model(digits / "run_pa" / "model.keras")
    final = model.get_layer("class_proxies").proxies.numpy()
    assert final.shape == (6, 32) and np.abs(final - saved[0]).max() > 1e-4  # trained on

    bad = json.loads(json.dumps(raw))
    bad["loss"]["num_classes"] = 7
    from tfaploss.config import config_from_dict

    with pytest.raises(ConfigError, match=r"loss.num_classes': 7 proxies, but the training "
                                          r"split .* has 6 classes"):
        build.build_loss(config_from_dict(bad))
    with_memory = json.loads(json.dumps(raw))
    with_memory["training"]["xbm"] = {"size": 64}
    with pytest.raises(ConfigError, match="training.xbm.size': ProxyAnchorLoss"):
        config_from_dict(with_memory)
