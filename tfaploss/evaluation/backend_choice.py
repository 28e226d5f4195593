"""``backend="auto"``: the search backend an evaluation uses when the user names none.

:func:`resolve_backend` turns ``"auto"`` into a concrete backend of
:data:`~tfaploss.evaluation.searchers.BACKENDS`; :func:`build_searcher
<tfaploss.evaluation.tuner.build_searcher>` calls it first, and so does everything that
builds a searcher from a config (``evaluation.backend``, whose default is ``auto``).

The rule:

- **No target recall** (``target_recall=None``): exact search. Without a recall to
  reach, an approximate search's recall is unknown and its metrics are not comparable
  with anyone's; exact search is the reference, and the blocked BLAS search
  (:mod:`tfaploss.evaluation.exact_search`) handles the test sets of the recipes
  (up to about 10^5 images) in seconds to minutes. Set a target for approximate search.
- **A target recall**: the best installed searcher that can be tuned to it: ScaNN
  (the ``scann`` extra; the tuner of :mod:`tfaploss.evaluation.tuner`), else faiss
  (the ``faiss`` extra, where it is a backend), else exact search, which meets any
  target (recall 1) and is only slower.

The choice is logged at INFO (once per process for each request) and
:func:`auto_record` describes it for a report (``details["search"]["auto"]`` of
``evaluate``, ``final_search`` of a training summary).
"""

from __future__ import annotations

import logging

from tfaploss import extras
from tfaploss.evaluation.searchers import BACKENDS

LOG = logging.getLogger(__name__)

__all__ = ["AUTO", "auto_record", "backend_choices", "check_backend", "required_extra",
           "resolve_backend"]

AUTO = "auto"
# Tried in this order when a target recall is set: the first installed one is used.
_TUNED_ORDER = ("scann", "faiss")
_logged: set[tuple] = set()


def backend_choices() -> tuple[str, ...]:
    """Every name ``backend`` accepts: ``"auto"`` and the concrete backends."""
    return (AUTO, *BACKENDS)


def check_backend(backend) -> str:
    """``backend`` if it names a backend (or ``"auto"``), else ``ValueError``."""
    if backend not in backend_choices():
        raise ValueError(f"`backend` must be one of {backend_choices()}; received "
                         f"{backend!r}.")
    return backend


def _choose(target_recall: float | None) -> tuple[str, str]:
    if target_recall is None:
        return "exact", ("no target recall set: exact search, the reference (set "
                         "evaluation.target_recall for a tuned approximate search)")
    for name in _TUNED_ORDER:
        if name in BACKENDS and extras.usable(name):
            return name, f"{name} is installed: tuned to recall >= {target_recall:g}"
    tried = [n for n in _TUNED_ORDER if n in BACKENDS]
    return "exact", (f"neither of {', '.join(tried)} is installed: exact search, which "
                     f"meets recall >= {target_recall:g} (recall 1); "
                     f"{extras.install_command('scann')} for a faster tuned search")


def resolve_backend(backend: str, target_recall: float | None = None) -> str:
    """The concrete backend ``backend`` stands for (itself unless it is ``"auto"``).

    Args:
      backend: ``"auto"`` or one of :data:`~tfaploss.evaluation.searchers.BACKENDS`.
      target_recall: the recall the search must reach, or ``None``.

    Returns:
      ``"exact"`` without a target; with one, ``"scann"`` if ScaNN imports, else
      ``"faiss"`` if faiss imports (and is a backend), else ``"exact"``. The choice
      and why are logged at INFO.

    Example::

        resolve_backend("auto")                      # "exact"
        resolve_backend("auto", target_recall=0.95)  # "scann" where it is installed
    """
    check_backend(backend)
    if backend != AUTO:
        return backend
    choice, why = _choose(target_recall)
    key = (target_recall, choice)
    if key not in _logged:
        _logged.add(key)
        LOG.info("search backend auto: %s (%s)", choice, why)
    return choice


def auto_record(backend: str, target_recall: float | None = None) -> dict | None:
    """What ``"auto"`` chose and why, for a report; ``None`` for a named backend."""
    if backend != AUTO:
        return None
    choice, why = _choose(target_recall)
    return {"requested": AUTO, "chosen": choice, "reason": why}


# The extra each named backend needs (exact and auto need none).
_BACKEND_EXTRAS = {"scann": "scann", "scann_ah": "scann", "faiss": "faiss"}


def required_extra(backend: str, target_recall: float | None = None,
                   key: str = "backend") -> tuple[str, str] | None:
    """``(extra, what needs it)`` for a search of ``backend`` at ``target_recall``, or
    ``None`` when the core install does (``"exact"`` without a target, ``"auto"``).

    A target with ``"exact"`` asks for the ScaNN tuner (see
    :func:`~tfaploss.evaluation.tuner.build_searcher`). ``key`` names the setting in
    the message (``"evaluation.backend"``, ``"--backend"``).

    Example::

        required_extra("scann_ah", key="evaluation.backend")
        # ("scann", "evaluation.backend: scann_ah")
    """
    check_backend(backend)
    if backend in _BACKEND_EXTRAS:
        return _BACKEND_EXTRAS[backend], f"{key}: {backend}"
    if backend == "exact" and target_recall is not None:
        return "scann", (f"target_recall {target_recall:g} with {key}: exact (the ScaNN "
                         f"tuner; {key}: auto searches exactly without ScaNN)")
    return None
