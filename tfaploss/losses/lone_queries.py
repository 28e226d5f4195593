"""How many queries of a run have no positive in their batch, and one warning when most do.

A ranking loss learns only from queries with a positive. With plain shuffling
(``model.fit(x, y, batch_size=8, shuffle=True)`` over many classes) most items are
alone with their class in the batch: they are left out of the mean, so the loss looks
small and healthy while it learns from a handful of queries. Every
:class:`~tfaploss.losses.RetrievalLoss` counts them as it ranks a batch against itself
(the counts it already needs for its mask) and hands them to its
:class:`LoneQueryTracker` (``loss.lone_queries``), which warns once per run when most
queries of its recent steps were lone.

The counts reach Python from a compiled step by each backend's host callback:
``jax.debug.callback`` under ``jax.jit``, ``tf.py_function`` in a ``tf.function``;
eager TensorFlow and PyTorch hand over the values directly. TensorFlow under XLA
(``jit_compile=True``; Keras's ``"auto"`` picks it on a GPU) cannot call the host, so
there the check stays silent.
"""

from __future__ import annotations

import collections
import inspect
import warnings

__all__ = ["LONE_SHARE_LIMIT", "MIN_STEPS", "WINDOW_STEPS", "LoneQueriesWarning",
           "LoneQueryTracker"]

#: "Most queries": above half, the loss's mean rests on fewer queries than it leaves out.
LONE_SHARE_LIMIT = 0.5
#: Steps judged together: enough that one unlucky batch does not warn, few enough that
#: the warning comes within the first epoch of any run that uses it (an unbalanced
#: batch is lone-heavy at every step, not now and then).
WINDOW_STEPS = 20
#: The fewest steps judged: fits of a few steps (tests, demos) are warned too.
MIN_STEPS = 5


class LoneQueriesWarning(UserWarning):
    """Most queries of a run's recent batches had no positive in their batch."""


def _message(share: float, steps: int) -> str:
    return (
        f"tfaploss: {share:.0%} of the queries of the last {steps} training steps had no "
        "other item of their class in the batch. They give no ranking signal, and the "
        "loss (0 for them, or the score of their self-match) looks better than the "
        "training is. Draw class-balanced batches with "
        "tfaploss.data.make_train_dataset(path, sampler='m_per_class', m=4) (m images "
        "of each class in every batch), or pass drop_lone_queries=True to the loss to "
        "leave them out of its mean (then this warning is off)."
    )


class LoneQueryTracker:
    """The share of lone queries (no positive other than themselves) over recent steps.

    The loss calls :meth:`update` once per batch ranked against itself, with the counts
    of lone and of all queries. When the share over the last :data:`WINDOW_STEPS`
    steps (at least :data:`MIN_STEPS`) exceeds :data:`LONE_SHARE_LIMIT`, a
    :class:`LoneQueriesWarning` is raised, once per run. A run starts with the loss
    (a new loss, a new run) and again at every :meth:`start_run`, which the callbacks
    of ``tfaploss train`` call at the start of each ``fit``. The warning is shown at
    each run whatever Python's "once per location" filter has seen before.

    Args:
        warn: raise the warning (False for a loss that leaves lone queries out on
            purpose, ``drop_lone_queries=True``); the counts are kept either way.

    Example:

    ```python
    loss = tfaploss.losses.SmoothAPLoss()
    model.compile(optimizer="adam", loss=loss)
    model.fit(x, y, batch_size=8)      # warns when most queries are lone
    loss.lone_queries.share            # their share over the last steps
    ```
    """

    def __init__(self, warn: bool = True):
        self.warn = warn
        self.start_run()

    def start_run(self) -> None:
        """Forget the counts and warn again (a new ``fit``)."""
        self._window = collections.deque(maxlen=WINDOW_STEPS)
        self._epoch = [0, 0]
        self.warned = False

    @property
    def share(self) -> float | None:
        """The share of lone queries over the last :data:`WINDOW_STEPS` steps (None
        before the first step)."""
        total = sum(q for _, q in self._window)
        return sum(lone for lone, _ in self._window) / total if total else None

    def take_epoch(self) -> float | None:
        """The share of lone queries since the last call (None: no step was counted,
        e.g. TensorFlow under XLA), then start counting again."""
        lone, total = self._epoch
        self._epoch = [0, 0]
        return lone / total if total else None

    def update(self, lone, queries) -> None:
        """Count one step's ``lone`` of ``queries`` queries; warn if most were lone."""
        lone, queries = int(lone), int(queries)
        if queries <= 0:
            return
        self._window.append((lone, queries))
        self._epoch[0] += lone
        self._epoch[1] += queries
        if self.warned or not self.warn or len(self._window) < MIN_STEPS:
            return
        share = self.share
        if share > LONE_SHARE_LIMIT:
            self.warned = True
            # A fresh registry: Python's "default" filter would show an identical
            # message only once per process, and this warning is once per run.
            warnings.warn_explicit(_message(share, len(self._window)), LoneQueriesWarning,
                                   __file__, inspect.currentframe().f_lineno,
                                   module=__name__, registry={})

    def __deepcopy__(self, memo):
        # A copied loss (Keras clones, tests) starts its own run.
        return LoneQueryTracker(self.warn)

    def __getstate__(self):
        return {"warn": self.warn}

    def __setstate__(self, state):
        self.__init__(state["warn"])
