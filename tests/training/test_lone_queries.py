"""The lone-query metric (``LoneQueryShare``) and its callback (``LoneQueryMonitor``).

The counts are checked against a hand-derived batch, a NumPy reference on random label
multisets and weights, and the loss's own definition (the ``informative`` mask the
loss computes, which its host callback used to count); then inside ``fit``: the logs,
``epochs.jsonl``'s rows, TensorFlow under XLA (where the loss's callback counted
nothing), two replicas and ``MultiStageModel``.
"""

import json
import warnings

import keras
import numpy as np
import pytest
from keras import ops

from tfaploss.losses import RetrievalLoss, SmoothAPLoss
from tfaploss.losses.lone_queries import LoneQueriesWarning
from tfaploss.ops.hap import hierarchy_levels
from tfaploss.ops.masks import label_masks, self_pair_mask
from tfaploss.training import LoneQueryMonitor, LoneQueryShare, MultiStageModel
from tfaploss.training.callbacks import EpochLogger
from tfaploss.training.lone_queries import lone_query_counts

# 8 batches of 8: one pair and six lone classes each (6 of 8 queries lone).
UNBALANCED = np.array([label for b in range(8)
                       for label in [100 + b] * 2 + list(range(6 * b, 6 * b + 6))])


def _compiled_counts():
    # JAX runs each op of an eager call compiled for its shapes: one compiled call per
    # shape instead (what a training step does anyway).
    if keras.backend.backend() != "jax":
        return lone_query_counts
    import jax

    return jax.jit(lone_query_counts)


_COUNTS = _compiled_counts()
# Batch sizes of the random tests: few shapes (JAX compiles per shape), 1 and 2 included.
SIZES = (1, 2, 5, 16, 37, 64)


def _counts(labels, sample_weight=None):
    lone, queries = _COUNTS(labels, sample_weight)
    return int(ops.convert_to_numpy(lone)), int(ops.convert_to_numpy(queries))


def reference(labels, sample_weight=None):
    """NumPy: a query (weight > 0) is lone when no other item shares any of its
    labels' levels."""
    labels = np.asarray(labels).reshape(len(labels), -1)
    same = (labels[:, None, :] == labels[None, :, :]).any(-1)
    np.fill_diagonal(same, False)
    lone = ~same.any(1)
    query = (np.ones(len(labels), bool) if sample_weight is None
             else np.broadcast_to(np.asarray(sample_weight).reshape(-1) > 0, lone.shape))
    return int((lone & query).sum()), int(query.sum())


def loss_definition(labels, include_self):
    """The counts the loss handed its tracker: (not informative, all), from the masks
    the loss builds (``RetrievalLoss.call``; HAPLoss: ``level > 0``)."""
    labels = np.asarray(labels)
    n = len(labels)
    self_pairs = self_pair_mask(n) if include_self else None
    if labels.ndim == 2:
        candidates = (ops.ones((n, n), "bool") if include_self
                      else ops.logical_not(self_pair_mask(n)))
        positives = ops.logical_and(hierarchy_levels(labels, labels) > 0, candidates)
    else:
        positives, _ = label_masks(labels, labels, exclude_self=not include_self)
    informative = ops.convert_to_numpy(
        RetrievalLoss.other_positive_counts(positives, self_pairs) > 0)
    return int((~informative).sum()), n


def test_hand_derived_counts():
    labels = np.array([1, 1, 2, 3, 3, 3, 4])
    # lone: the 2 and the 4
    assert _counts(labels) == (2, 7)
    assert _counts(labels[:, None]) == (2, 7)
    # weight 0 leaves items 1 and 5 out as queries, not as positives of items 0 and 4;
    # the 4 (weight 0.5) is still a query
    assert _counts(labels, np.array([1, 0, 1, 1, 1, 0, 0.5])) == (2, 5)
    assert _counts(labels, np.array([1, 1, 0, 1, 1, 1, 0])[:, None]) == (0, 5)
    assert _counts(labels, 0.0) == (0, 0)
    assert _counts(labels, 2.0) == (2, 7)
    assert _counts(np.array([7])) == (1, 1)
    assert _counts(np.array([5.0, 5.0, -1.0])) == (1, 3)  # float labels
    # levels: items 0 and 1 share the coarse level 10; 2 and 3 share nothing
    levels = np.array([[1, 10], [2, 10], [3, 11], [4, 12]])
    assert _counts(levels) == (2, 4)
    assert _counts(np.zeros((0,), "int32")) == (0, 0)
    # one replica's rows of a gathered batch: rows 2..4 hold the 2 and two 3s
    lone, queries = lone_query_counts(labels, rows=(2, 5))
    assert (int(ops.convert_to_numpy(lone)), int(ops.convert_to_numpy(queries))) == (1, 3)
    lone, queries = lone_query_counts(labels, np.array([1, 1, 0, 1, 1, 1, 1]), rows=(2, 7))
    assert (int(ops.convert_to_numpy(lone)), int(ops.convert_to_numpy(queries))) == (1, 4)


