"""How many queries of a run have no positive in their batch, and one warning when most do.

The ``tfaploss.training`` metric ``LoneQueryShare`` counts them in the compiled step and
``LoneQueryMonitor`` hands the counts to the loss's :class:`LoneQueryTracker` (why and
how: ``docs/losses.md``, "How many there are"; the warning's text says it too).
"""

from __future__ import annotations

import collections
import inspect
import warnings

__all__ = ["LONE_SHARE_LIMIT", "MIN_STEPS", "WINDOW_STEPS", "LoneQueriesWarning",
           "LoneQueryTracker"]

#: "Most queries": above half, the loss's mean rests on fewer queries than it leaves out.
LONE_SHARE_LIMIT = 0.5
#: Steps judged together: one unlucky batch does not warn, an unbalanced run is warned
#: about within its first epoch.
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
    """The share of lone queries (no positive other than themselves) over recent steps,
    ``loss.lone_queries`` (usage: ``docs/losses.md``, "How many there are").

    :meth:`update` takes the counts of lone and of all queries of one or more steps;
    the recent steps are the latest updates covering at most :data:`WINDOW_STEPS`
    steps (at least :data:`MIN_STEPS`). When their share exceeds
    :data:`LONE_SHARE_LIMIT`, a :class:`LoneQueriesWarning` is raised once per run (a
    run restarts at :meth:`start_run`), whatever Python's warning filter has seen.

    Args:
        warn: raise the warning (False with ``drop_lone_queries=True``); the counts are
            kept either way.
    """

    def __init__(self, warn: bool = True):
        self.warn = warn
        self.start_run()

    def start_run(self) -> None:
        """Forget the counts and warn again (a new ``fit``)."""
        self._window = collections.deque(maxlen=WINDOW_STEPS)  # (lone, queries, steps)
        self._epoch = [0, 0]
        self.warned = False

    def _recent(self) -> tuple[int, int, int]:
        """(lone, queries, steps) of the recent steps."""
        lone = queries = steps = 0
        for chunk_lone, chunk_queries, chunk_steps in reversed(self._window):
            if steps >= MIN_STEPS and steps + chunk_steps > WINDOW_STEPS:
                break
            lone, queries, steps = lone + chunk_lone, queries + chunk_queries, steps + chunk_steps
        return lone, queries, steps

    @property
    def share(self) -> float | None:
        """The share of lone queries over the recent steps (None before any count)."""
        lone, queries, _ = self._recent()
        return lone / queries if queries else None

    def take_epoch(self) -> float | None:
        """The share of lone queries since the last call (None: nothing was counted),
        then start counting again."""
        lone, total = self._epoch
        self._epoch = [0, 0]
        return lone / total if total else None

    def update(self, lone, queries, steps: int = 1) -> None:
        """Count ``lone`` of ``queries`` queries over ``steps`` steps; warn if most of
        the recent steps' queries were lone."""
        lone, queries, steps = int(lone), int(queries), int(steps)
        if queries <= 0 or steps <= 0:
            return
        self._window.append((lone, queries, steps))
        self._epoch[0] += lone
        self._epoch[1] += queries
        if self.warned or not self.warn:
            return
        lone, queries, steps = self._recent()
        if steps >= MIN_STEPS and lone / queries > LONE_SHARE_LIMIT:
            self.warned = True
            # A fresh registry: the default filter would warn once per process, not run.
            warnings.warn_explicit(_message(lone / queries, steps), LoneQueriesWarning,
                                   __file__, inspect.currentframe().f_lineno,
                                   module=__name__, registry={})

    def __getstate__(self):
        # A copied or pickled loss (Keras clones, tests) starts its own run.
        return {"warn": self.warn}

    def __setstate__(self, state):
        self.__init__(state["warn"])
