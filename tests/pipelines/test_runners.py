"""The folder and glyphs jobs on two multi-process Beam runners, against the DirectRunner.

* Beam's DaskRunner on a ``dask.distributed`` LocalCluster of 2 worker processes;
* the PortableRunner through Beam's embedded job service (``--job_endpoint embed``, the
  Job API that Flink and Spark also serve) with 2 SDK workers, each a subprocess
  (environment ``beam:env:harness_subprocess_python:v1``).

Each run must leave the same files as the DirectRunner's run of the same input (its
default: one Beam process, the image work in forked processes): the same records, byte
for byte, the same dead letters, ignored files and manifest (bar ``--output_dir``). The
inputs hold files that must become dead letters (a truncated and a missing image, a font
of random bytes) and files that must be ignored.

The image work must really run outside the test's process: ``ProcessBatchDoFn.setup``
is wrapped here, in this process only (the workers import the class afresh), and must
be called here on the DirectRunner and never on the other two.

The Dask tests are skipped when ``apache-beam[dask]`` is not installed.
"""

import contextlib
import json
import os
import random
import shutil
import signal
import sys

import matplotlib
import pytest

from tests.support import miniature as mini
from tfaploss.pipelines import folder, glyphs, steps
from tfaploss.pipelines import runner as R

try:
    import dask.distributed  # noqa: F401
    from apache_beam.runners.dask import dask_runner  # noqa: F401

    NO_DASK = ""
except ImportError as e:
    NO_DASK = f"apache-beam[dask] is not installed (pip install -e '.[dask]'): {e}"
needs_dask = pytest.mark.skipif(bool(NO_DASK), reason=NO_DASK)

FONT_DIR = os.path.join(matplotlib.get_data_path(), "fonts", "ttf")
DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
RUN_TIMEOUT_S = 120  # one tiny job: 1-5 s on 2 loaded cores
# The FnApiRunner behind the embedded job service starts --direct_num_workers SDK
# workers with this command line, each its own process.
PORTABLE = ["--runner", "PortableRunner", "--job_endpoint", "embed",
            "--environment_type", "beam:env:harness_subprocess_python:v1",
            "--environment_config",
            f"{sys.executable} -m apache_beam.runners.worker.sdk_worker_main",
            "--direct_num_workers", "2"]

# 9 images in classes 0-2 (one truncated, one a broken link, CMYK, gray, EXIF-rotated)
# and a README.txt; class 2 is the test split. Two shards and batches of two images give
# the runners several elements to spread.
FOLDER_ARGS = ["--test_classes", "2", "--num_shards", "2", "--images_per_batch", "2",
               "--class_chunk_size", "2", "--max_failure_fraction", "1"]
# A, B, C in two faces (6 images; C is the test split) and a font of random bytes.
GLYPH_ARGS = ["--charset", "U+0041-U+0043", "--min_coverage", "0.5", "--test_fraction",
              "0.34", "--val_fraction", "0", "--canvas_size", "16", "--num_shards", "2",
              "--images_per_batch", "1", "--max_failure_fraction", "1"]
JOBS = {"folder": (folder.run, FOLDER_ARGS), "glyphs": (glyphs.run, GLYPH_ARGS)}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tree = str(tmp_path_factory.mktemp("tree"))
    mini.make_folder(tree, num_classes=3, per_class=3)
    fonts = tmp_path_factory.mktemp("fonts")
    shutil.copy(os.path.join(FONT_DIR, "DejaVuSans.ttf"), fonts / "DejaVuSans.ttf")
    (fonts / "serif").mkdir()
    shutil.copy(os.path.join(FONT_DIR, "DejaVuSerif.ttf"), fonts / "serif" / "DejaVuSerif.ttf")
    (fonts / "broken.ttf").write_bytes(random.Random(0).randbytes(4000))
    (fonts / "README.txt").write_text("not a font\n")
    return {"folder": tree, "glyphs": str(fonts)}


@pytest.fixture(scope="module")
def setups_here():
    """Pids of the ``ProcessBatchDoFn.setup`` calls made in this process."""
    pids = []
    original = steps.ProcessBatchDoFn.setup

    def setup(self):
        pids.append(os.getpid())
        original(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steps.ProcessBatchDoFn, "setup", setup)
        yield pids


def _outputs(out: str) -> dict:
    """Every file the job left in ``out``: its SHA-256, the manifests parsed (their
    ``options`` name the output folder, which differs from run to run)."""
    files = mini.snapshot(out)
    for rel in [r for r in files if os.path.basename(r) == "manifest.json"]:
        with open(os.path.join(out, rel)) as f:
            files[rel] = json.load(f)
        assert files[rel]["options"].pop("output_dir") == out
    return files