def test_labels_of_another_rank_are_refused():
    with pytest.raises(ValueError, match=r"labels must have shape \(batch,\).*\(2, 2, 2\)"):
        lone_query_counts(np.zeros((2, 2, 2), "int32"))


@pytest.mark.parametrize("include_self", [False, True])
@pytest.mark.parametrize("levels", [0, 2], ids=["labels", "two_levels"])
def test_counts_are_the_losses_lone_queries(include_self, levels):
    """The metric's counts equal what the loss counted before (its informative mask)."""
    rng = np.random.default_rng(3 + levels)
    for n in SIZES * 3:
        labels = rng.integers(0, int(rng.integers(1, 2 * n + 1)), n)
        if levels:
            labels = np.stack([labels, labels // 3], axis=1)
        assert _counts(labels) == loss_definition(labels, include_self), labels


def test_counts_match_the_reference_on_random_multisets():
    rng = np.random.default_rng(0)
    for n in SIZES * 10:
        labels = rng.integers(0, int(rng.integers(1, n + 2)), n)
        weights = rng.choice([0.0, 0.25, 1.0], size=n, p=[0.3, 0.2, 0.5])
        assert _counts(labels) == reference(labels)
        assert _counts(labels, weights) == reference(labels, weights), (labels, weights)
        two = np.stack([labels, rng.integers(0, n + 1, n)], axis=1)
        assert _counts(two, weights) == reference(two, weights), (two, weights)


def test_counts_match_the_reference_hypothesis():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
    @hypothesis.given(st.lists(st.tuples(st.integers(-3, 12), st.sampled_from([0.0, 0.5, 1.0])),
                               min_size=1, max_size=40))
    def check(items):
        labels = np.array([label for label, _ in items], "int32")
        weights = np.array([w for _, w in items], "float32")
        assert _counts(labels) == reference(labels)
        assert _counts(labels, weights) == reference(labels, weights)

    check()


def test_a_batch_of_4096():
    """O(B log B) time, O(B) memory: B = 4096 is a few sorts (a B x B mask would be
    16M entries)."""
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3000, 4096)
    values, counts = np.unique(labels, return_counts=True)
    lone = int(np.isin(labels, values[counts == 1]).sum())
    assert lone > 500
    assert _counts(labels) == (lone, 4096)


# -- in fit ------------------------------------------------------------------------------


def _x(n=64):
    return np.random.default_rng(0).standard_normal((n, 6)).astype("float32")


def _model(loss=None, jit_compile="auto", weighted=False, metric=True):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
    metrics = [LoneQueryShare()] if metric else None
    model.compile(optimizer="sgd", loss=loss or SmoothAPLoss(), jit_compile=jit_compile,
                  metrics=None if weighted else metrics,
                  weighted_metrics=metrics if weighted else None)
    return model


def _fit(model, labels, callbacks=(), epochs=2, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        history = model.fit(_x(len(labels)), labels, batch_size=8, epochs=epochs,
                            shuffle=False, verbose=0, callbacks=list(callbacks), **kwargs)
    return history.history, [w for w in caught if issubclass(w.category, LoneQueriesWarning)]


def test_fit_logs_the_epochs_counts():
    logs, _ = _fit(_model(), UNBALANCED)
    assert logs["lone_query_count"] == [48, 48]
    assert logs["query_count"] == [64, 64]
    assert logs["lone_query_share"] == pytest.approx([0.75, 0.75])


def test_weighted_metrics_leave_out_the_queries_of_weight_zero():
    weights = np.ones(64, "float32")
    weights[2:8] = 0.0   # the first batch's six lone items
    weights[0] = 0.0     # and one of its pair: its partner stays non-lone
    logs, _ = _fit(_model(weighted=True), UNBALANCED, epochs=1, sample_weight=weights)
    assert (logs["lone_query_count"], logs["query_count"]) == ([42], [57])


@pytest.mark.tensorflow
def test_xla_counts_and_warns():
    """jit_compile=True on TensorFlow: the loss's host callback counted nothing here."""
    loss = SmoothAPLoss()
    model = _model(loss, jit_compile=True)
    monitor = LoneQueryMonitor(every=3)
    logs, caught = _fit(model, UNBALANCED, [monitor])
    assert model.jit_compile is True
    assert logs["lone_query_share"] == pytest.approx([0.75, 0.75])
    assert len(caught) == 1
    # reads after steps 3 and 6 and at the epoch's end (8), each epoch
    assert [steps for _, _, steps in loss.lone_queries._window] == [3, 3, 2, 3, 3, 2]
    assert loss.lone_queries.take_epoch() == pytest.approx(0.75)


def test_the_monitor_reads_every_n_steps():
    loss = SmoothAPLoss()
    _fit(_model(loss), UNBALANCED, [LoneQueryMonitor(every=3)], epochs=1)
    window = list(loss.lone_queries._window)
    if keras.backend.backend() != "jax":
        assert window == [(18, 24, 3), (18, 24, 3), (12, 16, 2)]
    else:
        # JAX: the reads run in Keras's callback threads; one that comes after a later
        # one is folded into the next read (the counts are cumulative), so the chunks
        # may merge, never lose a query.
        assert len(window) >= 2 and window[-1][2] <= 8 - 3
        assert [sum(c[i] for c in window) for i in range(3)] == [48, 64, 8]
        assert all(lone * 4 == queries * 3 for lone, queries, _ in window)


def test_the_monitor_refuses_a_bad_interval():
    with pytest.raises(ValueError, match="every must be an int >= 1; received every=0"):
        LoneQueryMonitor(every=0)


def _spread(y_true, y_pred):
    """A plain Keras loss function, which keeps no lone-query tracker."""
    return ops.mean(ops.square(y_pred), axis=-1)


def test_a_loss_without_a_tracker_gets_the_monitors_own():
    monitor = LoneQueryMonitor()
    _, caught = _fit(_model(_spread), UNBALANCED, [monitor], epochs=1)
    assert monitor.tracker.share == pytest.approx(0.75)
    assert len(caught) == 1


def test_epoch_logger_rows_hold_the_share(tmp_path):
    path = tmp_path / "epochs.jsonl"
    _fit(_model(), UNBALANCED, [LoneQueryMonitor(), EpochLogger(path)])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["lone_query_share"] for r in rows] == [0.75, 0.75]
    assert [(r["lone_query_count"], r["query_count"]) for r in rows] == [(48, 64)] * 2


def test_epoch_logger_rows_are_null_when_nothing_was_counted(tmp_path):
    without = tmp_path / "without.jsonl"
    _fit(_model(metric=False), UNBALANCED, [EpochLogger(without)], epochs=1)
    assert json.loads(without.read_text())["lone_query_share"] is None
    zero = tmp_path / "zero.jsonl"
    _fit(_model(weighted=True), UNBALANCED, [EpochLogger(zero)], epochs=1,
         sample_weight=np.zeros(64, "float32"))
    row = json.loads(zero.read_text())
    assert row["lone_query_share"] is None and row["query_count"] == 0


def test_multistage_model_counts():
    keras.utils.set_random_seed(0)
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
    model = MultiStageModel(inner, chunk_size=4)
    loss = SmoothAPLoss()
    model.compile(optimizer="sgd", loss=loss, metrics=[LoneQueryShare()])
    logs, caught = _fit(model, UNBALANCED, [LoneQueryMonitor()], epochs=1)
    assert (logs["lone_query_count"], logs["query_count"]) == ([48], [64])
    assert len(caught) == 1


@pytest.mark.tensorflow
def test_two_replicas_count_the_global_batch(two_replica_strategy):
    """Each replica's shard holds one item of every class: per shard all would be
    lone, in the global batch (what the loss ranks) none is."""
    from tests.support.shard_layout import CLASSES, dense_model, layout

    x, y = layout(2)
    x, y = np.concatenate([x, x]), np.concatenate([y, y])  # two steps of 2 x CLASSES
    with two_replica_strategy.scope():
        model = dense_model()
        loss = SmoothAPLoss()
        model.compile(optimizer="sgd", loss=loss, metrics=[LoneQueryShare()])
    history = model.fit(x, y, batch_size=2 * CLASSES, epochs=1, shuffle=False, verbose=0,
                        callbacks=[LoneQueryMonitor(every=1)])
    assert history.history["query_count"] == [4 * CLASSES]
    assert history.history["lone_query_count"] == [0]
    # the read between the steps (the metric's variables, summed over the replicas)
    assert list(loss.lone_queries._window) == [(0, 2 * CLASSES, 1), (0, 2 * CLASSES, 1)]
