"""The search plan: its checks, and ``backend="auto"``: exact without a target, else the
best installed tuned searcher; the choice logged and reported. Missing searchers are
simulated with ``sys.modules[name] = None`` (nothing is uninstalled)."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest

from tfaploss import extras
from tfaploss.evaluation import build_searcher, retrieval_metrics, search_report
from tfaploss.evaluation.exact_search import ExactSearcher
from tfaploss.evaluation.scann_search import ScannSearcher
from tfaploss.evaluation.search_plan import BACKENDS, CHOICES, SearchPlan

PLAN_LOG = "tfaploss.evaluation.search_plan"


def _data(n=400, d=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True), rng.integers(0, 8, n)


def _block(monkeypatch, *names):
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_named_backends_pass_through_and_unknown_ones_are_refused():
    for name in BACKENDS:
        assert SearchPlan(name).resolved == name
        assert SearchPlan(name, 0.9).resolved == name
    assert CHOICES == ("auto", *BACKENDS)
    with pytest.raises(ValueError, match="`backend` must be one of"):
        SearchPlan("annoy")


@pytest.mark.parametrize("args, match", [
    (("auto", 0), r"`target_recall` must be in \(0, 1\]"), (("auto", 1.01), "received 1.01"),
    (("auto", True), "received True"), (("auto", "0.9"), "received '0.9'"),
    (("auto", 0.9, 0), "`k` must be a positive integer"), (("auto", None, 2.5), "`k`")])
def test_the_plan_checks_its_values_where_it_is_made(args, match):
    with pytest.raises(ValueError, match=match):
        SearchPlan(*args)


def test_a_plan_is_taken_as_it_is_and_keeps_its_k():
    plan = SearchPlan("exact", 0.9)
    assert SearchPlan.of(plan) is plan and SearchPlan.of("exact", 0.9) == plan
    with pytest.raises(ValueError, match="belong to the SearchPlan"):
        SearchPlan.of(plan, target_recall=0.8)
    assert plan.tuned_k == 10 and plan.with_k(5).tuned_k == 5
    assert SearchPlan("exact", 0.9, k=3).with_k(5).k == 3  # the plan's own k wins


def test_auto_without_a_target_is_exact_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger=PLAN_LOG):
        assert SearchPlan("auto").resolved == "exact"
    record = SearchPlan("auto").auto
    assert record["chosen"] == "exact" and "no target recall" in record["reason"]
    assert SearchPlan("exact").auto is None
    x, y = _data()
    searcher = build_searcher(x, "auto")
    assert isinstance(searcher, ExactSearcher)
    assert search_report(searcher, x, 10)["auto"]["chosen"] == "exact"
    # the same metrics as exact search
    assert retrieval_metrics(x, y, backend="auto") == retrieval_metrics(x, y, backend="exact")


def test_auto_with_a_target_and_nothing_installed_is_exact(monkeypatch, caplog):
    _block(monkeypatch, "scann", "faiss")
    caplog.set_level(logging.INFO, logger=PLAN_LOG)
    plan = SearchPlan("auto", 0.93)
    assert plan.resolved == "exact" and plan.tuner is None
    assert any("search backend auto: exact" in r.getMessage()
               and 'pip install "tfaploss[scann]"' in r.getMessage() for r in caplog.records)
    x, _ = _data()
    searcher = build_searcher(x, "auto", target_recall=0.93, k=5)
    assert isinstance(searcher, ExactSearcher)
    report = search_report(searcher, x, 5)
    assert report["backend"] == "exact" and report["recall"] == 1.0
    assert report["auto"] == {"requested": "auto", "chosen": "exact",
                              "reason": plan.auto["reason"]}
    assert "neither of scann, faiss is installed" in plan.auto["reason"]


def test_auto_with_a_target_takes_faiss_when_scann_is_missing(monkeypatch):
    _block(monkeypatch, "scann")
    want = "faiss" if "faiss" in BACKENDS and extras.usable("faiss") else "exact"
    assert SearchPlan("auto", 0.9).resolved == want


def test_auto_with_a_target_takes_scann_where_it_imports():
    if not extras.usable("scann"):
        pytest.skip("ScaNN is not installed here")
    assert SearchPlan("auto", 0.9).resolved == "scann"
    x, _ = _data(n=600)
    searcher = build_searcher(x, "auto", target_recall=0.9, k=5, max_settings=3)
    assert searcher.auto["chosen"] == "scann"
    assert search_report(searcher, x, 5)["auto"]["chosen"] == "scann"


def test_each_backend_names_the_extra_it_needs():
    assert SearchPlan("auto").required_extra() is None
    assert SearchPlan("auto", 0.9).required_extra() is None
    assert SearchPlan("exact").required_extra() is None
    assert SearchPlan("scann").required_extra() == ("scann", "backend: scann")
    assert SearchPlan("scann_ah").required_extra(key="evaluation.backend") == (
        "scann", "evaluation.backend: scann_ah")
    assert SearchPlan("faiss", 0.9).required_extra() == ("faiss", "backend: faiss")
    extra, why = SearchPlan("exact", 0.95).required_extra(key="--backend")
    assert extra == "scann" and "ScaNN tuner" in why and "auto" in why


def test_a_target_names_whose_settings_are_tuned():
    assert SearchPlan("exact").tuner is None and SearchPlan("faiss").tuner is None
    assert SearchPlan("faiss", 0.9).tuner == "faiss"
    for name in ("exact", "scann", "scann_ah"):  # exact search has recall 1: ScaNN's
        assert SearchPlan(name, 0.9).tuner == "scann"
    assert SearchPlan("scann_ah").describe() == "scann_ah search"
    assert SearchPlan("auto").describe() == "exact search (auto)"
    assert SearchPlan("exact", 0.95).describe() == (
        "ScaNN search tuned to recall >= 0.95 (exact when no setting beats it)")
    assert SearchPlan("faiss", 0.9).describe().startswith("faiss search tuned")


def test_scann_search_without_scann_names_the_install_command(monkeypatch):
    _block(monkeypatch, "scann")
    x, _ = _data()
    with pytest.raises(extras.MissingExtraError) as info:
        ScannSearcher(x, mode="brute_force")
    message = str(info.value)
    assert "\n" not in message and 'pip install "tfaploss[scann]"' in message
    assert message.startswith("ScaNN search (backend 'scann'")
    with pytest.raises(ImportError, match=r"tfaploss\[scann\]"):
        build_searcher(x, "scann")
