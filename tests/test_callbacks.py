"""tfaploss.callbacks: retrieval evaluation as logs, the projector export, the UMAP
plot's missing extra. The metrics are checked against
:func:`tfaploss.evaluation.retrieval_metrics` and against a case worked by hand."""

import sys

import keras
import numpy as np
import pytest

import tfaploss.callbacks as C
from tfaploss.evaluation import retrieval_metrics
from tfaploss.evaluation.exact_search import ExactSearcher

# Four unit vectors, two classes. Each query's one positive: p0 and p1 (class 0) each
# have a class-1 item nearest (p0.p2 = 0.8 > p0.p1 = 0; p1.p3 = 0.8), p2 and p3 are
# each other's nearest (0.96). So recall@1 = 2/4 and MAP@R (R = 1) = 2/4.
POINTS = np.array([[1.0, 0.0], [0.0, 1.0], [0.8, 0.6], [0.6, 0.8]], np.float32)
LABELS = np.array([0, 0, 1, 1])


def _identity():
    return keras.Sequential([keras.Input((2,)), keras.layers.Identity()])


def test_metrics_are_those_of_the_evaluation_module_worked_by_hand():
    callback = C.RetrievalEvaluation(POINTS, LABELS, embedding_model=_identity(), ks=(1, 2))
    logs = {}
    callback.on_epoch_end(0, logs)
    assert logs["val_recall@1"] == pytest.approx(0.5)
    assert logs["val_map@r"] == pytest.approx(0.5)
    expected = retrieval_metrics(POINTS, LABELS, ks=(1, 2))
    assert logs == {f"val_{k}": pytest.approx(v) for k, v in expected.items()}


def test_any_split_and_searcher_give_the_same_metrics():
    import tensorflow as tf

    arrays = C.RetrievalEvaluation(POINTS, LABELS, embedding_model=_identity(),
                                   ks=(1, 2)).evaluate()
    dataset = tf.data.Dataset.from_tensor_slices((POINTS, LABELS)).batch(3)
    from_dataset = C.RetrievalEvaluation(dataset, embedding_model=_identity(), ks=(1, 2),
                                         searcher=ExactSearcher).evaluate()
    assert from_dataset == pytest.approx(arrays)


def _regressor(lr):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    return model


def test_logs_reach_early_stopping_and_tensorboard(tmp_path):
    """The model being trained is the embedding model (its output); the metrics do
    not move (lr 0), so EarlyStopping(patience=1) stops after the second epoch."""
    model = _regressor(0.0)
    evaluation = C.RetrievalEvaluation(POINTS, LABELS, ks=(1,), log_dir=tmp_path / "tb")
    stop = keras.callbacks.EarlyStopping(monitor="val_map@r", mode="max", patience=1)
    history = model.fit(POINTS, POINTS, epochs=10, verbose=0, callbacks=[evaluation, stop])
    assert len(history.history["loss"]) == 2
    assert {"val_recall@1", "val_map@r", "val_precision@1"} <= set(history.history)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_every_n_epochs():
    seen = []
    callback = C.RetrievalEvaluation(evaluate_fn=lambda m: seen.append(m) or {"x": 1.0},
                                     embedding_model="embedder", every_n_epochs=2)
    logs = [{} for _ in range(4)]
    for epoch, log in enumerate(logs):
        callback.on_epoch_end(epoch, log)
    assert logs == [{}, {"val_x": 1.0}, {}, {"val_x": 1.0}] and seen == ["embedder"] * 2
    with pytest.raises(ValueError, match="not both"):
        C.RetrievalEvaluation(POINTS, LABELS, evaluate_fn=lambda m: {})


@pytest.mark.parametrize("checkpoint", [None, False], ids=["checkpoint", "tsv"])
def test_projector_files(tmp_path, checkpoint):
    rng = np.random.default_rng(0)
    embeddings = rng.standard_normal((7, 3)).astype("float32")
    labels = np.array([3, 1, 4, 1, 5, 9, 2])
    config = C.export_projector(embeddings, labels, tmp_path, checkpoint=checkpoint)
    assert config == tmp_path / "projector_config.pbtxt"
    text = config.read_text()
    assert 'metadata_path: "metadata.tsv"' in text
    rows = (tmp_path / "metadata.tsv").read_text().splitlines()
    assert rows == [str(v) for v in labels]  # one column: no header, one row each
    if checkpoint is None:
        import tensorflow as tf

        reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(tmp_path)))
        np.testing.assert_array_equal(reader.get_tensor(
            "embedding/.ATTRIBUTES/VARIABLE_VALUE"), embeddings)
    else:
        assert 'tensor_path: "tensors.tsv"' in text
        np.testing.assert_allclose(np.loadtxt(tmp_path / "tensors.tsv", delimiter="\t"),
                                   embeddings, rtol=1e-6)
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # renamed into place


def test_projector_metadata_of_several_label_columns(tmp_path):
    C.export_projector(np.ones((2, 3)), np.array([[1, 10], [2, 20]]), tmp_path,
                       checkpoint=False)
    rows = (tmp_path / "metadata.tsv").read_text().splitlines()
    assert rows == ["label\tlevel_1", "1\t10", "2\t20"]
    with pytest.raises(ValueError, match="one label per embedding"):
        C.export_projector(np.ones((2, 3)), [1, 2, 3], tmp_path)


def test_projector_callback_exports_at_the_end(tmp_path):
    model = _regressor(0.01)
    projector = C.EmbeddingProjector(tmp_path / "projector", POINTS, LABELS)
    model.fit(POINTS, POINTS, epochs=1, verbose=0, callbacks=[projector])
    rows = (tmp_path / "projector" / "metadata.tsv").read_text().splitlines()
    assert len(rows) == len(POINTS)


def test_umap_without_the_viz_extra_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "umap", None)  # as if umap-learn were not installed
    with pytest.raises(ImportError, match=r'pip install "tfaploss\[viz\]"'):
        C.umap_figure(POINTS, LABELS, tmp_path / "umap.png")


def test_health_monitor_is_public_here():
    from tfaploss.training.health import TrainingHealthMonitor

    assert C.TrainingHealthMonitor is TrainingHealthMonitor
