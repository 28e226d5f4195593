"""The performance suite (``benchmarks/suite.py``): its tiny mode end to end, the
``--previous`` column, and the Benchmarks page's generated block.

The end-to-end run covers ``losses`` (a floor, a memory and a peer figure) and
``gpu_losses`` (skipped, and said so, without a GPU). The other scripts each start
TensorFlow or JAX in one or more fresh processes: 40-130 s apiece in tiny mode on the
busy 2-core machine, beyond this test's budget, so ``make bench TINY=1`` is their check;
the exception is the exact-search section of ``search.py`` (``--exact_only``, ~12 s).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
PAGE = REPO / "docs" / "benchmarks.md"
TINY_SCRIPTS = ("losses", "gpu_losses")
HEADER = "| benchmark | figure | value | floor / peer | ratio |"


@pytest.fixture(scope="module")
def suite():
    return suite_script("suite")


def suite_script(name: str):
    """A benchmark script imported as a module (they import their harness as a sibling)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def _table_rows(text: str, header: str = HEADER) -> list[list[str]]:
    """The cells of the Markdown table that starts with ``header`` in ``text``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _run_tiny_suite(out: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "suite.py"), "--tiny", "--only",
         ",".join(TINY_SCRIPTS), "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


# One test, not two sharing a fixture: pytest-xdist could run the suite once per worker.
@pytest.mark.long
def test_tiny_suite_prints_every_figure_beside_its_floor_and_the_previous_ratio(
        suite, tmp_path, monkeypatch, capsys):
    out = tmp_path / "results" / "suite.json"
    stdout = _run_tiny_suite(out)
    # written through a temporary name and a rename: nothing but the file is left
    assert [p.name for p in out.parent.iterdir()] == [out.name]
    results = json.loads(out.read_text())
    assert results["benchmark"] == "suite" and results["meta"]["tiny"] is True

    status = {s["script"]: s["status"] for s in results["scripts"]}
    assert list(status) == list(TINY_SCRIPTS)
    assert status["losses"] == "ok"
    assert status["gpu_losses"] == ("ok" if suite.gpu_present() else "skipped: no GPU")

    figures = results["figures"]
    # the losses' time and memory beside the floor, and beside pytorch-metric-learning
    assert {f["reference"] for f in figures if f["benchmark"] == "losses"} == {"floor", "peer"}
    # Without PyTorch or pytorch-metric-learning the peer's figure stays in the table and
    # says why it has no reference.
    missing = suite_script("losses").missing_peer_packages()
    for f in figures:
        if missing and f["reference"] == "peer":
            assert f["floor"] is None and f["ratio"] is None, f
            assert "not installed" in f["note"] and missing[-1] in f["note"], f
            continue
        assert f["floor"] is not None and f["floor_name"], f
        assert math.isfinite(f["ratio"]) and f["ratio"] > 0, f
        assert f["ratio"] == pytest.approx(f["value"] / f["floor"])

    rows = _table_rows(stdout)
    assert [(r[0], r[1]) for r in rows] == [(f["benchmark"], f["name"]) for f in figures]
    assert [r[4] for r in rows] == ["-" if f["ratio"] is None else f"{f['ratio']:.2f}"
                                    for f in figures]
    figures = [f for f in figures if f["ratio"] is not None]
    scripts = _table_rows(stdout, "| script | status | wall |")
    assert [(r[0], r[1]) for r in scripts] == list(status.items())

    # --previous: a second suite run replays these figures (each ratio doubled, so the
    # columns differ) instead of running the scripts again, and shows this run's ratios.
    again = [dict(f, value=2 * f["value"], ratio=2 * f["ratio"]) for f in figures]
    monkeypatch.setattr(suite, "run_one", lambda name, extra, out, timeout: {
        "script": name, "status": "ok", "seconds": 0.0,
        "figures": [f for f in again if f["benchmark"] == name]})
    assert suite.main(["--tiny", "--only", "losses", "--previous", str(out),
                       "--out", str(tmp_path / "again.json")]) == 0
    rows = _table_rows(capsys.readouterr().out, HEADER + " previous ratio |")
    mine = [f for f in figures if f["benchmark"] == "losses"]
    assert [r[4] for r in rows] == [f"{2 * f['ratio']:.2f}" for f in mine]
    assert [r[5] for r in rows] == [f"{f['ratio']:.2f}" for f in mine]


def _results(path: Path, figures) -> Path:
    path.write_text(json.dumps({
        "benchmark": "suite", "wall_s": 12.0, "figures": figures,
        "meta": {"finished": "2026-01-01T00:00:00+00:00", "config": {"tiny": True},
                 "machine": {"cpus": 2, "load_average_1min": 1.5}},
        "scripts": [{"script": "losses", "status": "ok", "seconds": 9.0},
                    {"script": "gpu_losses", "status": "skipped: no GPU", "seconds": 0.0}]}))
    return path


def test_write_docs_replaces_the_block_and_keeps_the_prose(suite, tmp_path, capsys):
    harness = sys.modules["harness"]
    figures = [harness.figure("losses", "APLoss B=64 graph time", 0.3, "s", floor=0.1,
                              floor_name="S = XX^T"),
               harness.figure("losses", "APLoss B=64 vs PML", 0.3, "s", floor=0.6,
                              peer=True, floor_name="PML")]
    results = _results(tmp_path / "suite.json", figures)
    before, after = "# Benchmarks\n\nProse before.\n\n", "\n\nProse after.\n"
    page = tmp_path / "benchmarks.md"
    page.write_text(before + suite.BEGIN_MARK + "\n\nstale table\n\n" + suite.END_MARK
                    + after)

    assert suite.main(["--write-docs", str(page), "--from", str(results)]) == 0
    text = page.read_text()
    assert text.startswith(before + suite.BEGIN_MARK) and text.endswith(suite.END_MARK
                                                                         + after)
    assert "stale table" not in text and "suite.json" in text
    rows = _table_rows(text)
    assert [(r[1], r[4]) for r in rows] == [("APLoss B=64 graph time", "3.00"),
                                            ("APLoss B=64 vs PML", "0.50")]
    assert "**losses** (ok, 9 s)" in text and "**gpu_losses** (skipped: no GPU, 0 s)" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["benchmarks.md", "suite.json"]
    suite.main(["--write-docs", str(page), "--from", str(results)])  # idempotent
    assert page.read_text() == text

    suite.main(["--write-docs", str(page), "--from", str(results), "--previous",
                str(results)])
    assert [r[5] for r in _table_rows(page.read_text(), HEADER + " previous ratio |")] == [
        "3.00", "0.50"]


def test_write_docs_refuses_a_page_without_its_markers_or_a_wrong_file(suite, tmp_path):
    harness = sys.modules["harness"]
    results = _results(tmp_path / "suite.json", [])
    page = tmp_path / "page.md"
    page.write_text("# no block here\n")
    with pytest.raises(ValueError, match="must hold the line"):
        suite.write_docs(page, results)
    assert page.read_text() == "# no block here\n"

    page.write_text(f"{suite.BEGIN_MARK}\n{suite.END_MARK}\n")
    one_script = harness.write_json(tmp_path / "losses.json",
                                    {"benchmark": "losses", "figures": []})
    with pytest.raises(ValueError, match="benchmark='losses'"):
        suite.write_docs(page, one_script)


def test_benchmarks_page_block_matches_its_results_file(suite):
    text = PAGE.read_text(encoding="utf-8")
    assert text.count(suite.BEGIN_MARK) == 1 and text.count(suite.END_MARK) == 1
    block = text.split(suite.BEGIN_MARK)[1].split(suite.END_MARK)[0].strip() + "\n"
    if not block.startswith("Generated from `"):
        # a table without its results file could not be kept in sync
        assert HEADER not in block
        return
    source = block.split("`")[1]
    results = json.loads((REPO / source).read_text(encoding="utf-8"))
    assert block == suite.docs_block(results, source=source)


def test_every_script_has_a_tiny_mode(suite):
    for name, (*modes, _) in suite.SUITE.items():
        tiny = modes[suite.MODES.index("tiny")]
        for arguments in (tiny.values() if isinstance(tiny, dict) else [tiny]):
            assert "--tiny" in arguments, name
        assert (BENCHMARKS / f"{name}.py").read_text().count("args.tiny") >= 1, name


@pytest.mark.slow
def test_search_times_each_exact_contender_beside_the_float32_product(tmp_path):
    """benchmarks/search.py's exact section (tiny): float32 alone, the default, and the
    bfloat16 prefilter with each product that can run here, each beside the bare
    float32 product of the same run; the prefilter's own floor beside it too."""
    from tfaploss.evaluation import bfloat16_prefilter

    out = tmp_path / "search.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "search.py"), "--tiny", "--exact_only",
         "--repeats", "1", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [r for r in json.loads(out.read_text())["rows"] if r["unit"] == "q/s"]
    names = {r["what"].split(", k=")[0] for r in rows}
    products = [p for p in ("torch", "tensorflow")
                if bfloat16_prefilter.choose_product(p)[0] is not None]
    assert names == ({"exact float32 alone", "exact default (float32)"}
                     | {f"exact, bfloat16 prefilter ({p})" for p in products}
                     | {f"bare bfloat16 product ({p})" for p in products})
    for r in rows:
        assert r["floor_what"] == "bare float32 product q @ db.T", r
        assert r["value"] > 0
        assert r["ratio"] == pytest.approx(r["value"] / r["floor"], rel=1e-2, abs=1e-3)
