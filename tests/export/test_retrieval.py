"""The ``retrieve`` signature: an index searched inside the SavedModel (tfaploss.export).

The model here embeds exactly: a bias-free Dense layer with weights in {-1, 0, 1} over
pixels in 0..3 gives integer embeddings (|x| <= 144), whose inner products (<= 16 x 144²
< 2^24) are exact in float32 whatever order a product sums in. So the served scores and
``ExactSearcher``'s are equal to the bit, and ties (duplicate images, blank images) are
exact ties: the order of equal scores is tested, not blurred by rounding.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tfaploss.evaluation import ExactSearcher
from tfaploss.evaluation.embedding_files import embedding_example
from tfaploss.export import (
    DamagedIndexError,
    IndexMismatchError,
    RetrievalIndex,
    export_saved_model,
    load_retriever,
    model_fingerprint,
)

pytestmark = pytest.mark.tensorflow

SIZE = (4, 4)
K = 12
CHUNK = 7  # rows scored at once: the duplicates below sit in different chunks
N = 40
# Rows 10, 20 and 33 repeat row 0, rows 21 and 34 repeat row 4, and rows 5, 17 and 29
# are blank (embedding 0, score 0 for every query): ties within and across chunks.
DUPLICATES = {10: 0, 20: 0, 33: 0, 21: 4, 34: 4}
BLANK = (5, 17, 29)


def _model(seed):
    rng = np.random.default_rng(seed)
    model = keras.Sequential([keras.Input((*SIZE, 3)), keras.layers.Flatten(),
                              keras.layers.Dense(16, use_bias=False)])
    model.layers[-1].kernel.assign(rng.integers(-1, 2, (48, 16)).astype("float32"))
    return model


def _catalogue():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 4, (N, *SIZE, 3)).astype("float32")
    for row, original in DUPLICATES.items():
        images[row] = images[original]
    images[list(BLANK)] = 0
    return images


def _queries():
    rng = np.random.default_rng(1)
    fresh = rng.integers(0, 4, (5, *SIZE, 3)).astype("float32")
    catalogue = _catalogue()
    return np.concatenate([catalogue[[0, 4, 5]], fresh, -catalogue[[0]] + 3])


def _png(image):
    buffer = io.BytesIO()
    Image.fromarray(image.astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


KEYS = np.array([f"item-{i:02d}.png" for i in range(N)])
LABELS = np.arange(N) % 7


def _expected(model, queries, k=K):
    """ExactSearcher's top-k over the same embeddings, as keys, scores and labels."""
    database = model.predict(_catalogue(), verbose=0)
    rows, scores = ExactSearcher(database, engine="numpy").search(
        model.predict(queries, verbose=0), k)
    return KEYS[rows], scores, LABELS[rows]


