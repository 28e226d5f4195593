"""The faiss backend: exact flat search, measured recall of IVF and HNSW, the tuner's
target recall on fresh queries, save/load, argument errors, and the message when faiss
is missing.

Data: seeded clustered unit vectors (a few thousand x 32), as in ``test_tuner.py``.
The tuner runs on its deterministic cost model (``speed="model"``), never on the wall
time of this (loaded) machine.
"""

import importlib.util
import json
import os
import re
import sys

import numpy as np
import pytest

from tfaploss.cli import build_parser
from tfaploss.config import config_from_dict
from tfaploss.evaluation import ExactSearcher, build_searcher, load_searcher
from tfaploss.evaluation.faiss_search import FaissSearcher, faiss_candidates, faiss_cost
from tfaploss.evaluation.search import search_report
from tfaploss.evaluation.search_plan import SearchPlan
from tfaploss.evaluation.tuner import measure_recall, tune_searcher

needs_faiss = pytest.mark.skipif(importlib.util.find_spec("faiss") is None,
                                 reason='faiss is not installed (pip install "tfaploss[faiss]")')
INSTALL = re.escape('pip install "tfaploss[faiss]"')


@pytest.fixture(autouse=True)
def _one_faiss_thread():
    """faiss's OpenMP threads spin while they wait: on a shared machine one thread runs
    these small searches several times faster, and no result depends on it."""
    if importlib.util.find_spec("faiss") is None:
        yield
        return
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


def _clustered(seed, n, d=32, clusters=40, spread=0.5, centres_seed=123):
    """Unit vectors around fixed centres (the same distribution for every ``seed``)."""
    centres = np.random.default_rng(centres_seed).standard_normal((clusters, d))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, clusters, n)
    x = centres[labels] + spread * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32), labels


def _recall(found, truth):
    return float(np.mean([np.isin(t, f).mean() for f, t in zip(found, truth)]))


@needs_faiss
def test_flat_is_exact_search():
    # Random floats: no tied scores, so the top-k is one list whatever the tie rule.
    rng = np.random.default_rng(0)
    db = rng.standard_normal((2000, 24)).astype(np.float32)
    q = rng.standard_normal((50, 24)).astype(np.float32)
    flat = FaissSearcher(db)
    assert flat.kind == "flat" and not flat.approximate
    exact = ExactSearcher(db)
    idx, scores = flat.search(q, 20)
    want_idx, want_scores = exact.search(q, 20)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)
    exclude = rng.integers(0, 2000, 50)
    np.testing.assert_array_equal(flat.search(q, 20, exclude=exclude)[0],
                                  exact.search(q, 20, exclude=exclude)[0])
    assert build_searcher(db, "faiss").kind == "flat"


@needs_faiss
@pytest.mark.parametrize("kind, params, floor", [
    ("ivf_flat", {}, 0.95),
    ("ivf_pq", {}, 0.9),
    ("hnsw", {}, 0.9),
    ("ivf_flat", {"nlist": 64, "nprobe": 1}, 0.3),
])
def test_approximate_kinds_recall_is_measured(kind, params, floor):
    db, _ = _clustered(0, 4000)
    q, _ = _clustered(1, 300)
    s = FaissSearcher(db, kind=kind, **params)
    assert s.approximate and s.backend == "faiss"
    truth = ExactSearcher(db).search(q, 10)[0]
    idx, scores = s.search(q, 10)
    got = _recall(idx, truth)
    assert floor <= got <= 1.0, (kind, params, got)
    # Rows best first; ties and padding as every backend orders them.
    assert np.all(np.diff(scores, axis=1) <= 0)
    report = search_report(s, db, 10, queries=q, sample_size=300)
    assert report["backend"] == "faiss" and not report["tuned"]
    assert report["setting"].startswith(("IVF", "HNSW")) and 0 < report["recall"] <= 1


@needs_faiss
def test_every_list_probed_is_exact():
    db, _ = _clustered(0, 3000)
    q, _ = _clustered(1, 100)
    s = FaissSearcher(db, kind="ivf_flat", nlist=20, nprobe=20)
    np.testing.assert_array_equal(s.search(q, 10)[0], ExactSearcher(db).search(q, 10)[0])
    # A cheaper setting without a rebuild, and back.
    low = s.set_search_params(nprobe=1).search(q, 10)[0]
    assert s.params["nprobe"] == 1 and low.shape == (100, 10)


@needs_faiss
def test_tuned_faiss_reaches_the_target_on_fresh_queries(tmp_path):
    db, _ = _clustered(0, 4000)
    target = 0.9
    s = build_searcher(db, "faiss", target_recall=target, k=10, speed="model")
    info = s.tuning
    assert isinstance(s, FaissSearcher) and not info["fell_back"]
    assert info["backend"] == "faiss" and info["setting"].startswith(("IVF", "HNSW"))
    assert info["recall_ci"][0] >= target and info["speedup"] > 1
    assert all(t["params"]["kind"] in ("ivf_flat", "ivf_pq", "hnsw") for t in info["tried"])
    # Fresh queries of the same distribution, never seen by the tuner (the sample is
    # database points). The acceptance rule (the lower end of the sample's 95 % interval
    # at the target) leaves the headroom that sampling needs: 0.967 here.
    fresh, _ = _clustered(7, 1000)
    got = measure_recall(s, db, 10, queries=fresh)
    assert got["recall"] >= target, (got, info["setting"])
    # The tuned searcher is saved and restored whole.
    restored = load_searcher(s.serialize(str(tmp_path / "tuned")))
    assert restored.params == s.params
    np.testing.assert_array_equal(restored.search(fresh, 10)[0], s.search(fresh, 10)[0])


