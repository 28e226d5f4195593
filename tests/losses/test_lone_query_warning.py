"""The warning of a run whose batches leave most queries without a positive.

A plain ``model.fit(x, y, batch_size=8)`` over many classes: most items are alone with
their class in the batch. The loss counts them on every backend (a host callback from
a compiled step) and warns once per run, naming the fixes.
"""

import warnings

import keras
import numpy as np
import pytest

from tfaploss.losses import SmoothAPLoss, SupAPLoss
from tfaploss.losses.lone_queries import LONE_SHARE_LIMIT, LoneQueriesWarning

# 64 items in batches of 8 (shuffle=False): one pair and six lone classes per batch,
# so 6 of every 8 queries are lone, 0.75 exactly.
UNBALANCED = np.array([label for b in range(8)
                       for label in [100 + b] * 2 + list(range(6 * b, 6 * b + 6))])
# The same items, 4 classes x 2 images per batch: no query is lone.
BALANCED = np.repeat(np.arange(32), 2)


def _x(n=64):
    return np.random.default_rng(0).standard_normal((n, 6)).astype("float32")


def _fit(loss, labels, *, run_eagerly=False, epochs=2, shuffle=False, model=None):
    """``fit`` as a user writes it; the LoneQueriesWarning it raised."""
    if model is None:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss=loss, run_eagerly=run_eagerly)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a user's session shows
        model.fit(_x(), labels, batch_size=8, epochs=epochs, shuffle=shuffle, verbose=0)
    return [w for w in caught if issubclass(w.category, LoneQueriesWarning)], model


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["compiled", "eager"])
def test_plain_fit_warns_once_with_the_fix(run_eagerly):
    loss = SmoothAPLoss(include_self=True)
    caught, _ = _fit(loss, UNBALANCED, run_eagerly=run_eagerly)
    assert len(caught) == 1, [str(w.message) for w in caught]  # 16 steps, one warning
    text = str(caught[0].message)
    assert text.startswith("tfaploss: 75% of the queries")
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


def test_once_per_run_not_once_per_process():
    """A second run (a new loss, or the same one re-armed as ``tfaploss train``'s
    callbacks do at each fit) is warned again, under Python's default filter."""
    first, _ = _fit(SmoothAPLoss(), UNBALANCED)
    second, model = _fit(SmoothAPLoss(), UNBALANCED)
    assert len(first) == len(second) == 1
    again, _ = _fit(None, UNBALANCED, model=model)  # same loss, not re-armed
    assert again == []
    model.loss.lone_queries.start_run()
    again, _ = _fit(None, UNBALANCED, model=model)
    assert len(again) == 1


def test_epoch_share_is_taken_per_epoch():
    loss = SmoothAPLoss()
    _fit(loss, UNBALANCED, epochs=1)
    assert loss.lone_queries.take_epoch() == pytest.approx(0.75)
    assert loss.lone_queries.take_epoch() is None  # nothing counted since