_CHILD = """
import sys
sys.modules['keras'] = None
sys.modules['tf_keras'] = None
sys.modules['tfaploss'] = None
import json, numpy as np, tensorflow as tf
version, query = sys.argv[1:]
fn = tf.saved_model.load(version).signatures['retrieve']
data = list(np.load(query, allow_pickle=True))
res = fn(image_bytes=tf.constant(data), k=tf.constant(3))
print(json.dumps({'keys': res['keys'].numpy().astype(str).tolist(),
                  'imported': [m for m in ('keras', 'tfaploss') if sys.modules.get(m)]}))
# TensorFlow's own command line, in the same Keras-free process: k left to its default.
from tensorflow.python.tools import saved_model_cli
sys.argv = ['saved_model_cli', 'run', '--dir', version, '--tag_set', 'serve',
            '--signature_def', 'retrieve', '--inputs', 'image_bytes=' + query]
saved_model_cli.main()
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = _model(2)
    base = tmp_path_factory.mktemp("retrieval") / "served"
    index = RetrievalIndex(model.predict(_catalogue(), verbose=0), KEYS, LABELS,
                           model_fingerprint(model), source="the test catalogue")
    version = export_saved_model(model, base, image_size=SIZE, crop_fraction=1.0,
                                 index=index, k=K, index_chunk_rows=CHUNK)
    # The Keras-free child starts now and runs while the other tests do.
    work = tmp_path_factory.mktemp("child")
    query = work / "query.npy"
    np.save(query, np.array([_png(q) for q in _queries()[:2]], dtype=object))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    with open(work / "out", "w") as out, open(work / "err", "w") as err:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, version, str(query)],
                                 stdout=out, stderr=err, env=env, cwd=work)
    yield model, base, version, (child, work)
    if child.poll() is None:
        child.kill()
        child.wait()


def test_served_top_k_is_exact_searchers_with_its_ties(exported):
    model, _, version, _ = exported
    retrieve = load_retriever(version)
    queries = _queries()
    keys, scores, labels = _expected(model, queries)
    served = retrieve.pixels(queries)
    np.testing.assert_array_equal(served["keys"], keys)
    np.testing.assert_array_equal(served["scores"], scores)
    np.testing.assert_array_equal(served["labels"], labels)
    # The test holds ties to order: row 0's query finds its four copies at one score,
    # in catalogue order, across three chunks; the blank query ties with everything.
    first = served["keys"][0].tolist().index(KEYS[0])
    copies = slice(first, first + 4)
    assert served["keys"][0, copies].tolist() == [KEYS[i] for i in (0, 10, 20, 33)]
    assert len(set(served["scores"][0, copies])) == 1
    assert (served["scores"][2] == 0).all()
    assert served["keys"][2].tolist() == KEYS[:K].tolist()
    # A request may ask for fewer; the first k are the same.
    fewer = retrieve.pixels(queries, k=3)
    np.testing.assert_array_equal(fewer["keys"], keys[:, :3])


def test_bytes_path_equals_pixels_path(exported):
    _, _, version, _ = exported
    retrieve = load_retriever(version)
    queries = _queries()
    from_bytes = retrieve([_png(q) for q in queries])
    from_pixels = retrieve.pixels(queries)
    for name in ("keys", "scores", "labels"):
        np.testing.assert_array_equal(from_bytes[name], from_pixels[name])


def test_k_outside_the_exported_range_is_invalid_argument(exported):
    _, _, version, _ = exported
    retrieve = load_retriever(version)
    for k in (0, K + 1):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=f"between 1 and.*{K}.*received.*{k}"):
            retrieve.pixels(_queries()[:1], k=k)
    assert retrieve.metadata["retrieval"]["k"] == K


def test_the_export_uses_stock_tensorflow_ops_only(exported):
    """What TF Serving must know to run the export: every op of the graph and its
    functions is one of stock TensorFlow's (no ScaNN or other custom op)."""
    from tensorflow.core.protobuf import saved_model_pb2
    from tensorflow.python.framework import op_def_registry

    _, _, version, _ = exported
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((Path(version) / "saved_model.pb").read_bytes())
    graph = saved.meta_graphs[0].graph_def
    functions = {f.signature.name for f in graph.library.function}
    ops = {n.op for n in graph.node} | {n.op for f in graph.library.function
                                         for n in f.node_def}
    ops -= functions
    assert {"MatMul", "TopKV2", "ResourceGather"} <= ops
    assert [op for op in ops if op_def_registry.get(op) is None] == []
    assert not [op for op in ops if "scann" in op.lower()]


def test_retrieve_runs_without_keras_and_saved_model_cli_returns_keys(exported):
    model, _, _, (child, work) = exported
    child.wait(timeout=300)
    assert child.returncode == 0, (work / "err").read_text()[-3000:]
    stdout = (work / "out").read_text()
    report = json.loads(stdout.splitlines()[0])
    keys, _, _ = _expected(model, _queries()[:2])
    assert report == {"keys": keys[:, :3].tolist(), "imported": []}
    # saved_model_cli prints each output; k took its SignatureDef default (K).
    printed = stdout.split("Result for output key keys:", 1)[1].split("Result for", 1)[0]
    assert printed.count("b'item-") == 2 * K
    for key in keys[0]:
        assert f"b'{key}'" in printed


