"""A full disk at each file `tfaploss train` writes: one error line naming the file, exit
2, no traceback, no temporary file left, the last good checkpoint intact; once space is
freed, the same command finishes with the weights of a run that never failed. The
failures come from the fault injector's ``<file>_enospc`` points (a write raising
ENOSPC, its temporary file half-written); a Beam job's writes: test_storage_full below.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os

import pytest

from tests.run.test_preemption import _assert_same_weights, _config, _noise, _weights
from tests.support import miniature as mini
from tfaploss.durable import faults
from tfaploss.durable.atomic import DiskFullError, atomic_write_text, is_temp_name
from tfaploss.durable.checkpoints import RunBackup
from tfaploss.pipelines import storage

# (fault, the file its error names): every file a training run writes.
# make test tries the epoch checkpoint, the write a full disk most often meets; the
# other sites run in make test-long (two training runs each).
_LONG = pytest.mark.long
SITES = [
    pytest.param("config_enospc", "config.yaml", marks=_LONG, id="config.yaml"),
    pytest.param("epochs_enospc:2", "epochs.jsonl", marks=_LONG, id="epochs.jsonl"),
    pytest.param("checkpoint_enospc:2", "epoch-0002.weights.h5", id="epoch-0002.weights.h5"),
    pytest.param("metadata_enospc:2", "checkpoint.json", marks=_LONG, id="checkpoint.json"),
    pytest.param("sigterm:2:2,step_checkpoint_enospc:2",
                 "partial-epoch-0002-step-000002.weights.h5", marks=_LONG,
                 id="partial-epoch-0002-step-000002.weights.h5"),
    pytest.param("model_enospc", "model.keras", marks=_LONG, id="model.keras"),
    pytest.param("summary_enospc", "summary.json", marks=_LONG, id="summary.json"),
]


def _main(config, spec=None):
    from tfaploss.cli import main

    out, err = io.StringIO(), io.StringIO()
    with faults.armed(spec), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        rc = main(["train", "--config", str(config)])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    mini.write_split_records(str(root / "train"), {k: 6 for k in range(6)}, image_fn=_noise)
    rc, out, err = _main(_config(root, "reference", root / "train"))
    assert rc == 0, out + err
    return root, _weights(root / "reference")


def _temp_files(folder):
    return [os.path.join(d, n) for d, _, names in os.walk(folder) for n in names
            if is_temp_name(n)]


@pytest.mark.slow
@pytest.mark.parametrize("spec, name", SITES)
def test_a_full_disk_at_each_write_is_one_line_and_the_rerun_ends_equal(data, spec, name):
    root, reference = data
    label = name.split(".")[0].replace("-", "_")
    config = _config(root, f"full_{label}", root / "train")
    run_dir = root / f"full_{label}"
    rc, out, err = _main(config, spec)
    assert rc == 2, out + err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "no space left on the device to write" in lines[0], err
    assert name in lines[0] and "run the same command again" in lines[0]
    assert "Traceback" not in out + err
    assert _temp_files(run_dir) == []
    if (run_dir / "backup").exists():  # the last good checkpoint reads back
        RunBackup(run_dir / "backup").find()
    rc, out, err = _main(config)  # space freed: the same command
    assert rc == 0, out + err
    _assert_same_weights(_weights(run_dir), reference)


def test_a_checkpoint_is_refused_before_writing_when_the_space_is_short(tmp_path,
                                                                        monkeypatch):
    """h5py can die by a signal when the disk fills mid-save: the free space is checked
    first, against the previous checkpoint's size x 1.2."""
    from tfaploss.durable import atomic

    backup = RunBackup(tmp_path / "backup")
    backup.directory.mkdir()
    backup.checkpoint_path(1).write_bytes(b"x" * 10_000)
    monkeypatch.setattr(atomic, "free_bytes", lambda folder: 5_000)

    class Never:
        def save_weights(self, path):
            raise AssertionError("written although the space is short")

    with pytest.raises(DiskFullError) as err:
        backup.save(Never(), 2)
    assert err.value.errno == errno.ENOSPC and err.value.needed > 12_000
    assert "epoch-0002.weights.h5" in str(err.value) and "4.9 KB free" in str(err.value)
    assert sorted(p.name for p in backup.directory.iterdir()) == ["epoch-0001.weights.h5"]


def test_storage_full_leaves_no_part_file_and_keeps_the_old_file(tmp_path):
    """A Beam job's work lists, part files, shards and manifests go through
    storage.write_atomic."""
    path = str(tmp_path / "manifest.json")
    storage.write_atomic(path, "old")
    with faults.armed("storage_enospc"), pytest.raises(DiskFullError) as err:
        storage.write_atomic(path, "x" * 1000)
    assert err.value.needed == 1000 and path in str(err.value)
    assert os.listdir(tmp_path) == ["manifest.json"]
    assert open(path).read() == "old"
    import pickle

    again = pickle.loads(pickle.dumps(err.value))  # crosses to and from Beam workers
    assert str(again) == str(err.value) and again.errno == errno.ENOSPC


def test_atomic_text_full_disk_names_the_file(tmp_path):
    with faults.armed("summary_enospc"), pytest.raises(DiskFullError, match="summary"):
        atomic_write_text(tmp_path / "summary.json", "{}", fault="summary")
    assert os.listdir(tmp_path) == []
