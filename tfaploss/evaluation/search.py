"""The searcher of an evaluation, built as its
:class:`~tfaploss.evaluation.search_plan.SearchPlan` asks (:func:`build_searcher`), and
what a report says of it (:func:`search_report`)."""

from __future__ import annotations

from typing import Any

from tfaploss.evaluation.exact_search import ExactSearcher
from tfaploss.evaluation.faiss_search import FaissSearcher
from tfaploss.evaluation.scann_search import ScannSearcher
from tfaploss.evaluation.search_plan import SearchPlan
from tfaploss.evaluation.searchers import Searcher
from tfaploss.evaluation.tuner import measure_recall, tune_searcher

__all__ = ["build_searcher", "search_report"]

# How each concrete backend of search_plan.BACKENDS is built when nothing is tuned.
_BUILDERS = {
    "exact": ExactSearcher,
    "scann": lambda database, **kwargs: ScannSearcher(database, mode="brute_force", **kwargs),
    "scann_ah": lambda database, **kwargs: ScannSearcher(database, mode="ah", **kwargs),
    "faiss": FaissSearcher,
}


def build_searcher(database, backend: str | SearchPlan = "exact", *,
                   target_recall: float | None = None, k: int | None = None, queries=None,
                   **kwargs) -> Searcher:
    """The searcher of an evaluation: ``backend`` as named, or tuned to a recall.

    Args:
      database: (N, D) embeddings.
      backend, target_recall, k: a :class:`~tfaploss.evaluation.search_plan.SearchPlan`,
        or its three values: ``"exact"``, ``"scann"`` (ScaNN brute force), ``"scann_ah"``
        (tree + AH + reorder), ``"faiss"`` (flat unless tuned) or ``"auto"``.
      queries: the tuner's sample queries (default: database points, self excluded);
        only with a target recall.
      **kwargs: without a target, the searcher's constructor arguments; with one, the
        tuner's (:func:`~tfaploss.evaluation.tuner.tune_searcher`).

    With a target recall: the fastest setting of the plan's ``tuner`` whose recall@k
    on a sample reaches it, or exact search when none beats it; its report is
    ``searcher.tuning``.
    """
    plan = SearchPlan.of(backend, target_recall, k)
    if plan.target_recall is None:
        if k is not None or queries is not None:
            raise ValueError("`k` and `queries` of build_searcher only apply with "
                             "`target_recall`.")
        searcher = _BUILDERS[plan.resolved](database, **kwargs)
    elif plan.tuner is None:  # auto found nothing to tune: exact search meets the target
        searcher = ExactSearcher(database)
    else:
        searcher, _ = tune_searcher(database, plan, queries, **kwargs)
    searcher.auto = plan.auto
    return searcher


def search_report(searcher: Searcher | None, database, k: int, queries=None,
                  sample_size: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Backend, setting and recall@k (with its interval) of ``searcher``, for a report:
    the tuner's measure, recall 1 for exact search, else measured on a sample."""
    auto = {"auto": searcher.auto} if getattr(searcher, "auto", None) else {}
    tuning = getattr(searcher, "tuning", None)
    if tuning:
        return {**dict(tuning), **auto}
    if searcher is None or searcher.backend == "exact":
        return {"backend": "exact", "setting": "exact", "k": int(k), "recall": 1.0,
                "recall_ci": [1.0, 1.0], "ci_method": "exact search: recall 1 by construction",
                **auto}
    return {"backend": searcher.backend, "setting": searcher.describe(), "tuned": False,
            **measure_recall(searcher, database, k, queries, sample_size, seed), **auto}
