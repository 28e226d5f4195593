"""The Beam embedding job (`tfaploss/pipelines/embed.py`) with a tiny exported SavedModel."""

import io
import json
import runpy
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tfaploss.evaluation import evaluate, load_embeddings
from tfaploss.export import export_saved_model
from tfaploss.pipelines import embed

SIZE = 16


def _jpeg(colour, seed):
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.asarray(colour) + rng.normal(0, 20, (20, 24, 3)), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def _example(image_id, label, data):
    f = {
        "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data])),
        "image/id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image_id.encode()])),
        "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
    }
    return tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((SIZE, SIZE, 3))
    x = keras.layers.Rescaling(1 / 255.0)(inputs)
    x = keras.layers.Conv2D(4, 3, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.UnitNormalization()(keras.layers.Dense(6)(x))
    model = keras.Model(inputs, outputs)
    return export_saved_model(model, str(tmp_path_factory.mktemp("export")),
                              image_size=(SIZE, SIZE))


def _serve(version_dir, data):
    fn = tf.saved_model.load(version_dir).signatures["serving_default"]
    return fn(image_bytes=tf.constant(data))["embedding"].numpy()


@pytest.mark.slow
def test_embed_tfrecords_matches_serving_signature(tmp_path, exported):
    colours = [(200, 30, 30), (30, 200, 30)]
    records = {f"img{i}": (i % 2, _jpeg(colours[i % 2], i)) for i in range(6)}
    path = tmp_path / "in" / "images-00000-of-00001.tfrecord"
    path.parent.mkdir()
    with tf.io.TFRecordWriter(str(path)) as w:
        for image_id, (label, data) in records.items():
            w.write(_example(image_id, label, data))
        w.write(_example("broken", 1, b"this is not an image"))
    out = tmp_path / "emb"
    manifest = embed.run(["--input", str(path.parent), "--model", exported, "--output",
                          str(out), "--batch_size", "4", "--max_failure_fraction", "0.5"])
    assert manifest["num_embedded"] == 6 and manifest["num_failures"] == 1
    dead = [json.loads(line) for line in (out / "dead_letters.jsonl").read_text().splitlines()]
    assert [d["id"] for d in dead] == ["broken"] and "decode" in dead[0]["reason"]
    assert json.loads((out / "manifest.json").read_text())["num_embedded"] == 6

    emb, labels, ids = load_embeddings(str(out))
    assert list(ids) == sorted(records)
    np.testing.assert_array_equal(labels, [records[i][0] for i in ids])
    want = _serve(exported, [records[i][1] for i in ids])
    np.testing.assert_allclose(emb, want, atol=1e-6)
    # The evaluator reads the job's output directly.
    result = evaluate(str(out), ks=(1,), verbose=0)
    assert result.metrics == pytest.approx(
        evaluate(want, labels, ks=(1,), verbose=0).metrics)


@pytest.mark.slow
def test_embed_image_folder_with_labels_and_too_many_failures(tmp_path, exported):
    root = tmp_path / "tree"
    for cls, colour in (("cat", (220, 200, 20)), ("dog", (20, 20, 220))):
        (root / cls).mkdir(parents=True)
        for i in range(2):
            (root / cls / f"{i}.jpg").write_bytes(_jpeg(colour, i))
    (root / "dog" / "empty.jpg").write_bytes(b"")
    out = tmp_path / "emb"
    argv = ["--input", str(root), "--model", exported, "--output", str(out),
            "--labels_from_folders"]
    with pytest.raises(embed.TooManyFailuresError, match="1 of 5"):
        embed.run(argv)
    emb, labels, ids = load_embeddings(str(out))
    assert list(ids) == ["cat/0.jpg", "cat/1.jpg", "dog/0.jpg", "dog/1.jpg"]
    np.testing.assert_array_equal(labels, [0, 0, 1, 1])
    want = _serve(exported, [(root / i).read_bytes() for i in ids])
    np.testing.assert_allclose(emb, want, atol=1e-6)
    assert "empty file" in (out / "dead_letters.jsonl").read_text()


def test_embed_command_line_help_and_bad_model(tmp_path, monkeypatch, capsys):
    # `python -m tfaploss.pipelines.embed --help`, run in-process (a new interpreter would spend
    # seconds importing Beam and TensorFlow again).
    monkeypatch.setattr(sys, "argv", ["python -m tfaploss.pipelines.embed", "--help"])
    monkeypatch.delitem(sys.modules, "tfaploss.pipelines.embed")  # run it fresh, as `-m` does
    with pytest.raises(SystemExit) as done:
        runpy.run_module("tfaploss.pipelines.embed", run_name="__main__")
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--model" in out and "--input" in out and "--output" in out
    assert embed.main(["--input", str(tmp_path), "--model", str(tmp_path),
                       "--output", str(tmp_path / "o")]) == 2


@pytest.mark.long
def test_embed_rerun_killed_midway_keeps_the_previous_output(tmp_path, exported):
    import hashlib
    import os
    import subprocess

    from tfaploss.durable import faults

    root = tmp_path / "tree"
    for cls, colour in (("cat", (220, 200, 20)), ("dog", (20, 20, 220))):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            (root / cls / f"{i}.jpg").write_bytes(_jpeg(colour, i))
    out = tmp_path / "emb"
    argv = ["--input", str(root), "--model", exported, "--output", str(out), "--batch_size", "2"]
    first = embed.run(argv)

    def snapshot():
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}

    before = snapshot()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    killed = subprocess.run(
        [sys.executable, "-m", "tfaploss.pipelines.embed", *argv, "--labels_from_folders"], cwd=repo,
        env={**os.environ, "PYTHONPATH": repo, faults.ENV: "images:3"},
        capture_output=True, text=True, timeout=300, check=False)
    assert killed.returncode == 75, killed.stderr[-2000:]
    assert snapshot() == before
    _, labels, ids = load_embeddings(str(out))
    assert len(ids) == first["num_embedded"] == 6 and set(labels) == {-1}
    # A complete rerun swaps the new output in (labels now from the folders).
    embed.run([*argv, "--labels_from_folders"])
    _, labels, _ = load_embeddings(str(out))
    assert sorted(labels) == [0, 0, 0, 1, 1, 1]
    assert not (tmp_path / ".emb.incoming").exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped", "truncated", "jpeg"])
