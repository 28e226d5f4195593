"""Serving under concurrent load: 4 callers at once, each request at the pixel budget.

``benchmarks/serving_load.py`` at a small budget (256 x 256 pixels an image, 4 images
a request): a fresh process loads the export, 4 threads send requests at the budget
while a fifth sends refused ones (a header declaring 100 MP, and one image too many).
The peak of the process's resident memory above the loaded model stays under the bound
docs/serving.md states (4 x (DECODE_BYTES_PER_PIXEL x max_request_pixels +
REQUEST_OVERHEAD_BYTES + one forward pass)), every request is answered, every refusal
says it came before decoding, and no process is killed (the 1-caller floor level runs
first, in its own process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.tensorflow, pytest.mark.long]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving_load.py"


def test_four_callers_at_the_budget_stay_under_the_memory_bound(tmp_path):
    from tfaploss.export.image_ops import DECODE_BYTES_PER_PIXEL, REQUEST_OVERHEAD_BYTES

    out = tmp_path / "serving_load.json"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--callers", "4", "--max-pixels",
                           str(256 * 256), "--image-size", "32", "--requests", "8",
                           "--out", str(out)], check=False, capture_output=True, text=True,
                          env=env, cwd=SCRIPT.parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["callers"]: row for row in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == [1, 4]
    for row in rows.values():
        assert row["exit"] == 0 and not row["failures"], row
        assert row["request_budget_pixels"] == 4 * 256 * 256
        # The bound, as docs/serving.md writes it.
        per_request = (DECODE_BYTES_PER_PIXEL * row["request_budget_pixels"]
                       + REQUEST_OVERHEAD_BYTES) / 2**20
        assert row["bound_mb"] == pytest.approx(row["callers"] * (per_request
                                                                  + row["forward_mb"]))
        assert 0 < row["peak_growth_mb"] <= row["bound_mb"], row
        assert row["refusals"] >= 1 and row["refused"] == row["refusals"], row
    four = rows[4]
    assert four["requests"] == 4 * 2  # 8 requests shared by 4 callers
    # Refused before decoding: a fraction of what an accepted request takes.
    assert four["refusal_p50_s"] < four["latency_p50_s"], four
    assert "4 callers: peak RSS growth" in proc.stdout and "held" in proc.stdout
