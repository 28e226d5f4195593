"""``tfaploss compare`` cannot corrupt its own ledger, and its files on a full disk.

* A second comparison on the same output folder is refused by the folder's lock,
  naming the first (a real second process holds it).
* A ledger whose last line a kill cut short resumes without that line (a note says
  so; that run alone is redone, and the ledger ends as if never cut); a line before it
  that is not a row stops the command, naming the file and the line, before any run.
* The folder's lock, the report, its results and its figure on a real full file system
  (a tmpfs; skipped where it cannot be mounted): one error line naming the file, exit 2,
  no temporary.

The runs are the synthetic runner of test_compare.py (no training): these tests are
about the command's files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.compare.test_compare import _synthetic
from tests.support import small_fs
from tfaploss.compare import command
from tfaploss.compare import protocol as P
from tfaploss.compare.ledger import digest
from tfaploss.durable.atomic import is_temp_name

REPO = Path(__file__).resolve().parents[2]
# --quick with two losses: 2 batches x (APLoss's 2 trials + multi-similarity's 5, by the
# budget rule for its 4 knobs and the learning rate, + 2 seeds each)
RUNS = 2 * ((2 + 2) + (5 + 2))


def _args(out: Path, data: Path) -> list[str]:
    # --features: the runner these tests put in place is a feature-tier one
    return ["compare", "--config", str(REPO / "configs" / "demo_digits.yaml"), "--quick",
            "--features", "--set", f"data.train={data}", "--set", f"data.test={data}",
            "--val", str(data), "--out", str(out), "--losses", "APLoss,MultiSimilarity",
            "--m", "8"]


def _compare(monkeypatch, capsys, out, data, runner):
    from tfaploss.cli import main

    monkeypatch.setattr(command, "_runner", lambda args, cfg, out, m, protocol: ("features", runner))
    capsys.readouterr()
    rc = main(_args(out, data))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _refuse(spec):
    raise AssertionError(f"ran {spec} again")


# The first comparison, in a process of its own: its first run waits for the test.
_HOLDER = r"""
import sys, time
from pathlib import Path
from tests.compare.test_compare import _synthetic
from tfaploss.compare import command
from tfaploss.cli import main

gate, inner = Path(sys.argv[1]), _synthetic([])

def runner(spec):
    (gate / "started").touch()
    deadline = time.time() + 120
    while not (gate / "go").exists() and time.time() < deadline:
        time.sleep(0.05)
    return inner(spec)

command._runner = lambda args, cfg, out, m, protocol: ("features", runner)
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_second_comparison_on_one_folder_is_refused_naming_the_first(tmp_path, monkeypatch,
                                                                     capsys):
    out, gate = tmp_path / "compare", tmp_path / "gate"
    gate.mkdir()
    first = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(gate), *_args(out, tmp_path), "--quiet"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3",
                       "CUDA_VISIBLE_DEVICES": ""},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (gate / "started").exists():
            assert first.poll() is None, first.communicate()
            assert time.time() < deadline, "the first comparison never started a run"
            time.sleep(0.1)
        rc, _, err = _compare(monkeypatch, capsys, out, tmp_path, _refuse)
        assert rc == 2
        assert err.count("\n") == 1 and err.startswith("error: compare output folder "), err
        assert f"is in use by another process: PID {first.pid} on host" in err, err
        assert "command: " in err and "compare" in err.split("command: ")[1], err
        (gate / "go").touch()
        _, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr
    rows = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert len(rows) == RUNS == len({r["key"] for r in rows})  # each run once
    assert not (out / ".tfaploss.lock").exists()


def test_a_torn_last_line_is_dropped_with_a_note_and_that_run_redone(tmp_path, monkeypatch,
                                                                     capsys):
    out = tmp_path / "compare"
    calls = []
    rc, _, err = _compare(monkeypatch, capsys, out, tmp_path, _synthetic(calls))
    assert rc == 0 and len(calls) == RUNS, err
    ledger = out / "ledger.jsonl"
    whole = ledger.read_bytes()
    last = whole.rstrip(b"\n").rfind(b"\n") + 1
    ledger.write_bytes(whole[:last] + whole[last:last + 40])  # killed mid-append
    calls.clear()
    rc, stdout, err = _compare(monkeypatch, capsys, out, tmp_path, _synthetic(calls))
    assert rc == 0, err
    assert (f"note: dropped the last line of {ledger} (line {RUNS} has no newline), which "
            "a kill cut short as it was appended; that run is done again") in stdout
    assert len(calls) == 1  # that run alone
    assert ledger.read_bytes() == whole  # as if never cut


