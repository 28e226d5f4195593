"""The image workers' part files and the shard writers that assemble them."""

import os

import pytest

from tests.support import miniature as mini
from tfaploss.pipelines import image_workers as W
from tfaploss.pipelines import images as I
from tfaploss.pipelines import shard_writers as S
from tfaploss.pipelines import tf_example as X

SETTINGS = {"max_side": 16, "jpeg_quality": 90, "min_side": 1, "max_pixels": 10**8}


@pytest.fixture()
def records(tmp_path):
    """Three images (the middle one truncated) as work-list records."""
    out = []
    for i, kind in enumerate(["rgb", "corrupt", "exif"]):
        path = str(tmp_path / f"img{i}.jpg")
        mini.write_image(path, i + 1, kind)
        out.append({"id": f"img{i}", "path": path, "relpath": f"img{i}.jpg", "label": i,
                    "super_label": -1, "class_text": f"c{i}", "index": i})
    return out


def test_a_task_writes_its_records_where_it_says(records, tmp_path):
    part = W.part_path(str(tmp_path), "train", records)
    results = W.process_task([dict(r) for r in records], SETTINGS, str(tmp_path), part)
    assert isinstance(results[1], dict) and results[1]["reason"] == I.TRUNCATED
    with open(part, "rb") as f:
        data = f.read()
    ok = [results[0], results[2]]
    assert ok[0][0] == 0 and ok[1][0] == ok[0][1] and ok[1][0] + ok[1][1] == len(data)
    for record, (offset, length, jpeg_at, jpeg_length) in zip([records[0], records[2]], ok):
        with open(record["path"], "rb") as f:
            jpeg, h, w = I.process_image_bytes(f.read(), max_side=16)
        assert data[offset:offset + length] == X.frame_record(
            X.image_example(record, jpeg, h, w))
        assert data[jpeg_at:jpeg_at + jpeg_length] == jpeg


def test_no_part_file_when_every_image_fails(records, tmp_path):
    part = W.part_path(str(tmp_path), "train", records[1:2])
    results = W.process_task([dict(records[1])], SETTINGS, None, part)
    assert results[0]["reason"] == I.TRUNCATED and not os.path.exists(part)


def test_part_names_depend_on_the_ids_only(records, tmp_path):
    assert W.part_path("p", "train", records) == W.part_path("p", "train", records)
    assert W.part_path("p", "train", records) != W.part_path("p", "train", records[:2])
    assert W.part_path("p", "train", records) != W.part_path("p", "test", records)


def test_the_jpeg_is_found_even_behind_a_lookalike_prefix():
    jpeg = b"\xff\xd8" + bytes(range(200)) * 2
    framed = b"head" + jpeg[:64] + b"tail" + jpeg + b"end"
    assert W._find(framed, jpeg) == 4 + 64 + 4


def test_shard_writers_order_by_index_and_chunk_by_class(records, tmp_path):
    part = W.part_path(str(tmp_path), "train", records)
    results = W.process_task([dict(r) for r in records], SETTINGS, None, part)
    ok = [(r, res) for r, res in zip(records, results) if not isinstance(res, dict)]
    items = [(r["index"], r["id"], part, res[0], res[1]) for r, res in reversed(ok)]
    out = tmp_path / "out"
    assert S.write_image_shard(str(out / "images-00000-of-00001.tfrecord"), items) == 2
    assert [e["image/index"][0] for e in mini.read_examples(str(out))] == [0, 2]
    class_items = [(7, r["id"], 1, part, res[2], res[3]) for r, res in ok]
    path = str(out / "by_class" / "classes-00000-of-00001.tfrecord")
    assert S.write_class_shard(path, class_items, chunk_size=1) == 2
    chunks = mini.read_examples(str(out), "by_class")
    assert [(c["class/label"][0], c["class/chunk"][0], c["class/num_chunks"][0])
            for c in chunks] == [(7, 0, 2), (7, 1, 2)]
    assert [c["image/id"] for c in chunks] == [[b"img0"], [b"img2"]]


_INHERITED_ITERATOR = """
import gc, sys
import tensorflow as tf
from tfaploss.pipelines import image_workers as W
gc.disable()  # keep the cycle uncollected until the pool forks, as earlier work can
it = iter(tf.data.Dataset.range(100).map(lambda x: x * 2, num_parallel_calls=2).prefetch(4))
next(it)
cycle = [it]
cycle.append(cycle)
del it, cycle
token = W.start_local_pool(1)
print("collected", W.local_pool(token).submit(gc.collect).result(timeout=60), flush=True)
W.stop_local_pool(token)
"""


@pytest.mark.slow
def test_a_worker_never_collects_the_tf_data_iterators_it_inherits(tmp_path):
    """A tf.data iterator left in a reference cycle in the job's process (a notebook, a
    test run before it) waits in its destructor for threads a forked worker does not
    have: the worker hung at its first garbage collection, and the job with it."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TF_CPP_MIN_LOG_LEVEL": "3",
           "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", _INHERITED_ITERATOR], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("collected "), done.stdout


def test_a_pool_unfreezes_only_what_it_froze():
    """The pool freezes the heap its workers inherit, then unfreezes it, except when its
    caller had frozen objects itself: gc.unfreeze() would release those too."""
    import gc

    from tfaploss.pipelines import image_workers as W

    def pool_once():
        W.stop_local_pool(W.start_local_pool(1))

    def frozen(obj) -> bool:  # gc.get_objects() lists the collected generations only
        return not any(o is obj for o in gc.get_objects())

    gc.unfreeze()
    pool_once()
    assert gc.get_freeze_count() == 0
    kept = [[] for _ in range(3)]  # a live object of the caller's, frozen by the caller
    gc.freeze()
    assert frozen(kept)
    pool_once()
    assert frozen(kept) and gc.get_freeze_count() > 0