def _placeless(manifests: dict) -> dict:
    """The manifests ``run`` returned, without the output folder."""
    return {split: {**m, "options": {k: v for k, v in m["options"].items()
                                     if k != "output_dir"}}
            for split, m in manifests.items()}


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise TimeoutError in this (the main) thread after ``seconds``: a runner that
    hangs fails the test instead of the suite."""
    def expire(signum, frame):
        raise TimeoutError(f"the job ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _run(job: str, inputs: dict, out: str, runner_args: list[str]) -> tuple[dict, dict]:
    run, args = JOBS[job]
    with _deadline(RUN_TIMEOUT_S):
        manifests = run(["--input_dir", inputs[job], "--output_dir", out, *args,
                         *runner_args])
    return manifests, _outputs(out)


def _dask(cluster) -> list[str]:
    """The runner options of a job on ``cluster``: its 2 workers each get a partition
    of the work-list ranges."""
    return ["--runner", DASK_RUNNER, "--dask_client_address", cluster.scheduler_address,
            "--dask_npartitions", "2"]


@pytest.fixture(scope="module")
def direct(inputs, setups_here, tmp_path_factory):
    """Both jobs on the DirectRunner, before any cluster exists in this process (the
    DirectRunner forks its image processes)."""
    runs = {}
    for job in JOBS:
        before = len(setups_here)
        runs[job] = _run(job, inputs, str(tmp_path_factory.mktemp(f"{job}_direct")), [])
        assert set(setups_here[before:]) == {os.getpid()}
    return runs


@pytest.fixture(scope="module")
def dask_cluster(direct):
    from dask.distributed import LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                           dashboard_address=None, scheduler_port=0)
    try:
        yield cluster
    finally:
        cluster.close(timeout=30)


def test_direct_runs_hold_the_expected_records_and_failures(direct):
    manifests, files = direct["folder"]
    assert {s: m["num_images"] for s, m in manifests.items()} == {"train": 4, "test": 3}
    assert manifests["train"]["failures_by_reason"] == {"missing_file": 1, "truncated": 1}
    assert manifests["train"]["ignored_files"] == [
        {"path": "README.txt", "reason": "not inside a class folder"}]
    assert {r for r in files if r.endswith(".tfrecord")} == {
        "train/images-00000-of-00002.tfrecord", "train/images-00001-of-00002.tfrecord",
        "train/by_class/classes-00000-of-00002.tfrecord",
        "train/by_class/classes-00001-of-00002.tfrecord",
        "test/images-00000-of-00002.tfrecord", "test/images-00001-of-00002.tfrecord"}
    manifests, _ = direct["glyphs"]
    assert {s: m["num_images"] for s, m in manifests.items()} == {"train": 4, "test": 2}
    assert manifests["train"]["failures_by_reason"] == {"undecodable": 1}
    assert [d["path"] for d in manifests["train"]["ignored_files"]] == ["README.txt"]


@needs_dask
@pytest.mark.parametrize("job", list(JOBS))
def test_dask_runner_writes_what_the_direct_runner_writes(job, inputs, direct, dask_cluster,
                                                          setups_here, tmp_path):
    before = len(setups_here)
    manifests, files = _run(job, inputs, str(tmp_path / "out"), _dask(dask_cluster))
    assert setups_here[before:] == []  # the image work ran in the cluster's workers
    want_manifests, want_files = direct[job]
    assert files == want_files
    assert _placeless(manifests) == _placeless(want_manifests)


@needs_dask
def test_results_a_runner_drops_fail_the_job_publishing_nothing(inputs, dask_cluster,
                                                                monkeypatch, tmp_path):
    # The DaskRunner drops what a DoFn emits in finish_bundle: with batches held back
    # until then, the last ones of each bundle never reach the writers.
    monkeypatch.setattr(R, "emit_lag", lambda options: 2)
    out = tmp_path / "out"
    with pytest.raises(R.IncompleteRunError, match=r"returned results for \d of the [35] "
                                                   r"images of split '.*nothing was published"):
        _run("folder", inputs, str(out), _dask(dask_cluster))
    assert sorted(os.listdir(out)) == []


@pytest.mark.parametrize("job", list(JOBS))
@pytest.mark.slow
def test_portable_runner_writes_what_the_direct_runner_writes(job, inputs, direct,
                                                              setups_here, tmp_path):
    before = len(setups_here)
    manifests, files = _run(job, inputs, str(tmp_path / "out"), PORTABLE)
    assert setups_here[before:] == []  # the image work ran in the SDK worker processes
    want_manifests, want_files = direct[job]
    assert files == want_files
    assert _placeless(manifests) == _placeless(want_manifests)