def _write_embeddings(folder: Path, embeddings, keys, labels, model_dir, drop=None):
    """An embed job's output, as tfaploss.pipelines.embed writes it."""
    folder.mkdir(parents=True)
    shards = ["embeddings-00000-of-00002.tfrecord", "embeddings-00001-of-00002.tfrecord"]
    half = len(keys) // 2
    for shard, part in zip(shards, (slice(0, half), slice(half, None))):
        with tf.io.TFRecordWriter(str(folder / shard)) as writer:
            for e, key, label in zip(embeddings[part], keys[part], labels[part]):
                writer.write(embedding_example(e, key, int(label)))
    manifest = {"model": str(model_dir), "num_embedded": len(keys) - (drop or 0),
                "shards": shards, "format": "tfaploss.evaluation.embedding_files"}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_an_index_from_the_embed_job_is_a_new_version_and_checked(exported, tmp_path):
    """The embed job's output serves as the index of the model that embedded it (its
    manifest names the export): a second version beside the first, which is kept. The
    same output with another model, or damaged, is refused."""
    model, base, version, _ = exported
    embeddings = model.predict(_catalogue(), verbose=0)
    renamed = np.array([f"job-{key}" for key in KEYS])
    folder = _write_embeddings(tmp_path / "emb", embeddings, renamed, LABELS, version)
    first = (Path(version) / "variables" / "variables.data-00000-of-00001").read_bytes()
    second = export_saved_model(model, base, image_size=SIZE, crop_fraction=1.0,
                                index=str(folder), k=K, index_chunk_rows=CHUNK)
    assert Path(second) == base / "2"
    assert (Path(version) / "variables" / "variables.data-00000-of-00001").read_bytes() \
        == first
    served = load_retriever(second).pixels(_queries())
    keys, scores, _ = _expected(model, _queries())
    # load_embeddings sorts by id; "job-item-NN.png" sorts as the catalogue does.
    np.testing.assert_array_equal(served["keys"], np.char.add("job-", keys))
    np.testing.assert_array_equal(served["scores"], scores)
    assert load_retriever(base).metadata["retrieval"]["source"] == str(folder)

    other = _model(3)
    with pytest.raises(IndexMismatchError, match="embedded by the model with fingerprint"):
        export_saved_model(other, tmp_path / "other", image_size=SIZE, index=str(folder))
    with pytest.raises(IndexMismatchError, match="embedded by the model"):
        export_saved_model(other, tmp_path / "other", image_size=SIZE, index=RetrievalIndex(
            embeddings, KEYS, LABELS, model_fingerprint(model)))
    assert not (tmp_path / "other").exists() or not os.listdir(tmp_path / "other")

    short = _write_embeddings(tmp_path / "short", embeddings, renamed, LABELS, version,
                              drop=1)
    with pytest.raises(DamagedIndexError, match="holds 40 rows; its manifest counts 39"):
        export_saved_model(model, tmp_path / "m", image_size=SIZE, index=str(short))
    os.remove(folder / "embeddings-00001-of-00002.tfrecord")
    with pytest.raises(DamagedIndexError, match="lacks the shard"):
        export_saved_model(model, tmp_path / "m", image_size=SIZE, index=str(folder))
    gone = _write_embeddings(tmp_path / "gone", embeddings, renamed, LABELS,
                             tmp_path / "no_such_export")
    with pytest.raises(IndexMismatchError, match="cannot tell which model embedded"):
        export_saved_model(model, tmp_path / "m", image_size=SIZE, index=str(gone))
    bad = embeddings.copy()
    bad[3, 1] = np.nan
    with pytest.raises(DamagedIndexError, match="1 row.*NaN.*row 3"):
        RetrievalIndex(bad, KEYS, LABELS, model_fingerprint(model))
    with pytest.raises(DamagedIndexError, match="name more than one row"):
        RetrievalIndex(embeddings, np.array(["same"] * N), LABELS, model_fingerprint(model))
    # Keys read from records as bytes are decoded, not written as "b'...'".
    raw = RetrievalIndex(embeddings[:2], np.array([b"x/1.jpg", "y"], dtype=object), [0, 1],
                         model_fingerprint(model))
    assert raw.keys.tolist() == ["x/1.jpg", "y"]


def test_a_damaged_or_swapped_stored_index_is_refused(exported, tmp_path):
    """Bytes of the stored index flipped: TensorFlow's checksum refuses the version.
    The index of another export put in its place (whole, so TensorFlow takes it): the
    digest the export recorded refuses it. A metadata that pairs the index with another
    model's fingerprint: refused as a mismatch."""
    model, _, version, _ = exported
    data_file = Path("variables") / "variables.data-00000-of-00001"
    damaged = tmp_path / "damaged"
    shutil.copytree(version, damaged)
    raw = bytearray((damaged / data_file).read_bytes())
    at = bytes(raw).find(model.predict(_catalogue()[:1], verbose=0).tobytes())
    assert at > 0  # the index's first row, as stored
    raw[at + 5] ^= 0xFF
    (damaged / data_file).write_bytes(bytes(raw))
    with pytest.raises(DamagedIndexError, match="Checksum does not match"):
        load_retriever(damaged)

    swapped = tmp_path / "swapped"
    shutil.copytree(version, swapped)
    other = export_saved_model(model, tmp_path / "other", image_size=SIZE,
                               crop_fraction=1.0, index=RetrievalIndex(
                                   model.predict(_catalogue()[::-1], verbose=0), KEYS,
                                   LABELS, model_fingerprint(model)),
                               k=K, index_chunk_rows=CHUNK)
    shutil.rmtree(swapped / "variables")
    shutil.copytree(Path(other) / "variables", swapped / "variables")
    with pytest.raises(DamagedIndexError, match="not the one exported with its model"):
        load_retriever(swapped)

    mismatched = tmp_path / "mismatched"
    shutil.copytree(version, mismatched)
    meta_file = mismatched / "assets.extra" / "tfaploss_export.json"
    meta = json.loads(meta_file.read_text())
    meta["retrieval"]["model_fingerprint"] = model_fingerprint(_model(3))
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(IndexMismatchError, match="not by the model it is served with"):
        load_retriever(mismatched)


