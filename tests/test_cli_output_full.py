"""A command whose standard output is on a full disk: exit 2 and one error line naming
where the output went, no traceback (logging's "--- Logging error ---" for each line
before), no second error as the interpreter flushes at exit.

The output is ``/dev/full``, on which every write fails with ENOSPC as on a full disk,
and which needs no root (the full-disk tests on a mounted tmpfs do). Subprocesses, to
see the exit itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import miniature as mini

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")


def _to_full_disk(*args):
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [sys.executable, "-m", "tfaploss.cli", *map(str, args)], stdout=full,
            stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=120, check=False,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""})


def _assert_one_line(result):
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr == (
        "error: no space left on the device to write the standard output (/dev/full); what "
        "the command printed there is cut short. Free space (or send the output "
        "elsewhere) and run the same command again\n"), result.stderr


def test_recipes_show_and_the_list_to_a_full_disk():
    _assert_one_line(_to_full_disk("recipes", "show", "smoothap_sop_resnet50"))
    _assert_one_line(_to_full_disk("recipes"))


def test_verify_to_a_full_disk(tmp_path):
    mini.write_split_records(str(tmp_path / "train"), {k: 2 for k in range(3)})
    with open(os.devnull, "w") as null:  # the same command, with room for its output
        assert subprocess.run([sys.executable, "-m", "tfaploss.cli", "verify",
                               str(tmp_path / "train")], stdout=null, cwd=REPO,
                              timeout=120, check=False).returncode == 0
    _assert_one_line(_to_full_disk("verify", tmp_path / "train"))
