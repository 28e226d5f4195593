"""The feature tier's heads start where the features are, and the baselines every
report carries: on synthetic features (no backbone, no TFRecords)."""

import numpy as np
import pytest

from tfaploss.compare import protocol as P
from tfaploss.compare.features import (
    FeatureRunner,
    baselines,
    class_folds,
    features_digest,
    score,
)


def _clusters(classes=8, per_class=12, width=16, seed=0, spread=0.6):
    """Class centres on the unit sphere plus noise, L2-normalised (as the frozen
    backbone's features are)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, width))
    x = np.repeat(centres, per_class, axis=0) + spread * rng.normal(size=(classes * per_class,
                                                                          width))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype("float32"), np.repeat(np.arange(classes), per_class)


def _data():
    return {"train": _clusters(seed=0), "val": _clusters(seed=1), "test": _clusters(seed=2)}


@pytest.mark.parametrize("head", ["residual", "linear"])
def test_a_head_at_step_0_scores_exactly_the_frozen_features(head):
    runner = FeatureRunner(_data(), m=4, head=head, hidden=32)
    model = runner.head()
    assert runner.dim == 16  # full width
    frozen = runner.baselines(dim=4)["frozen"]
    for split, (x, y) in (("val", runner.val), ("test", runner.test)):
        np.testing.assert_allclose(np.asarray(model(x)), x, atol=1e-6)
        at_start = score(lambda block: model(block, training=False), x, y)[0]
        assert at_start == pytest.approx(frozen[f"{split}_map@r"], abs=1e-6)
    # the random mlp head does not start there (what the first study measured)
    mlp = FeatureRunner(_data(), m=4, head="mlp", hidden=32, dim=8)
    x, y = mlp.test
    assert abs(score(lambda b: mlp.head()(b), x, y)[0] - frozen["test_map@r"]) > 0.5


def test_a_residual_run_trains_from_the_features():
    runner = FeatureRunner(_data(), m=4, hidden=32, curve_points=2)
    spec = P.RunSpec("SupCon", (("lr", 1e-2), ("temperature", 0.1)), 16, 6, 0, True)
    row = runner(spec)
    assert row["status"] == "ok" and len(row["curve"]) == 2
    assert 0.0 < row["test_map@r"] <= 100.0
    # trained, it is no longer the frozen features (W2 moved off zero)
    assert row["test_map@r"] != pytest.approx(runner.baselines(4)["frozen"]["test_map@r"],
                                              abs=1e-6)
    assert runner.setup() == {"head": "residual", "hidden": 32, "dim": 16, "m": 4,
                              "test_classes": None, "curve_classes": 100, "curve_points": 2}


def test_validation_folds_are_class_disjoint_and_each_scored():
    x, y = _clusters(classes=10, per_class=3, seed=1)
    folds = class_folds(x, y, 3)
    classes = [set(f[1].tolist()) for f in folds]
    assert sorted(len(c) for c in classes) == [3, 3, 4]  # as evenly as 10 divides
    assert set().union(*classes) == set(range(10)) and sum(map(len, classes)) == 10
    assert sum(len(f[1]) for f in folds) == len(y)
    for fx, fy in folds:  # each row kept with its own label
        assert all(np.any(np.all(x[y == label] == row, axis=1)) for row, label in zip(fx, fy))
    with pytest.raises(ValueError, match="val_folds=11 needs as many validation classes"):
        class_folds(x, y, 11)
    runner = FeatureRunner(_data(), m=4, hidden=32, val_folds=2)
    row = runner(P.RunSpec("SupCon", (("lr", 1e-2), ("temperature", 0.1)), 16, 2, 0, False))
    assert runner.setup()["val_folds"] == 2 and sorted(row["val_folds"]) == ["0", "1"]
    model_free = [score(lambda b: b, *fold)[0] for fold in runner.folds]  # no head
    assert all(0 < v <= 100 for v in row["val_folds"].values())
    assert row["val_folds"] != dict(zip(("0", "1"), model_free))  # scored after training
    assert "val_folds" not in FeatureRunner(_data(), m=4).setup()  # older ledgers resume


def test_the_runner_times_an_update_after_warming_up():
    runner = FeatureRunner(_data(), m=4, hidden=32)
    seconds = runner.step_seconds("SmoothAP", 16, updates=3)
    # the median of 3 timed updates: a real duration, far below the traced first one
    assert np.isfinite(seconds) and 0.0 < seconds < 5.0


def test_pca_keeps_the_directions_of_largest_variance():
    """The classes apart in 16 dimensions of variance about 1 each, one dimension of
    noise with variance 4: PCA to one dimension keeps the noise and ranks near
    chance, the frozen features rank well."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 10)
    centres = rng.choice([-1.0, 1.0], size=(10, 16))

    def split():
        signal = centres[labels] + 0.1 * rng.normal(size=(100, 16))
        noise = 2.0 * rng.normal(size=(100, 1))
        return np.concatenate([signal, noise], axis=1).astype("float32"), labels

    rows = baselines(split(), split(), split(), dim=1)
    assert rows["pca"]["dim"] == 1 and rows["frozen"]["dim"] == 17
    # measured: 87.4 and 7.8 (chance, 10 classes of 10: about 9)
    assert rows["frozen"]["test_map@r"] > 80.0 and rows["pca"]["test_map@r"] < 20.0
    # more components than the width: all of them
    assert baselines(split(), split(), split(), dim=64)["pca"]["dim"] == 17