def test_model_fingerprint_follows_the_weights():
    model = _model(2)
    same = keras.models.clone_model(model)
    same.set_weights(model.get_weights())
    assert model_fingerprint(same) == model_fingerprint(model)
    assert model_fingerprint(_model(3)) != model_fingerprint(model)
    kernel = model.layers[-1].kernel
    before = model_fingerprint(model)
    kernel.assign(kernel + np.eye(48, 16, dtype="float32") * 1e-7)
    assert model_fingerprint(model) != before


def test_scann_is_refused_clearly_where_its_ops_do_not_load(monkeypatch, tmp_path):
    from tfaploss import extras
    from tfaploss.export import retrieval_search

    def broken(extra, needed_by, module=None):
        raise extras.MissingExtraError(extra, needed_by)

    monkeypatch.setattr(extras, "import_extra", broken)
    model = _model(2)
    index = RetrievalIndex(np.eye(3, 16, dtype="float32"), ["a", "b", "c"], [0, 1, 2],
                           model_fingerprint(model))
    with pytest.raises(extras.MissingExtraError) as info:
        export_saved_model(model, tmp_path / "m", image_size=SIZE, index=index,
                           index_backend="scann")
    message = str(info.value)
    assert "index_backend='scann'" in message and "TF Serving" in message
    assert 'pip install "tfaploss[scann]"' in message
    with pytest.raises(ValueError, match="`index_backend` must be one of brute_force, scann"):
        retrieval_search.check_backend("annoy")
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_scann_index_where_its_ops_load(exported, tmp_path):
    """Below 100k rows ScaNN re-scores every row exactly (reorder >= N): the served
    results are then ExactSearcher's, ties re-sorted by row."""
    from tfaploss import extras

    if not extras.usable("scann"):
        pytest.skip("ScaNN is not installed here")
    model = exported[0]
    index = RetrievalIndex(model.predict(_catalogue(), verbose=0), KEYS, LABELS,
                           model_fingerprint(model))
    version = export_saved_model(model, tmp_path / "scann", image_size=SIZE,
                                 crop_fraction=1.0, index=index, k=K,
                                 index_backend="scann")
    retrieve = load_retriever(version)
    assert retrieve.metadata["retrieval"]["backend"] == "scann"
    keys, scores, _ = _expected(model, _queries())
    served = retrieve.pixels(_queries())
    np.testing.assert_array_equal(served["scores"], scores)
    np.testing.assert_array_equal(served["keys"], keys)


@pytest.mark.slow
def test_cli_export_with_a_split_as_the_index(tmp_path, capsys):
    """`tfaploss export --index SPLIT`: the split embedded with the model; every image of
    a class is the same flat JPEG, so a class's rows tie exactly and come in id order."""
    from tests.support import miniature as mini
    from tfaploss.cli import main
    from tfaploss.data import load_split

    split = tmp_path / "split"
    mini.write_split_records(str(split), {0: 3, 1: 2, 2: 3}, size=(8, 8))
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.GlobalAveragePooling2D(),
                              keras.layers.Dense(4), keras.layers.UnitNormalization()])
    path, out = tmp_path / "m.keras", tmp_path / "served"
    model.save(path)
    with pytest.raises(SystemExit, match="--k and --index-backend go with --index"):
        main(["export", "--model", str(path), "--out", str(out), "--k", "3"])
    assert main(["export", "--model", str(path), "--out", str(out), "--index", str(split),
                 "--k", "4"]) == 0
    assert '"signature_name": "retrieve"' in capsys.readouterr().out
    first = next(iter(load_split(str(split), decode=False)))  # class 0's JPEG, as stored
    found = load_retriever(out)([first["encoded"].numpy()], k=3)
    assert found["keys"].tolist() == [["0/0", "0/1", "0/2"]]
    assert found["labels"].tolist() == [[0, 0, 0]] and len(set(found["scores"][0])) == 1
    meta = load_retriever(out).metadata
    assert meta["retrieval"]["source"] == str(split) and meta["retrieval"]["size"] == 8
