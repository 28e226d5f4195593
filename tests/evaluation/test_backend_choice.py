"""``backend="auto"``: exact without a target, else the best installed tuned searcher;
the choice logged and reported. Missing searchers are simulated with
``sys.modules[name] = None`` (nothing is uninstalled)."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest

from tfaploss import extras
from tfaploss.evaluation import build_searcher, retrieval_metrics, search_report
from tfaploss.evaluation.backend_choice import (
    auto_record,
    backend_choices,
    required_extra,
    resolve_backend,
)
from tfaploss.evaluation.searchers import BACKENDS, ExactSearcher, ScannSearcher


def _data(n=400, d=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True), rng.integers(0, 8, n)


def _block(monkeypatch, *names):
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_named_backends_pass_through_and_unknown_ones_are_refused():
    for name in BACKENDS:
        assert resolve_backend(name) == name
        assert resolve_backend(name, 0.9) == name
    assert backend_choices() == ("auto", *BACKENDS)
    with pytest.raises(ValueError, match="`backend` must be one of"):
        resolve_backend("annoy")


def test_auto_without_a_target_is_exact_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="tfaploss.evaluation.backend_choice"):
        assert resolve_backend("auto") == "exact"
    record = auto_record("auto")
    assert record["chosen"] == "exact" and "no target recall" in record["reason"]
    assert auto_record("exact") is None
    x, y = _data()
    searcher = build_searcher(x, "auto")
    assert isinstance(searcher, ExactSearcher)
    assert search_report(searcher, x, 10)["auto"]["chosen"] == "exact"
    # the same metrics as exact search
    assert retrieval_metrics(x, y, backend="auto") == retrieval_metrics(x, y, backend="exact")


def test_auto_with_a_target_and_nothing_installed_is_exact(monkeypatch, caplog):
    _block(monkeypatch, "scann", "faiss")
    caplog.set_level(logging.INFO, logger="tfaploss.evaluation.backend_choice")
    assert resolve_backend("auto", 0.93) == "exact"
    assert any("search backend auto: exact" in r.getMessage()
               and 'pip install "tfaploss[scann]"' in r.getMessage() for r in caplog.records)
    x, _ = _data()
    searcher = build_searcher(x, "auto", target_recall=0.93, k=5)
    assert isinstance(searcher, ExactSearcher)
    report = search_report(searcher, x, 5)
    assert report["backend"] == "exact" and report["recall"] == 1.0
    assert report["auto"] == {"requested": "auto", "chosen": "exact",
                              "reason": auto_record("auto", 0.93)["reason"]}


def test_auto_with_a_target_takes_faiss_when_scann_is_missing(monkeypatch):
    _block(monkeypatch, "scann")
    want = "faiss" if "faiss" in BACKENDS and extras.usable("faiss") else "exact"
    assert resolve_backend("auto", 0.9) == want


def test_auto_with_a_target_takes_scann_where_it_imports():
    if not extras.usable("scann"):
        pytest.skip("ScaNN is not installed here")
    assert resolve_backend("auto", 0.9) == "scann"
    x, _ = _data(n=600)
    searcher = build_searcher(x, "auto", target_recall=0.9, k=5, max_settings=3)
    assert searcher.auto["chosen"] == "scann"
    assert search_report(searcher, x, 5)["auto"]["chosen"] == "scann"


def test_each_backend_names_the_extra_it_needs():
    assert required_extra("auto") is None and required_extra("auto", 0.9) is None
    assert required_extra("exact") is None
    assert required_extra("scann") == ("scann", "backend: scann")
    assert required_extra("scann_ah", key="evaluation.backend") == (
        "scann", "evaluation.backend: scann_ah")
    extra, why = required_extra("exact", 0.95, key="--backend")
    assert extra == "scann" and "ScaNN tuner" in why and "auto" in why


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