def test_the_features_digest_sees_every_split_and_value():
    data = _data()
    same = {k: (v[0].copy(), v[1].copy()) for k, v in data.items()}
    assert features_digest(data) == features_digest(same)
    same["test"][0][0, 0] += 1e-3
    assert features_digest(data) != features_digest(same)
    with pytest.raises(ValueError, match="head must be one of"):
        FeatureRunner(data, head="wide")


@pytest.mark.parametrize("loss, params", [
    ("APLoss", (("lr", 1e-2), ("num_bins", 20))),
    ("ProxyAnchor", (("alpha", 32.0), ("lr", 1e-2), ("margin", 0.1),
                     ("proxy_lr_multiplier", 100.0)))])
def test_the_runner_step_is_keras_train_on_batch(loss, params):
    """The runner's own step (no autograph) updates as Keras's train_on_batch does,
    proxies and their learning-rate multiplier included."""
    import keras

    from tfaploss.data.samplers import m_per_class_rows

    runner = FeatureRunner(_data(), m=4, hidden=32)
    spec = P.RunSpec(loss, params, 16, 4, 0, False)
    x, y = runner.train[0], runner.train_labels
    batches = list(m_per_class_rows(y, 16, 4, 0).take(4).as_numpy_iterator())
    weights, losses = [], []
    for update in (lambda model: model.train_on_batch, runner.step):
        keras.backend.clear_session()
        model = runner._model(spec)
        # The runner's step is compiled with XLA; Keras's the same way, since XLA's
        # rounding differs and Adam turns near-zero gradients into full steps.
        model.jit_compile = True
        step = update(model)
        losses.append([float(step(x[rows], y[rows])) for rows in batches])
        weights.append([np.asarray(w) for w in model.weights])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert len(weights[0]) == len(weights[1])
    for ours, keras_ in zip(weights[1], weights[0]):
        np.testing.assert_allclose(ours, keras_, rtol=1e-4, atol=1e-6)
    assert not np.allclose(weights[1][-1], keras.ops.convert_to_numpy(
        runner._model(spec).weights[-1]))  # they did move


@pytest.mark.slow  # a Beam folder job
def test_a_random_backbone_embeds_every_split_alike(tmp_path):
    """model.weights: null: the backbone is a seeded draw, so a split embedded later
    (its cache removed) gets the same features as before."""
    from PIL import Image

    from tfaploss.compare.features import extract_features
    from tfaploss.config import load_config
    from tfaploss.pipelines import folder

    rng = np.random.default_rng(0)
    for c in range(2):
        (tmp_path / "pngs" / "train" / str(c)).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype="uint8"), mode="L").save(
                tmp_path / "pngs" / "train" / str(c) / f"{i}.png")
    folder.run(["--input_dir", str(tmp_path / "pngs"), "--output_dir", str(tmp_path / "rec"),
                "--splits_from_folders", "--direct_running_mode", "in_memory",
                "--direct_num_workers", "1"])
    cfg = load_config("configs/demo_digits.yaml", warn=False)
    paths = {"train": str(tmp_path / "rec" / "train")}
    first = extract_features(cfg, paths, tmp_path / "out")["train"][0]
    for cached in (tmp_path / "out").glob("features-*/train.npz"):
        cached.unlink()
    again = extract_features(cfg, paths, tmp_path / "out")["train"][0]
    np.testing.assert_array_equal(first, again)
