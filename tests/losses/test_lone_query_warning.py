"""The warning of a run whose batches leave most queries without a positive.

A plain ``model.fit(x, y, batch_size=8)`` over many classes: most items are alone with
their class in the batch. The ``LoneQueryShare`` metric counts them inside the step on
every backend, ``LoneQueryMonitor`` hands the counts to the loss's tracker, which warns
once per run, naming the fixes. The loss itself counts nothing: no host call in its
step.
"""

import warnings

import keras
import numpy as np
import pytest

from tfaploss.losses import HAPLoss, SmoothAPLoss, SupAPLoss
from tfaploss.losses.lone_queries import (
    LONE_SHARE_LIMIT,
    MIN_STEPS,
    WINDOW_STEPS,
    LoneQueriesWarning,
    LoneQueryTracker,
)
from tfaploss.training import LoneQueryMonitor, LoneQueryShare

# 64 items in batches of 8 (shuffle=False): one pair and six lone classes per batch,
# so 6 of every 8 queries are lone, 0.75 exactly.
UNBALANCED = np.array([label for b in range(8)
                       for label in [100 + b] * 2 + list(range(6 * b, 6 * b + 6))])
# The same items, 4 classes x 2 images per batch: no query is lone.
BALANCED = np.repeat(np.arange(32), 2)


def _x(n=64):
    return np.random.default_rng(0).standard_normal((n, 6)).astype("float32")


def _fit(loss, labels, *, run_eagerly=False, epochs=2, shuffle=False, model=None,
         metric=True, monitor=True):
    """``fit`` as a user writes it (the metric compiled, the monitor passed); the
    LoneQueriesWarning it raised, and the model."""
    if model is None:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss=loss, run_eagerly=run_eagerly,
                      metrics=[LoneQueryShare()] if metric else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a user's session shows
        model.fit(_x(), labels, batch_size=8, epochs=epochs, shuffle=shuffle, verbose=0,
                  callbacks=[LoneQueryMonitor()] if monitor else None)
    return [w for w in caught if issubclass(w.category, LoneQueriesWarning)], model


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["compiled", "eager"])
def test_plain_fit_warns_once_with_the_fix(run_eagerly):
    loss = SmoothAPLoss(include_self=True)
    caught, _ = _fit(loss, UNBALANCED, run_eagerly=run_eagerly)
    assert len(caught) == 1, [str(w.message) for w in caught]  # 16 steps, one warning
    text = str(caught[0].message)
    # The first read is the end of the first epoch: 8 steps.
    assert text.startswith("tfaploss: 75% of the queries of the last 8 training steps")
    assert "sampler='m_per_class'" in text and "drop_lone_queries=True" in text
    assert loss.lone_queries.share == pytest.approx(0.75)
    assert loss.lone_queries.share > LONE_SHARE_LIMIT


def test_shuffled_plain_fit_warns():
    """The case users hit: shuffled batches of 8 from 32 classes of 2 images."""
    caught, _ = _fit(SupAPLoss(), BALANCED, shuffle=True)
    assert len(caught) == 1


def test_class_balanced_fit_gives_no_warning():
    loss = SmoothAPLoss(include_self=True)
    caught, _ = _fit(loss, BALANCED)
    assert caught == []
    assert loss.lone_queries.share == 0.0


def test_drop_lone_queries_turns_the_warning_off():
    loss = SmoothAPLoss(include_self=True, drop_lone_queries=True)
    caught, _ = _fit(loss, UNBALANCED)
    assert caught == []
    assert loss.lone_queries.share == pytest.approx(0.75)  # still counted