def test_a_damaged_row_before_the_last_stops_naming_the_file_and_line(tmp_path, monkeypatch,
                                                                     capsys):
    out = tmp_path / "compare"
    rc, _, err = _compare(monkeypatch, capsys, out, tmp_path, _synthetic([]))
    assert rc == 0, err
    ledger = out / "ledger.jsonl"
    lines = ledger.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2][:30] + b"\n"  # line 3: not JSON
    damaged = b"".join(lines)
    ledger.write_bytes(damaged)
    rc, _, err = _compare(monkeypatch, capsys, out, tmp_path, _refuse)
    assert rc == 2
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: damaged ledger: {ledger}: line 3 is not JSON "), err
    assert ledger.read_bytes() == damaged  # left as it was, for the user to look at
    assert not (out / ".tfaploss.lock").exists()  # released on the way out


def test_ledger_lines_that_no_kill_leaves_and_the_one_it_does(tmp_path, caplog):
    path = tmp_path / "ledger.jsonl"
    setup = {"tier": "features"}  # the ledger's own setup: rows it reuses, no note
    row = lambda k: json.dumps({"key": k, "loss": "APLoss", "setup": setup,
                                "setup_id": digest(setup)}) + "\n"
    path.write_text(row("a") + "\n" + row("b"))
    with pytest.raises(P.DamagedLedgerError, match=r"ledger.jsonl: line 2 is empty"):
        P.Ledger(path, "features")
    path.write_text(row("a") + "[1, 2]\n" + row("b"))
    with pytest.raises(P.DamagedLedgerError, match=r"line 2 is not a run's row"):
        P.Ledger(path, "features")
    path.write_bytes(row("a").encode() + b"\xff\xfe\n" + row("b").encode())
    with pytest.raises(P.DamagedLedgerError, match=r"line 2 is not JSON"):
        P.Ledger(path, "features")
    # The last line, whole but for garbage (a file system that zero-filled the tail
    # after a power cut): dropped with a note, the file cut back to the rows before it.
    path.write_bytes(row("a").encode() + b"\0\0\0\0\n")
    with caplog.at_level("INFO", logger="tfaploss.compare.protocol"):
        ledger = P.Ledger(path, "features")
    assert list(ledger.rows) == ["a"] and path.read_text() == row("a")
    assert "dropped the last line" in caplog.text and "(line 2 is not JSON" in caplog.text
    # An empty ledger and a clean one: nothing dropped, nothing said.
    caplog.clear()
    path.write_text(row("a") + row("b"))
    with caplog.at_level("INFO", logger="tfaploss.compare.protocol"):
        assert list(P.Ledger(path, "features").rows) == ["a", "b"]
    path.write_text("")
    assert P.Ledger(path, "features").rows == {} and caplog.text == ""


def test_report_and_figure_on_a_full_tmpfs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    with small_fs.mounted(tmp_path / "small", "1m") as mnt:
        out = mnt / "compare"
        rc, _, err = _compare(monkeypatch, capsys, out, tmp_path, _synthetic([]))
        assert rc == 0, err
        sizes = {name: (out / name).stat().st_size
                 for name in ("report.md", "results.json", "report.png")}
        page = 4096
        pages = lambda n: -(-n // page) * page
        # Nothing free: the folder's lock is refused; room for the lock: the report;
        # room for the lock, the report and its results: the figure.
        for keep, name in ((0, ".tfaploss.lock"), (page, "report.md"),
                           (pages(sizes["report.md"]) + pages(sizes["results.json"])
                            + 2 * page, "report.png")):
            assert sizes["report.png"] > 2 * page  # the figure cannot fit in what is left
            for written in sizes:
                (out / written).unlink(missing_ok=True)
            filler = small_fs.fill(mnt, keep)
            rc, _, err = _compare(monkeypatch, capsys, out, tmp_path, _refuse)
            assert rc == 2, err
            assert err.count("\n") == 1, err
            assert err.startswith(f"error: no space left on the device to write "
                                  f"{out / name} "), err
            assert not [p for p in out.iterdir() if is_temp_name(p.name)]
            assert not (out / name).exists()
            filler.unlink()
        rc, _, err = _compare(monkeypatch, capsys, out, tmp_path, _refuse)
        assert rc == 0 and (out / "report.png").stat().st_size > 0, err
