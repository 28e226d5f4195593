"""`tfaploss train` on a real small file system (a tmpfs; skipped where it cannot be
mounted) that fills in the middle of an HDF5 or zip write: exit 2, one error line naming
the file, no traceback, no signal, no temporary file; the rerun with space finishes.

An injected ENOSPC (tests/run/test_disk_full.py) does not leave the library in the state
a real partial write does: Keras left its HDF5 file open, h5py's deallocator raised at
exit and the process died by SIGSEGV (exit -11). The fault point ``no_space_check``
skips the free-space check, so that the write itself runs out of space, as when another
process takes the space after the check. The writes alone, at more fill points:
tests/durable/test_small_fs.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.run.test_preemption import _config as config_in
from tests.run.test_preemption import _env, _noise
from tests.support import miniature as mini
from tests.support import small_fs
from tfaploss.durable.atomic import is_temp_name
from tfaploss.durable.faults import ENV

pytestmark = pytest.mark.long  # make test-long: real tmpfs runs of tfaploss train

REPO = Path(__file__).resolve().parents[2]
# The sizes below: the small CNN's checkpoint (with Adam's two moments) takes 3.4 MiB,
# its model.keras 1.2 MiB, the run's other files a few KB.


def _train(config, epochs):
    return subprocess.run(
        [sys.executable, "-m", "tfaploss.cli", "train", "--config", str(config),
         "--set", f"training.epochs={epochs}", "--set", "training.steps_per_epoch=1",
         "--set", "training.health.enabled=false"],
        cwd=REPO, capture_output=True, text=True, env=_env({ENV: "no_space_check"}),
        timeout=300, check=False)


def _assert_one_line(result, names):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: no space left on the device to write "), lines
    assert lines[0].split(" (")[0].endswith(names), lines


def _files(folder: Path) -> list[str]:
    names = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    assert not [n for n in names if is_temp_name(Path(n).name)], names
    return sorted(n for n in names if not n.startswith("logs/"))


def _config(root, name, data, run_dir):
    path = config_in(root, name, data)
    raw = yaml.safe_load(path.read_text())
    raw["run_dir"] = str(run_dir)
    path.write_text(yaml.safe_dump(raw))
    return path


def _remount(folder: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("small_fs_train")
    mini.write_split_records(str(root / "train"), {k: 6 for k in range(6)}, image_fn=_noise)
    return root


@pytest.mark.slow
def test_checkpoints_cut_by_a_full_tmpfs_then_the_rerun_finishes(tmp_path, data):
    with small_fs.mounted(tmp_path / "small", "2m") as mnt:
        config = _config(tmp_path, "run", data / "train", run_dir=mnt / "run")
        # 2 MiB: the first checkpoint runs out of space in the middle of HDF5's writes.
        first = _train(config, 2)
        _assert_one_line(first, "backup/epoch-0001.weights.h5")
        assert "epoch-0001.weights.h5" not in _files(mnt)
        # 6 MiB: epoch 1's checkpoint fits, epoch 2's beside it does not; epoch 1's stays.
        _remount(mnt, "6m")
        second = _train(config, 2)
        _assert_one_line(second, "backup/epoch-0002.weights.h5")
        assert "run/backup/epoch-0001.weights.h5" in _files(mnt)
        assert "run/model.keras" not in _files(mnt)
        # Space freed: the same command resumes after epoch 1 and finishes.
        _remount(mnt, "12m")
        third = _train(config, 2)
        assert third.returncode == 0, third.stdout + third.stderr
        assert "resuming from its last checkpoint: epoch 1 done" in third.stdout
        assert {"run/model.keras", "run/summary.json"} <= set(_files(mnt))
        assert not (mnt / "run" / "backup").exists()


@pytest.mark.slow
def test_model_keras_cut_by_a_full_tmpfs(tmp_path, data):
    # 4.5 MiB: the checkpoint fits, model.keras (a zip, written after it) does not.
    with small_fs.mounted(tmp_path / "small", "4608k") as mnt:
        config = _config(tmp_path, "run", data / "train", run_dir=mnt / "run")
        result = _train(config, 1)
        _assert_one_line(result, "run/model.keras")
        files = _files(mnt)
        assert "run/model.keras" not in files and "run/summary.json" not in files
        assert "run/backup/epoch-0001.weights.h5" in files  # the rerun resumes from it
