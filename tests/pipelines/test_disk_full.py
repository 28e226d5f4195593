"""A Beam job that meets a full disk at any of its writes ends with one line naming the
file (not Beam's wrapped traceback) and exit 2, publishes nothing half, leaves no
staging folder or temporary file; once space is freed, the same command writes the
records of a run that never failed. The failures come from the fault injector's
``<site>_enospc`` points of :func:`tfaploss.pipelines.storage.write_atomic`, and from a real
small file system (a tmpfs, where the test can mount one)."""

from __future__ import annotations

import errno
import os

import pytest

from tests.support import miniature as mini
from tests.support import small_fs
from tfaploss.durable import faults
from tfaploss.durable.atomic import DiskFullError, disk_full_in, is_temp_name
from tfaploss.pipelines import console, folder

ARGS = ["--max_failure_fraction", "0.5", "--records_per_shard", "4",
        "--images_per_batch", "2", "--direct_running_mode", "in_memory"]
# One write site of each kind (the suite's time is short): in an image worker process
# (part files), in a DoFn of the job's process (shards), after Beam (the split's dead
# letters and manifest). The work list and the report go through the same write.
SITES = ["part", "shard", "manifest"]


def _records(split_dir):
    return {k: v for k, v in mini.snapshot(split_dir).items() if k.endswith(".tfrecord")}


def _temp_files(folder_):
    return [n for _, _, names in os.walk(folder_) for n in names
            if is_temp_name(n) or ".tmp-" in n]


@pytest.mark.long
def test_a_full_disk_at_each_write_of_a_job_is_one_line_and_the_rerun_ends_equal(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(console, "configure", lambda verbose=False: None)  # pytest's logs
    tree = mini.make_folder(str(tmp_path / "tree"), num_classes=3, per_class=4)
    out, reference = str(tmp_path / "out"), str(tmp_path / "reference")
    folder.run(["--input_dir", tree.root, "--output_dir", reference, *ARGS])
    argv = ["--input_dir", tree.root, "--output_dir", out, *ARGS]
    for i, site in enumerate(SITES):
        before = mini.snapshot(out) if os.path.isdir(out) else {}
        caplog.clear()
        with faults.armed(f"{site}_enospc"):
            assert console.main_wrapper(folder.run, argv) == 2, site
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and errors[0].startswith("error: no space left on the "
                                                         "device to write "), (site, errors)
        assert "bytes needed" in errors[0] or "KB needed" in errors[0]
        assert "Traceback" not in caplog.text and "RuntimeError" not in caplog.text
        # The previous version byte for byte (none at first), no staging folder.
        assert mini.snapshot(out) == before, site
        assert os.listdir(out) == (["train"] if before else []), site
        assert _temp_files(out) == []
        if i == 0:  # space freed: the same command
            assert console.main_wrapper(folder.run, argv) == 0
            assert _records(os.path.join(out, "train")) == _records(
                os.path.join(reference, "train"))


@pytest.mark.long
def test_a_job_on_a_full_tmpfs_stops_cleanly_and_the_rerun_publishes(tmp_path, monkeypatch,
                                                                     caplog):
    """The kernel's ENOSPC, in an image worker process writing a part file."""
    from tfaploss.data import integrity

    monkeypatch.setattr(console, "configure", lambda verbose=False: None)
    tree = mini.make_folder(str(tmp_path / "tree"), num_classes=3, per_class=4)
    with small_fs.mounted(tmp_path / "small", "1m") as mnt:
        filler = small_fs.fill(mnt, keep=8192)  # the work list fits, the first part not
        argv = ["--input_dir", tree.root, "--output_dir", str(mnt / "out"), *ARGS]
        assert console.main_wrapper(folder.run, argv) == 2
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "no space left on the device to write" in errors[0]
        assert str(mnt / "out") in errors[0] and "Traceback" not in caplog.text
        assert os.listdir(mnt / "out") == []  # nothing published, no staging folder
        filler.unlink()
        assert console.main_wrapper(folder.run, argv) == 0
        split = str(mnt / "out" / "train")
        integrity.check_or_raise(split, "full", layouts=("images",), what="checking")
        assert _temp_files(mnt) == []


def test_a_full_disk_is_found_however_beam_wraps_it(tmp_path):
    """Beam re-raises a worker's error as a RuntimeError caused by it; a runner may pass
    on only its text."""
    full = DiskFullError(tmp_path / "part", 10, 5)
    try:
        try:
            raise full
        except DiskFullError as err:
            raise RuntimeError(f"{err} [while running 'Process']") from err
    except RuntimeError as wrapped:
        assert disk_full_in(wrapped, tmp_path) is full
    text_only = RuntimeError("OSError: [Errno 28] No space left on device [while running]")
    found = disk_full_in(text_only, tmp_path)
    assert found.errno == errno.ENOSPC and str(tmp_path) in str(found)
    assert disk_full_in(RuntimeError("a bug"), tmp_path) is None
