"""How an evaluation searches, checked and decided once: :class:`SearchPlan`.

The plan holds the backend asked for, the target recall and the k of recall@k, checked
where it is made (the config's ``evaluation`` section makes one); the trainer,
``evaluate``, ``tfaploss evaluate`` and ``build_searcher`` ask it and never check or
decide again.

``backend="auto"`` is resolved once, when first asked (:attr:`SearchPlan.resolved`):
without a target recall, exact search (an approximate search's recall would be
unknown, its metrics comparable with no one's); with one, the first installed of
ScaNN and faiss, else exact search, which meets any target. The choice is logged at
INFO once per process and described by :attr:`SearchPlan.auto`. A target recall with
a named backend tunes faiss's settings for ``"faiss"``, ScaNN's for any other
(``"exact"`` too: asking for a recall asks for approximate search).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from tfaploss import extras
from tfaploss.evaluation.arrays import check_int

LOG = logging.getLogger(__name__)

__all__ = ["AUTO", "BACKENDS", "CHOICES", "DEFAULT_K", "SearchPlan"]

BACKENDS = ("exact", "scann", "scann_ah", "faiss")
AUTO = "auto"
CHOICES = (AUTO, *BACKENDS)  # every name `backend` accepts
DEFAULT_K = 10  # the k of the tuned recall@k when neither the plan nor an evaluation names one
# Tried in this order when a target recall is set: the first installed one is used.
_TUNED_ORDER = ("scann", "faiss")
# The extra each named backend needs (exact and auto need none).
_BACKEND_EXTRAS = {"scann": "scann", "scann_ah": "scann", "faiss": "faiss"}
_logged: set[tuple] = set()


@dataclasses.dataclass(frozen=True)
class SearchPlan:
    """The search of an evaluation (a ValueError names an argument out of range).

    Args:
      backend: ``"auto"`` (default) or one of :data:`BACKENDS`.
      target_recall: ``None`` (default): search with ``backend`` as it is. A value in
        (0, 1]: tune the search to reach this recall@k against exact search, on a
        sample of the queries (exact search when no setting beats it).
      k: the k of that recall@k; ``None``: the largest cut-off of the evaluation
        (:meth:`with_k`), else :data:`DEFAULT_K`.
    """

    backend: str = AUTO
    target_recall: float | None = None
    k: int | None = None

    def __post_init__(self):
        if self.backend not in CHOICES:
            raise ValueError(f"`backend` must be one of {CHOICES}; received "
                             f"{self.backend!r}.")
        t = self.target_recall
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not 0 < t <= 1):
            raise ValueError(f"`target_recall` must be in (0, 1] or None; received {t!r}.")
        check_int("k", self.k, none=True)

    @classmethod
    def of(cls, backend: str | SearchPlan = AUTO, target_recall: float | None = None,
           k: int | None = None) -> SearchPlan:
        """``backend`` itself when it is a plan (then with neither ``target_recall`` nor
        ``k`` beside it), else the plan of the three."""
        if isinstance(backend, SearchPlan):
            if target_recall is not None or k is not None:
                raise ValueError("`target_recall` and `k` belong to the SearchPlan given "
                                 "as `backend`, not beside it.")
            return backend
        return cls(backend, target_recall, k)

    @functools.cached_property
    def _choice(self) -> tuple[str, str | None]:
        """(the concrete backend, why auto chose it or None), decided once a plan."""
        if self.backend != AUTO:
            return self.backend, None
        choice, why = _choose(self.target_recall)
        if (self.target_recall, choice) not in _logged:
            _logged.add((self.target_recall, choice))
            LOG.info("search backend auto: %s (%s)", choice, why)
        return choice, why

    @property
    def resolved(self) -> str:
        """The concrete backend of :data:`BACKENDS` (``backend`` unless it is auto)."""
        return self._choice[0]

    @property
    def auto(self) -> dict | None:
        """What auto chose and why, for a report; ``None`` for a named backend."""
        if self.backend != AUTO:
            return None
        return {"requested": AUTO, "chosen": self.resolved, "reason": self._choice[1]}

    @property
    def tuner(self) -> str | None:
        """Whose settings are tuned to the target: ``"faiss"`` or ``"scann"``; ``None``
        without a target, or when auto found no tuned searcher installed (exact search
        meets any target)."""
        if self.target_recall is None:
            return None
        if self.resolved == "faiss":
            return "faiss"
        return None if self.backend == AUTO and self.resolved == "exact" else "scann"

    @property
    def tuned_k(self) -> int:
        """The k of the tuned recall@k."""
        return DEFAULT_K if self.k is None else int(self.k)

    def with_k(self, k: int) -> SearchPlan:
        """This plan, its k set to ``k`` unless it names one (auto stays resolved)."""
        if self.k is not None:
            return self
        plan = dataclasses.replace(self, k=k)
        if "_choice" in self.__dict__:
            plan.__dict__["_choice"] = self._choice
        return plan

    def required_extra(self, key: str = "backend") -> tuple[str, str] | None:
        """``(extra, what needs it)`` for this search, e.g. ``("scann",
        "evaluation.backend: scann_ah")``, or ``None`` when the core install does (auto
        takes what is installed). ``key`` names the setting in the message."""
        if self.backend == AUTO:
            return None
        if self.backend in _BACKEND_EXTRAS:
            return _BACKEND_EXTRAS[self.backend], f"{key}: {self.backend}"
        if self.tuner == "scann":
            return "scann", (f"target_recall {self.target_recall:g} with {key}: "
                             f"{self.backend} (the ScaNN tuner; {key}: auto searches "
                             f"exactly without ScaNN)")
        return None

    def describe(self) -> str:
        """The search in a few words, as ``tfaploss evaluate`` shows it."""
        if self.target_recall is None:
            return f"{self.resolved} search" + (" (auto)" if self.backend == AUTO else "")
        if self.tuner is None:
            return (f"exact search (auto: no tuned searcher installed; exact meets recall "
                    f">= {self.target_recall:g})")
        return (f"{'ScaNN' if self.tuner == 'scann' else 'faiss'} search tuned to recall "
                f">= {self.target_recall:g} (exact when no setting beats it)")


def _choose(target_recall: float | None) -> tuple[str, str]:
    if target_recall is None:
        return "exact", ("no target recall set: exact search, the reference (set "
                         "evaluation.target_recall for a tuned approximate search)")
    for name in _TUNED_ORDER:
        if extras.usable(name):
            return name, f"{name} is installed: tuned to recall >= {target_recall:g}"
    return "exact", (f"neither of {', '.join(_TUNED_ORDER)} is installed: exact search, which "
                     f"meets recall >= {target_recall:g} (recall 1); "
                     f"{extras.install_command('scann')} for a faster tuned search")