def test_hierarchical_labels_are_lone_only_without_a_shared_level():
    """HAPLoss: an item sharing a coarse level with another is not lone. Fine classes
    as UNBALANCED (6 of 8 lone), super-classes that pair items 2k and 2k+1: none lone."""
    levels = np.stack([UNBALANCED, np.arange(64) // 2], axis=1)
    loss = HAPLoss()
    caught, _ = _fit(loss, levels)
    assert caught == []
    assert loss.lone_queries.share == 0.0
    caught, _ = _fit(HAPLoss(), np.stack([UNBALANCED, UNBALANCED], axis=1))
    assert len(caught) == 1


def test_each_fit_is_a_run_and_warns_again():
    """A second run (a new loss, or another fit of the same model) is warned again,
    under Python's default filter."""
    first, _ = _fit(SmoothAPLoss(), UNBALANCED)
    second, model = _fit(SmoothAPLoss(), UNBALANCED)
    assert len(first) == len(second) == 1
    again, _ = _fit(None, UNBALANCED, model=model)
    assert len(again) == 1


def test_the_tracker_warns_once_per_run():
    tracker = LoneQueryTracker()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(MIN_STEPS - 1):
            tracker.update(6, 8)
        assert caught == []  # fewer steps than MIN_STEPS are not judged
        for _ in range(3 * WINDOW_STEPS):
            tracker.update(6, 8)
        assert len(caught) == 1 and tracker.warned
        tracker.start_run()
        tracker.update(6 * MIN_STEPS, 8 * MIN_STEPS, steps=MIN_STEPS)  # one chunk
        assert len(caught) == 2
    assert "of the last 5 training steps" in str(caught[1].message)


def test_the_window_is_the_last_steps_in_chunks():
    """Chunks of steps (the monitor's reads): the recent steps are the latest chunks
    covering at most WINDOW_STEPS steps, and at least MIN_STEPS."""
    tracker = LoneQueryTracker(warn=False)
    tracker.update(0, 160, steps=WINDOW_STEPS)        # balanced
    tracker.update(160, 160, steps=WINDOW_STEPS)      # all lone
    assert tracker.share == 1.0                       # the last 20 steps only
    tracker.update(0, 8 * 3, steps=3)                 # 3 steps < MIN_STEPS: one more chunk
    assert tracker.share == pytest.approx(160 / (160 + 24))
    assert tracker.take_epoch() == pytest.approx(160 / 344)  # every chunk


def test_epoch_share_is_taken_per_epoch():
    loss = SmoothAPLoss()
    _fit(loss, UNBALANCED, epochs=1)
    assert loss.lone_queries.take_epoch() == pytest.approx(0.75)
    assert loss.lone_queries.take_epoch() is None  # nothing counted since


def test_the_loss_alone_counts_nothing():
    """The loss puts no counting into its step: without the metric and the monitor
    nothing is counted (eager and compiled; before, the loss counted through a host
    callback)."""
    loss = SmoothAPLoss()
    loss(UNBALANCED[:8], _x(8))
    caught, _ = _fit(loss, UNBALANCED, metric=False, monitor=False)
    assert caught == []
    assert loss.lone_queries.share is None


def test_the_monitor_without_the_metric_says_so(caplog):
    loss = SmoothAPLoss()
    with caplog.at_level("WARNING", logger="tfaploss"):
        caught, _ = _fit(loss, UNBALANCED, metric=False)
    assert caught == []
    said = [r for r in caplog.records if "without tfaploss.training.LoneQueryShare" in
            r.getMessage()]
    assert len(said) == 1  # once per run, not per epoch


# -- no host call in the loss's step ---------------------------------------------------

_PY_FUNCS = {"EagerPyFunc", "PyFunc", "PyFuncStateless"}


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="a jaxpr: JAX only")
@pytest.mark.parametrize("cls", [SmoothAPLoss, HAPLoss])
def test_the_traced_loss_has_no_host_callback_jax(cls):
    import jax

    loss = cls()
    jaxpr = jax.make_jaxpr(lambda y, x: loss(y, x))(UNBALANCED[:8].astype("int32"), _x(8))
    text = str(jaxpr)  # nested jaxprs (pjit, custom_vjp, while) print inline
    assert "add" in text  # the printout holds the loss's primitives
    assert "callback" not in text, [e.primitive.name for e in jaxpr.jaxpr.eqns]


@pytest.mark.tensorflow
@pytest.mark.parametrize("cls", [SmoothAPLoss, HAPLoss])
def test_the_traced_loss_has_no_host_call_tf(cls):
    """No py_function in the step's graph. The one left in the loss is the warning of a
    batch without any positive pair: the else branch of a cond, run only then."""
    import tensorflow as tf

    loss = cls()
    step = tf.function(lambda y, x: loss(y, x))
    graph = step.get_concrete_function(tf.TensorSpec((8,), tf.int32),
                                       tf.TensorSpec((8, 6), tf.float32)).graph
    definition = graph.as_graph_def()
    nodes = {"": list(definition.node)}
    nodes.update({f.signature.name: list(f.node_def) for f in definition.library.function})
    assert len(nodes[""]) > 20
    assert not {n.op for n in nodes[""]} & _PY_FUNCS
    rare = {n.attr["else_branch"].func.name for body in nodes.values() for n in body
            if n.op in ("If", "StatelessIf")}
    calling = {name for name, body in nodes.items() if {n.op for n in body} & _PY_FUNCS}
    assert calling <= rare, calling - rare
