"""What a job prints (its plan, progress, summary and result; Beam's internals only
with ``--verbose``), and the shared ``__main__`` of the jobs (docs/pipelines.md)."""

from __future__ import annotations

import contextlib
import logging
import sys
import time

from tfaploss.log import DETAILED_FORMAT, PLAIN_FORMAT, PlainHandler

PACKAGE = logging.getLogger("tfaploss.pipelines")  # every module logger of the jobs is below it
LOG = logging.getLogger(__name__)
RESULT = logging.getLogger("tfaploss.pipelines.result")

_NOISY = ("apache_beam", "apache_beam.io.tfrecordio", "absl", "tensorflow", "urllib3",
          "google", "oauth2client")


def import_beam_quietly():
    """Import ``apache_beam`` without its import-time warnings on the root logger (which
    would also make Python install a root handler); without Beam, ``MissingExtraError``."""
    from tfaploss import extras

    if "apache_beam" in sys.modules:
        return sys.modules["apache_beam"]
    root = logging.getLogger()
    level, sink = root.level, logging.NullHandler()
    root.addHandler(sink)
    root.setLevel(logging.ERROR)
    try:
        return extras.import_extra("beam", "the pipelines jobs")
    finally:
        root.setLevel(level)
        root.removeHandler(sink)


@contextlib.contextmanager
def beam_quiet_on(*types: type):
    """While the block runs, Beam's loggers drop their reports of a broken process pool
    or of an error of ``types`` (or raised from one), which the job reports itself in
    one line."""
    from concurrent.futures.process import BrokenProcessPool

    from tfaploss.pipelines.image_workers import caused_by

    def drop(record) -> bool:
        if caused_by(record.exc_info[1] if record.exc_info else None,
                     (BrokenProcessPool, *types)):
            LOG.debug("Beam's report, left out: %s", record.getMessage())
            return False
        return True

    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name == "apache_beam" or name.startswith("apache_beam.")]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def configure(verbose: bool = False) -> None:
    """For a job's ``__main__`` only: its lines on stderr (``verbose``: with time, logger
    and level), the result on stdout, Beam at WARNING unless ``verbose``."""
    root = logging.getLogger()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(DETAILED_FORMAT if verbose else PLAIN_FORMAT))
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    PACKAGE.setLevel(logging.INFO)
    RESULT.handlers[:] = [PlainHandler()]  # an INFO line: stdout, flushed at once
    RESULT.propagate = False
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR
                                         if name.endswith("tfrecordio") else logging.WARNING)


class Progress:
    """Logs ``what: done/total (rate/s)`` at most every ``every`` seconds."""

    def __init__(self, what: str, total: int | None = None, every: float = 10.0):
        self.what, self.total, self.every = what, total, every
        self.started = self.last = time.time()
        self.done = 0

    def add(self, n: int) -> None:
        self.done += n
        now = time.time()
        if now - self.last >= self.every:
            self.last = now
            rate = self.done / max(now - self.started, 1e-9)
            of = f"/{self.total}" if self.total else ""
            LOG.info("%s: %d%s (%.1f/s)", self.what, self.done, of, rate)


LAST_TIMING: dict = {}
"""Wall-clock figures of the last ``run_job`` in this process (for benchmarks):
``startup_seconds`` is job start to the first image work, ``steady_images_per_second``
after the first batch, ``finish_seconds`` last batch to published."""


def batch_timing(report: list[dict], started: float, beam_started: float) -> dict:
    """Timing figures from the workers' per-batch report rows (``n``, ``t0``, ``t1``)."""
    n = sum(r["n"] for r in report)
    if not report:
        return {"images": 0, "startup_seconds": time.time() - started,
                "steady_images_per_second": 0.0, "planning_seconds": beam_started - started}
    first_end = min(r["t1"] for r in report)
    last_end = max(r["t1"] for r in report)
    after = sum(r["n"] for r in report if r["t1"] > first_end)
    steady = after / (last_end - first_end) if last_end > first_end else 0.0
    return {"images": n, "startup_seconds": min(r["t0"] for r in report) - started,
            "steady_images_per_second": steady, "planning_seconds": beam_started - started,
            "_last_batch_end": last_end}


def finish_timing(timing: dict, started: float, threads: int, processes: int) -> dict:
    """Complete :func:`batch_timing`'s figures once published; kept in :data:`LAST_TIMING`."""
    timing["seconds"] = time.time() - started
    # Grouping, writing the shards and by-class records, manifests and publish.
    timing["finish_seconds"] = time.time() - timing.pop("_last_batch_end", started)
    timing["images_per_second"] = timing["images"] / max(timing["seconds"], 1e-9)
    LAST_TIMING.clear()
    LAST_TIMING.update(timing, threads=threads, processes=processes)
    return timing


def log_plan(job: str, split: str, num_records: int, rejected: int, ignored: int) -> None:
    LOG.info("%s/%s: %d images to process, %d rejected and %d ignored while planning",
             job, split, num_records, rejected, ignored)


def log_summary(job: str, manifests: dict[str, dict], timing: dict) -> None:
    """One line per split, then the job's throughput (stderr)."""
    for split, m in manifests.items():
        LOG.info("%s/%s: %d images of %d classes in %d shards, %d failures, %d ignored",
                 job, split, m["num_images"], m["num_classes"], len(m["shards"]),
                 m["num_failures"], m.get("num_ignored_files", 0))
    steady = (f", then {timing['steady_images_per_second']:.1f} images/s"
              if timing["steady_images_per_second"] else "")
    workers = (f"{timing['processes']} image processes" if timing["processes"] > 1
               else f"{timing['threads']} image threads per worker")
    LOG.info("%s: %d images in %.1f s (%.1f images/s; start-up %.1f s%s; %s)", job,
             timing["images"], timing["seconds"], timing["images_per_second"],
             timing["startup_seconds"], steady, workers)


def describe_manifests(manifests: dict[str, dict]) -> str:
    """One line per split of a job's ``{split: manifest}`` result."""
    return "\n".join(
        f"{split}: {m['num_images']} images, {m['num_classes']} classes, "
        f"{m['num_failures']} failures, {len(m['shards'])} shards"
        for split, m in manifests.items()
    )


def main_wrapper(run_fn, argv: list[str] | None = None, describe=describe_manifests) -> int:
    """Shared ``__main__``: quiet logging, exit 1 on too many failures, a dead image
    worker or a run that lost images, 2 on bad arguments, an output folder another job
    holds or a full disk; ``describe(result)`` is the line written on success (stdout)."""
    from tfaploss.durable.atomic import DiskFullError
    from tfaploss.durable.locks import LockError
    from tfaploss.pipelines.image_workers import WorkerDiedError
    from tfaploss.pipelines.manifests import IncompleteRunError, TooManyFailuresError

    configure("--verbose" in (sys.argv[1:] if argv is None else argv))
    try:
        result = run_fn(argv)
    except TooManyFailuresError as e:
        LOG.error("%s", e)
        return 1
    except (WorkerDiedError, IncompleteRunError) as e:
        LOG.error("error: %s", e)
        return 1
    except (ValueError, FileNotFoundError, LockError, DiskFullError) as e:
        LOG.error("error: %s", e)
        return 2
    RESULT.info("%s", describe(result))
    return 0