@needs_faiss
def test_tuner_space_is_ordered_and_bounded():
    n, d, k = 50_000, 64, 10
    space = faiss_candidates(n, d, k)
    costs = [faiss_cost(s, n, d, k) for s in space]
    assert costs == sorted(costs)
    assert {s.kind for s in space} == {"ivf_flat", "ivf_pq", "hnsw"}
    assert all(s.nprobe <= s.nlist for s in space if s.kind != "hnsw")
    assert all(s.ef_search >= k for s in space if s.kind == "hnsw")
    assert not any(s.kind == "ivf_pq" for s in faiss_candidates(n, 33, k))  # odd dim
    # A tiny database: nothing beats exact search, so the tuner falls back.
    small, _ = _clustered(0, 300)
    searcher, info = tune_searcher(small, SearchPlan("faiss", 0.9, k=10), speed="model")
    assert isinstance(searcher, ExactSearcher) and info["fell_back"]
    assert "no faiss setting" in info["reason"]
    with pytest.raises(ValueError, match="`backend`.*'annoy'"):
        SearchPlan("annoy", 0.9)


@needs_faiss
@pytest.mark.parametrize("kind", ["flat", "ivf_flat", "ivf_pq", "hnsw"])
def test_save_and_load_give_identical_results(tmp_path, kind):
    db, _ = _clustered(0, 3000)
    q, _ = _clustered(1, 100)
    s = FaissSearcher(db, kind=kind)
    if kind != "flat":  # a setting changed after the build is saved too
        s.set_search_params(**{"ivf_flat": {"nprobe": 3}, "ivf_pq": {"k_factor": 4},
                               "hnsw": {"ef_search": 40}}[kind])
    path = s.serialize(str(tmp_path / kind))
    assert sorted(os.listdir(path)) == ["index.faiss", "searcher.json"]  # no temp file
    meta = json.loads((tmp_path / kind / "searcher.json").read_text())
    assert meta["backend"] == "faiss" and meta["kind"] == kind
    restored = load_searcher(path)
    assert isinstance(restored, FaissSearcher) and restored.params == s.params
    for exclude in (None, np.arange(100)):
        want = s.search(q, 10, exclude=exclude)
        got = restored.search(q, 10, exclude=exclude)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


@needs_faiss
@pytest.mark.parametrize("kwargs, pattern", [
    ({"kind": "ivf"}, r"`kind`.*'ivf'"),
    ({"kind": "ivf_flat", "nlist": 0}, r"`nlist`.*0"),
    ({"kind": "ivf_flat", "nlist": 5000}, r"`nlist`.*5000"),
    ({"kind": "ivf_flat", "nlist": 10, "nprobe": 11}, r"`nprobe`.*11"),
    ({"kind": "ivf_pq", "k_factor": 1.5}, r"`k_factor`.*1\.5"),
    ({"kind": "hnsw", "hnsw_m": 1}, r"`hnsw_m`.*1"),
    ({"kind": "hnsw", "ef_search": -3}, r"`ef_search`.*-3"),
    ({"kind": "flat", "nprobe": 4}, r"nprobe.*kind='flat'"),
    ({"kind": "hnsw", "nlist": 4}, r"nlist.*kind='hnsw'"),
    ({"device": "tpu"}, r"`device`.*'tpu'"),
    ({"kind": "hnsw", "device": "gpu"}, r"`device`.*'gpu'"),
    ({"num_threads": -1}, r"`num_threads`.*-1"),
])
def test_bad_arguments_name_the_argument_and_value(kwargs, pattern):
    db, _ = _clustered(0, 1000)
    with pytest.raises(ValueError, match=pattern):
        FaissSearcher(db, **kwargs)


@needs_faiss
def test_bad_search_params_and_odd_dimensions():
    db, _ = _clustered(0, 1000)
    with pytest.raises(ValueError, match="`ef_search` does not apply to kind='ivf_flat'"):
        FaissSearcher(db, kind="ivf_flat").set_search_params(ef_search=10)
    with pytest.raises(ValueError, match="`nprobe`.*0"):
        FaissSearcher(db, kind="ivf_flat").set_search_params(nprobe=0)
    odd, _ = _clustered(0, 1000, d=33)
    with pytest.raises(ValueError, match="odd dimension 33"):
        FaissSearcher(odd, kind="ivf_pq")


def test_missing_faiss_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` now fails
    db, _ = _clustered(0, 500)
    with pytest.raises(ImportError, match=f"^[^\n]*{INSTALL}") as err:
        FaissSearcher(db)
    assert "\n" not in str(err.value)  # one line
    with pytest.raises(ImportError, match=INSTALL):
        build_searcher(db, "faiss")
    with pytest.raises(ImportError, match=INSTALL):  # before any exact search is run
        build_searcher(db, "faiss", target_recall=0.9)
    (tmp_path / "searcher.json").write_text(json.dumps(
        {"format_version": 1, "backend": "faiss", "size": 500, "dim": 32, "kind": "flat",
         "device": "auto", "num_threads": 0, "seed": 0}))
    with pytest.raises(ImportError, match=INSTALL):
        load_searcher(str(tmp_path))


def test_config_and_cli_accept_faiss():
    cfg = config_from_dict({"loss": {"name": "APLoss"}}, ["evaluation.backend=faiss"],
                           warn=False)
    assert cfg.evaluation.backend == "faiss"
    args = build_parser().parse_args(["evaluate", "--model", "m.keras", "--data", "d",
                                      "--backend", "faiss", "--target-recall", "0.9"])
    assert args.backend == "faiss" and args.target_recall == 0.9
