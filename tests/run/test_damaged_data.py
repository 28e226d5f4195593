"""``tfaploss train``, ``evaluate`` and ``verify`` on a damaged split: one message naming
the file, exit 2, no traceback; the start-up check before the first step; skipping.

The split is written by the folder job itself, so its manifest holds the job, the
options and the checksums the pipelines record.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("tensorflow")
pytest.importorskip("apache_beam")


def _write_tree(root: Path, classes: int = 6, per_class: int = 8) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for k in range(classes):
        (root / f"c{k}").mkdir(parents=True)
        for i in range(per_class):
            img = rng.integers(0, 60, (16, 16, 3), dtype=np.uint8)
            img[2 * k:2 * k + 6, 2:10] = 230
            Image.fromarray(img).save(root / f"c{k}" / f"{i}.png")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tfaploss.pipelines import folder

    root = tmp_path_factory.mktemp("damaged")
    _write_tree(root / "pngs")
    # 16 records per shard: the 32 training images (4 classes) in two shards, and the
    # by-class records (what the sampler reads) in two, 2 classes each, one to damage
    folder.run(["--input_dir", str(root / "pngs"), "--output_dir", str(root / "records"),
                "--test_classes", "c4,c5", "--records_per_shard", "16",
                "--direct_running_mode", "in_memory", "--direct_num_workers", "1"])
    config = {
        "run_dir": str(root / "run"),
        "data": {"train": str(root / "records" / "train"),
                 "sampler": "m_per_class", "batch_size": 4, "m": 2, "image_size": 16},
        "model": {"backbone": "small_cnn", "pooling": "gem", "embedding_dim": 8,
                  "weights": None, "bn_calibration_images": 0},
        "loss": {"name": "APLoss"},
        "optimizer": {"name": "adam", "lr": 1e-3},
        "training": {"epochs": 1, "steps_per_epoch": 3},
        "evaluation": {"every_n_epochs": 0, "at_end": False},
    }
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return root, path


def _copy(workspace, tmp_path) -> tuple[Path, list[Path]]:
    root, _ = workspace
    split = tmp_path / "train"
    shutil.copytree(root / "records" / "train", split)
    shards = sorted(split.glob("by_class/classes-*.tfrecord"))
    assert len(shards) == 2, shards
    return split, shards


def _flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack_from("<Q", data, 0)
    start = 16 + length + 12 + 30  # 30 bytes into the second record's data
    data[start] ^= 0xFF
    data[start + 1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate_between_records(path: Path) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack_from("<Q", data, 0)
    path.write_bytes(data[:16 + length])  # one whole record: TensorFlow reads it happily


def _main(*args):
    from tfaploss.cli import main

    return main([str(a) for a in args])


def test_the_job_records_a_checksum_per_shard(workspace):
    root, _ = workspace
    manifest = json.loads((root / "records" / "train" / "manifest.json").read_text())
    files = manifest["checksums"]["files"]
    assert manifest["checksums"]["algorithm"] == "crc32c"
    assert sorted(files) == sorted(manifest["shards"] + manifest["by_class"]["shards"])
    assert sum(files[s]["records"] for s in manifest["shards"]) == manifest["num_images"]


def test_verify_exits_0_then_2_with_one_line_per_damaged_shard(workspace, tmp_path, capsys):
    split, shards = _copy(workspace, tmp_path)
    files = len(json.loads((split / "manifest.json").read_text())["checksums"]["files"])
    assert _main("verify", split) == 0
    assert f"OK: {files} file(s)" in capsys.readouterr().out
    _flip_payload(shards[0])
    _truncate_between_records(shards[1])
    for flags in ((), ("--records",)):
        assert _main("verify", split, *flags) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("DAMAGED")]
        assert [Path(ln.split()[1].rstrip(":")).name for ln in lines] == [s.name for s in shards], err
        assert "record 1" in lines[0] and "CRC" in lines[0]
        assert "python -m tfaploss.pipelines.folder" in err and "--records_per_shard 16" in err
    # The folder above the splits: each split's manifest.
    assert _main("verify", split.parent, "--sizes-only") == 2
    assert _main("verify", tmp_path / "nowhere") == 1  # like every missing path


def test_train_catches_a_truncated_copy_before_the_first_step(workspace, tmp_path, capsys):
    _, config = workspace
    split, shards = _copy(workspace, tmp_path)
    _truncate_between_records(shards[1])
    rc = _main("train", "--config", config, "--set", f"data.train={split}",
               "--set", f"run_dir={tmp_path / 'run'}")
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert shards[1].name in err and "the manifest says" in err and "rebuild it" in err
    assert "Epoch 1/" not in out and "Traceback" not in err
    assert not (tmp_path / "run" / "backup").exists()


@pytest.mark.slow
def test_a_damaged_record_mid_run_stops_with_one_message(workspace, tmp_path, capsys):
    """--verify-data off: nothing checks before the run; the reader's DataLossError is
    found, named and turned into exit 2."""
    _, config = workspace
    split, shards = _copy(workspace, tmp_path)
    _flip_payload(shards[0])
    rc = _main("train", "--config", config, "--set", f"data.train={split}",
               "--set", f"run_dir={tmp_path / 'run'}", "--verify-data", "off")
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"{shards[0]} at record 1" in err and "corrupted record" in err
    assert "while training" in err and "rebuild it: python -m tfaploss.pipelines.folder" in err
    assert "Traceback" not in err and "function_node" not in err
    # The full check finds the same before the first step.
    assert _main("train", "--config", config, "--set", f"data.train={split}",
                 "--set", f"run_dir={tmp_path / 'run2'}", "--verify-data", "full") == 2
    assert "checking the training data" in capsys.readouterr().err


@pytest.mark.slow
def test_skip_damaged_shards_trains_on_the_rest_and_says_so(workspace, tmp_path, capsys):
    _, config = workspace
    split, shards = _copy(workspace, tmp_path)
    _flip_payload(shards[1])
    run_dir = tmp_path / "run"
    rc = _main("train", "--config", config, "--set", f"data.train={split}",
               "--set", f"run_dir={run_dir}", "--skip-damaged-shards")
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "skipping 1 damaged file(s)" in err and shards[1].name in err
    summary = json.loads((run_dir / "summary.json").read_text())
    skipped = summary["skipped_data"]
    assert [s["file"] for s in skipped["shards"]] == [f"by_class/{shards[1].name}"]
    manifest = json.loads((split / "manifest.json").read_text())
    records = manifest["checksums"]["files"][f"by_class/{shards[1].name}"]["records"]
    assert skipped["records"] == records and "corrupted" in skipped["shards"][0]["problem"]
    assert summary["updates"] == 3


@pytest.mark.long
def test_evaluate_and_train_in_a_subprocess_exit_2_without_traceback(workspace, tmp_path):
    _, config = workspace
    split, shards = _copy(workspace, tmp_path)
    _flip_payload(shards[0])
    env_cmd = [sys.executable, "-m", "tfaploss.cli"]
    train = subprocess.run([*env_cmd, "train", "--config", str(config), "--set",
                            f"data.train={split}", "--set", f"run_dir={tmp_path / 'r'}",
                            "--verify-data", "off"],
                           capture_output=True, text=True, timeout=300, check=False)
    assert train.returncode == 2, train.stderr
    assert "Traceback" not in train.stderr and shards[0].name in train.stderr
    errors = [ln for ln in train.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, train.stderr
    images = min(split.glob("images-*.tfrecord"))  # what evaluation reads
    _flip_payload(images)
    evaluate = subprocess.run([*env_cmd, "evaluate", "--config", str(config), "--data",
                               str(split), "--image-size", "16"],
                              capture_output=True, text=True, timeout=300, check=False)
    assert evaluate.returncode == 2, evaluate.stderr
    assert "Traceback" not in evaluate.stderr and images.name in evaluate.stderr
    assert "while evaluating" in evaluate.stderr
