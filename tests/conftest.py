"""Shared test set-up, for every Keras backend.

Keras fixes its backend at import, so each backend gets its own pytest process: ``make
test`` runs everything on TensorFlow, then the folders that hold backend-agnostic tests
again under ``KERAS_BACKEND=jax`` and ``torch``. There the tests marked ``tensorflow``
(they use TensorFlow APIs) are deselected.

On TensorFlow, two logical CPU devices are configured before TensorFlow initialises its
devices, so that ``tf.distribute.MirroredStrategy`` tests can run with two replicas on a
CPU-only machine. Golden numbers from the original implementations live in
``tests/goldens`` (see its README).
"""

import gc
import json
import logging
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
ON_TENSORFLOW = os.environ["KERAS_BACKEND"] == "tensorflow"

import pytest  # noqa: E402

if ON_TENSORFLOW:
    import tensorflow as tf

    _cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
        )
    except RuntimeError:
        # Devices already initialised (e.g. a plugin touched them); tests that need two
        # replicas check `len(tf.config.list_logical_devices("CPU"))` themselves.
        pass


def pytest_collection_modifyitems(config, items):
    if not ON_TENSORFLOW:
        kept = [item for item in items if item.get_closest_marker("tensorflow") is None]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in kept])
            items[:] = kept
    # The modules that hold a test marked slow first: pytest-xdist hands out tests in
    # this order, so the long ones start while every worker is free and the short ones
    # fill in after; last, they would run one after another at the end with the other
    # worker idle. Whole modules move, not single tests: a module's tests kept together
    # set up its module fixtures once, where splitting test_cli.py's slow tests from
    # its fast ones trained its 50 s run twice. (Stable: the order is kept otherwise.)
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)


REPO_ROOT = Path(__file__).resolve().parents[1]
GOLDENS_DIR = Path(__file__).resolve().parent / "goldens"


def load_golden(name: str) -> dict:
    """Load one golden JSON file by name, failing loudly when it is missing."""
    path = GOLDENS_DIR / name
    if not path.exists():
        raise FileNotFoundError(
            f"golden file {name} not found in {GOLDENS_DIR}; it is part of the "
            "repository (tests/goldens), so the checkout is incomplete"
        )
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="session")
def goldens_dir() -> Path:
    return GOLDENS_DIR


@pytest.fixture(scope="session")
def smooth_rank_goldens() -> dict:
    return load_golden("smooth_rank_losses.json")


@pytest.fixture(scope="session")
def aploss_goldens() -> dict:
    return load_golden("aploss_histogram.json")


@pytest.fixture(scope="session")
def retrieval_goldens() -> dict:
    return load_golden("retrieval_metrics.json")


@pytest.fixture(scope="session")
def two_replica_strategy():
    """One 2-replica MirroredStrategy on the two logical CPUs, shared by every test.

    Each strategy numbers its collective operations from the same starting key, so two
    strategies in one process can hand the runtime two different collectives under one
    key ("Collective instance ... expected type"); sharing one strategy avoids that.
    """
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    if len(devices) < 2:
        pytest.fail("tests/conftest.py should have configured two logical CPU devices")
    return tf.distribute.MirroredStrategy(devices)


@pytest.fixture(autouse=True, scope="module")
def _heap_settled_after_each_module():
    """After each test module (its own fixtures torn down): collect, then freeze what
    survives, so that CPython's cycle collector never again walks it.

    A test worker accumulates millions of long-lived objects (Keras and TensorFlow state,
    traced functions, module constants); every full collection walks them all. In one
    measured ``make test`` the two workers spent 54 and 60 s in the collector, in pauses
    of 1-2 s and up to 21 s, charged to whichever test happened to allocate; the first
    ``@given`` test of a worker paid a full ``gc.collect()`` inside hypothesis (33 s).
    Frozen, the survivors are no longer walked; garbage of later modules is still
    collected (the frozen objects only count as outside references).
    """
    yield
    gc.collect()
    gc.freeze()


_LOGGERS = ("", "tfaploss", "tfaploss.pipelines", "tfaploss.models",
            "tfaploss.pipelines.result")


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """Each test leaves logging as it found it. A job's ``main`` run in-process
    configures logging as a program does (root handlers bound to the ``sys.stderr`` of
    that moment, which pytest closes after the test); later tests must not log into
    them."""
    saved = [(logger, logger.level, list(logger.handlers), logger.propagate)
             for logger in map(logging.getLogger, _LOGGERS)]
    yield
    for logger, level, handlers, propagate in saved:
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate = propagate
