"""`evaluate`: model + tf.data, precomputed embeddings, revisited; QE and whitening."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support import needs_scann
from tfaploss.evaluation import (
    PCAWhitening,
    alpha_query_expansion,
    evaluate,
    retrieval_metrics,
)


def _toy_images(num_classes=3, per_class=4, size=12, seed=0):
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for c in range(num_classes):
        base = rng.uniform(0, 255, (1, 1, 3))
        for _ in range(per_class):
            images.append(np.clip(base + rng.normal(0, 30, (size, size, 3)), 0, 255))
            labels.append(c)
    return np.asarray(images, np.float32), np.asarray(labels, np.int64)


def _toy_model(size=12):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((size, size, 3))
    x = keras.layers.Rescaling(1 / 255.0)(inputs)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(8)(x)
    outputs = keras.layers.UnitNormalization()(x)
    return keras.Model(inputs, outputs)


def test_evaluate_model_on_dataset_writes_json_and_figure(tmp_path, capsys):
    images, labels = _toy_images()
    ds = tf.data.Dataset.from_tensor_slices((images, labels)).batch(5)
    model = _toy_model()
    result = evaluate(model, ds, protocol="cub", output_dir=str(tmp_path), verbose=1,
                      num_examples=3, examples_k=4)
    want = retrieval_metrics(model.predict(images, verbose=0), labels, ks=(1, 2, 4, 8))
    assert result.metrics == pytest.approx(want)
    assert result["recall@1"] == want["recall@1"]
    printed = capsys.readouterr().out
    assert "recall@8" in printed and "map@r" in printed and "3/3" in printed  # progress bar
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["metrics"] == pytest.approx(want) and saved["protocol"] == "cub"
    assert "every query counted" in saved["details"]["conventions"]["recall@K"]
    png = (tmp_path / "retrieval_examples.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_evaluate_precomputed_embeddings_with_ids_dataset_and_query_set():
    rng = np.random.default_rng(1)
    db = rng.standard_normal((30, 5)).astype(np.float32)
    db_y = rng.integers(0, 4, 30)
    q = rng.standard_normal((6, 5)).astype(np.float32)
    q_y = rng.integers(0, 4, 6)
    got = evaluate(db, db_y, query=q, query_labels=q_y, ks=(1, 3), verbose=0)
    assert got.metrics == pytest.approx(retrieval_metrics(q, q_y, db, db_y, ks=(1, 3)))
    # A dataset of (images, labels, ids) is accepted too.
    images, labels = _toy_images(2, 3)
    ds = tf.data.Dataset.from_tensor_slices(
        (images, labels, [f"img{i}" for i in range(6)])).batch(4)
    res = evaluate(_toy_model(), ds, ks=(1,), verbose=0)
    assert set(res.metrics) == {"recall@1", "precision@1", "map@r", "r_precision", "map"}
    with pytest.raises(ValueError, match="protocol"):
        evaluate(db, db_y, protocol="oxford5k", verbose=0)


@needs_scann
def test_evaluate_revisited_with_gnd(tmp_path):
    db = np.eye(6, dtype=np.float32)
    q = np.array([[0.9, 0.1, 0.3, 0, 0, 0], [0, 0, 0, 0, 1.0, 0.5]], np.float32)
    gnd = [{"easy": [0], "hard": [2], "junk": [1]}, {"easy": [5], "hard": [], "junk": []}]
    res = evaluate(db, query=q, gnd=gnd, protocol="roxford", output_dir=str(tmp_path),
                   verbose=0)
    # Query 0 ranks 0, 2, 1(junk): medium AP 1; query 1 ranks 4, 5: AP 0.25.
    assert res["medium/map"] == pytest.approx((1.0 + 0.25) / 2)
    assert res["hard/map"] == pytest.approx(1.0)  # query 1 has no hard positive: left out
    assert res["easy/map"] == pytest.approx((1.0 + 0.25) / 2)
    assert (tmp_path / "per_query_ap_medium.png").exists()
    approx = evaluate(db, query=q, gnd=gnd, protocol="roxford", backend="scann", verbose=0)
    assert approx["medium/map"] == pytest.approx(res["medium/map"])


def test_alpha_query_expansion_hand_case():
    db = np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]], np.float32)
    q = np.array([[1.0, 0.0]], np.float32)
    got = alpha_query_expansion(q, db, alpha=2.0, k=2)
    # Neighbours: row 0 (s=1) and row 1 (s=0.6): q + 1*x0 + 0.36*x1.
    want = np.array([1 + 1 + 0.216, 0.288])
    np.testing.assert_allclose(got[0], want / np.linalg.norm(want), rtol=1e-6)
    self_excluded = alpha_query_expansion(db[:1], db, k=1, exclude=np.array([0]))
    want = np.array([1 + 0.216, 0.288])
    np.testing.assert_allclose(self_excluded[0], want / np.linalg.norm(want), rtol=1e-6)


def test_pca_whitening_whitens_and_round_trips():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 6)) * np.array([5.0, 3, 1, 0.5, 0.2, 0.1])
    w = PCAWhitening(dim=4, power=0.5).fit(x)
    z = (x - w.mean) @ w.projection.T
    np.testing.assert_allclose(np.cov(z, rowvar=False), np.eye(4), atol=1e-3)
    out = w.transform(x)
    assert out.shape == (500, 4)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(PCAWhitening.from_json(w.to_json()).transform(x), out)


def test_evaluate_with_query_expansion_excludes_self():
    rng = np.random.default_rng(7)
    centres = rng.standard_normal((4, 6))
    y = np.repeat(np.arange(4), 5)
    x = centres[y] + 0.8 * rng.standard_normal((20, 6))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    got = evaluate(x, y, query_expansion=True, qe_k=3, ks=(1, 5), verbose=0)
    expanded = alpha_query_expansion(x, x, alpha=2.0, k=3, exclude=np.arange(20))
    want = retrieval_metrics(expanded, y, x, y, ks=(1, 5), exclude=np.arange(20))
    assert got.metrics == pytest.approx(want)
    assert got.details["query_expansion"] == {"alpha": 2.0, "k": 3}
    assert got.metrics != pytest.approx(evaluate(x, y, ks=(1, 5), verbose=0).metrics)


def test_figure_titles_name_the_class_from_a_label_map():
    from tfaploss.evaluation.evaluator import _label_title

    # A manifest's label_map read from JSON has string keys: test label 0 is digit "6".
    assert _label_title(np.int64(0), {"0": "6", "1": "7"}) == "class 6"
    assert _label_title(1, {1: "bicycle"}) == "class bicycle"
    assert _label_title(5, {"0": "6"}) == "label 5"
    assert _label_title(2, None) == "label 2"


def test_metrics_json_is_written_without_matplotlib_and_figures_are_skipped(
        tmp_path, monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    images, labels = _toy_images()
    ds = tf.data.Dataset.from_tensor_slices((images, labels)).batch(5)
    with caplog.at_level("WARNING", logger="tfaploss.evaluation.evaluator"):
        result = evaluate(_toy_model(), ds, protocol="cub", output_dir=str(tmp_path),
                          verbose=0, num_examples=3, examples_k=4)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["metrics"] == pytest.approx(result.metrics) and saved["figures"] == []
    assert result.figures == [] and not list(tmp_path.glob("*.png"))
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "figure skipped (retrieval examples)" in warning
    assert 'pip install "tfaploss[viz]"' in warning


def test_a_figure_that_cannot_be_drawn_never_costs_the_metrics(tmp_path, monkeypatch,
                                                                caplog):
    from tfaploss.evaluation import figures

    def broken(*args, **kwargs):
        raise RuntimeError("no display")

    monkeypatch.setattr(figures, "plot_per_query_ap", broken)
    db = np.eye(6, dtype=np.float32)
    q = np.array([[0.9, 0.1, 0.3, 0, 0, 0], [0, 0, 0, 0, 1.0, 0.5]], np.float32)
    gnd = [{"easy": [0], "hard": [2], "junk": [1]}, {"easy": [5], "hard": [], "junk": []}]
    with caplog.at_level("WARNING", logger="tfaploss.evaluation.evaluator"):
        res = evaluate(db, query=q, gnd=gnd, protocol="roxford", output_dir=str(tmp_path),
                       verbose=0)
    assert res["medium/map"] == pytest.approx((1.0 + 0.25) / 2)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["metrics"]["medium/map"] == pytest.approx(res["medium/map"])
    assert "figure skipped (per-query AP): RuntimeError: no display" in caplog.text


def test_evaluate_defaults_to_auto_search():
    import inspect

    assert inspect.signature(evaluate).parameters["backend"].default == "auto"
    rng = np.random.default_rng(3)
    db = rng.standard_normal((40, 6)).astype(np.float32)
    labels = rng.integers(0, 4, 40)
    assert evaluate(db, labels, verbose=0).metrics == evaluate(
        db, labels, backend="exact", verbose=0).metrics
