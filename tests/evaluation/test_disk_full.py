"""A full disk at each file an evaluation writes (metrics.json, figures, a saved
searcher, the projector's files) and at compare's tuning reports: one DiskFullError
naming the file, no temporary file, the previous file intact; the same write, space
freed, gives the bytes of one that never failed. The failures come from the fault
injector's ``<site>_enospc`` points (a write raising ENOSPC, its temporary file
half-written)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tfaploss.durable import faults
from tfaploss.durable.atomic import DiskFullError


def _files(folder):
    """{relative path: bytes} of every file below ``folder``."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def _fails_then_matches(folder, fault, write, name):
    """``write()`` under ``fault``: a DiskFullError naming ``name``, ``folder`` as it
    was; then (space freed) ``write()`` gives what a write into a fresh copy gives."""
    before = _files(folder)
    with faults.armed(fault), pytest.raises(DiskFullError) as err:
        write()
    assert name in str(err.value) and "run the same command again" in str(err.value)
    assert _files(folder) == before  # no temporary file, the previous file intact
    write()
    return _files(folder)


def _embeddings():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(4), 5)
    x = rng.normal(size=(20, 8)).astype("float32") + 3 * np.eye(8, dtype="float32")[labels]
    return x / np.linalg.norm(x, axis=1, keepdims=True), labels


def test_metrics_json(tmp_path):
    from tfaploss.evaluation import evaluate

    x, labels = _embeddings()
    out = tmp_path / "eval"

    def run():
        evaluate(x, labels, output_dir=str(out), verbose=0)

    run()  # a previous metrics.json
    first = _files(out)
    assert _fails_then_matches(out, "metrics_enospc", run, "metrics.json") == first


def test_figures_and_a_full_disk_ends_the_evaluation(tmp_path):
    pytest.importorskip("matplotlib")
    from tfaploss.evaluation import evaluator, figures

    path = str(tmp_path / "ap.png")

    def draw():
        figures.plot_per_query_ap([0.5, np.nan, 1.0], path)

    draw()
    first = _files(tmp_path)
    assert _fails_then_matches(tmp_path, "figure_enospc", draw, "ap.png") == first
    # A figure that cannot be drawn is skipped; a full disk is not: it is one line.
    assert evaluator._draw([("broken", lambda: 1 / 0)]) == []
    with faults.armed("figure_enospc"), pytest.raises(DiskFullError):
        evaluator._draw([("per-query AP", draw)])


@pytest.mark.parametrize("backend", ["exact", "faiss"])
def test_a_saved_searcher(tmp_path, backend):
    from tfaploss.evaluation.search import build_searcher

    if backend == "faiss":
        pytest.importorskip("faiss")
    x, _ = _embeddings()
    searcher = build_searcher(x, backend=backend)
    out = tmp_path / "searcher"
    searcher.serialize(str(out))
    first = _files(out)
    after = _fails_then_matches(out, "searcher_enospc",
                                lambda: searcher.serialize(str(out)), str(out))
    assert after == first


def test_projector_files(tmp_path):
    from tfaploss.evaluation.projector import export_projector

    x, labels = _embeddings()
    out = tmp_path / "projector"
    export_projector(x, labels, out)
    first = _files(out)
    assert _fails_then_matches(out, "projector_enospc",
                               lambda: export_projector(x, labels, out),
                               "metadata.tsv") == first
    bare = tmp_path / "bare"  # no labels: the embeddings' TensorFlow checkpoint first
    export_projector(x, None, bare)
    first = _files(bare)
    assert _fails_then_matches(bare, "projector_enospc",
                               lambda: export_projector(x, None, bare),
                               "embeddings.ckpt") == first


def test_compare_ledger_and_reports(tmp_path):
    """A half line would swallow the next run's row too: it is cut off."""
    from tfaploss.compare import protocol as P
    from tfaploss.durable import atomic

    ledger = P.Ledger(tmp_path / "ledger.jsonl", "features")
    spec = P.RunSpec("fastap", (("lr", 0.01),), 8, 10, 0, False)
    ledger.add(spec, {"map": 0.5})
    other = P.RunSpec("fastap", (("lr", 0.02),), 8, 10, 0, False)
    first = _files(tmp_path)
    with faults.armed("ledger_enospc"), pytest.raises(DiskFullError, match="ledger.jsonl"):
        ledger.add(other, {"map": 0.6})
    assert _files(tmp_path) == first
    ledger.add(other, {"map": 0.6})
    assert len(P.Ledger(tmp_path / "ledger.jsonl", "features").rows) == 2
    # report.md / results.json / report.png / the features cache share one write
    assert _fails_then_matches(tmp_path, "report_enospc", lambda: atomic.atomic_write_text(
        tmp_path / "report.md", "# report\n", fault="report"), "report.md")
