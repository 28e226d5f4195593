"""A real small file system for the full-disk tests: a tmpfs mounted for one test.

Mounting needs root (or CAP_SYS_ADMIN); where the process cannot mount, the test is
skipped with the reason. The fault injector covers every write site either way
(tests/run/test_disk_full.py, tests/pipelines/test_disk_full.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted(folder: Path, size: str = "1m"):
    """A tmpfs of ``size`` mounted on ``folder`` (created) for the block; skips the test
    where it cannot be mounted."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the fault injector covers the writes")
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                           str(folder)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


def fill(folder: Path, keep: int) -> Path:
    """Take all but ``keep`` bytes of ``folder``'s file system in one file; delete it
    to free the space."""
    filler = folder / "filler"
    free = shutil.disk_usage(folder).free
    with open(filler, "wb") as f:
        f.write(b"\0" * max(free - keep, 0))
    return filler