def test_embed_on_a_damaged_shard_names_it_and_exits_2(tmp_path, exported, damage, capsys):
    """A corrupt, truncated or foreign record file: one message naming the file and the
    command that rebuilds it (from the split's manifest), exit 2."""
    from tests.support.miniature import write_split_records
    from tfaploss.data import framing

    split = tmp_path / "train"
    manifest = write_split_records(str(split), {0: 3, 1: 3}, size=(20, 24))
    manifest.update(job="tfaploss.pipelines.folder", split="train", options={"input_dir": "photos"},
                    checksums=framing.manifest_checksums(
                        str(split), ["images-00000-of-00001.tfrecord"]))
    (split / "manifest.json").write_text(json.dumps(manifest))
    shard = split / "images-00000-of-00001.tfrecord"
    data = shard.read_bytes()
    if damage == "flipped":
        data = data[:40] + bytes([data[40] ^ 0xFF]) + data[41:]
        shard.write_bytes(data)
    elif damage == "truncated":
        shard.write_bytes(data[:len(data) // 2])
    else:
        shard.write_bytes(_jpeg((1, 2, 3), 0))
    argv = ["--input", str(shard), "--model", exported, "--output", str(tmp_path / "emb")]
    assert embed.main(argv) == 2
    err = capsys.readouterr().err
    assert str(shard) in err and "rebuild it: python -m tfaploss.pipelines.folder" in err
    assert "Traceback" not in err and not (tmp_path / "emb").exists()


@pytest.mark.parametrize("fraction", ["-0.01", "1.5", "nan", "inf"])
def test_a_failure_fraction_outside_0_1_is_refused_as_the_other_jobs_refuse_it(
        fraction, tmp_path):
    """Checked before the model is looked at, with the message every job gives."""
    from tfaploss.pipelines import folder

    message = rf"--max_failure_fraction must be in \[0, 1\], got {float(fraction)}"
    with pytest.raises(ValueError, match=message):
        embed.run(["--model", str(tmp_path / "no-model"), "--input", str(tmp_path),
                   "--output", str(tmp_path / "out"), "--max_failure_fraction", fraction])
    with pytest.raises(ValueError, match=message):
        folder.run(["--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "out"),
                    "--max_failure_fraction", fraction])
    assert not (tmp_path / "out").exists()
