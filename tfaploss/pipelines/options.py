"""Command-line handling shared by every job, and how many workers do the image work.

The job's own arguments are parsed here; the rest go to Beam's ``PipelineOptions``
(:class:`JobOptions`, which reads the few Beam options that decide where the image work
runs without importing Beam).
"""

from __future__ import annotations

import argparse
import time

from tfaploss.pipelines import console
from tfaploss.pipelines import image_workers as W
from tfaploss.process_settings import available_cores

_BEAM_EPILOG = (
    "Any other option is passed to Apache Beam, e.g. --runner DataflowRunner --project P "
    "--region R --temp_location gs://... --setup_file ./setup.py, or on a Dask cluster "
    "--runner apache_beam.runners.dask.dask_runner.DaskRunner (the full name) "
    "--dask_client_address HOST:8786 --dask_npartitions N, or for the local "
    "DirectRunner --direct_running_mode in_memory|multi_processing --direct_num_workers N "
    "(default when no runner is given: in_memory, one Beam process whose image work "
    "runs in --image_processes forked processes, one per core)."
)


# Images per Beam element: small where a remote runner spreads batches over workers; with
# local image processes 128 beat 32 in each of 6 rounds (docs/benchmarks.md).
BATCH = 32
LOCAL_POOL_BATCH = 128


SHARED_OPTIONS = (
    ("--max_side", int, 0, (
        "resize so that the longer side is at most this (keeps aspect ratio; never "
        "upscales); 0 keeps the original size")),
    ("--jpeg_quality", int, 90, "JPEG quality of the re-encoded images (1-100)"),
    ("--min_side", int, 1, "images whose shorter side is below this are rejected"),
    ("--max_pixels", int, 100_000_000,
     "images with more pixels than this are rejected (decompression bombs)"),
    ("--num_shards", int, 0, "shards per split; 0 picks ceil(images / --records_per_shard)"),
    ("--records_per_shard", int, 1024, "target images per shard when --num_shards is 0"),
    ("--by_class", ("train", "all", "none"), "train", (
        "which splits also get the per-class layout (by_class/) the streaming class-balanced "
        "samplers read: splits named 'train', every split, or none")),
    ("--class_chunk_size", int, 32, (
        "most images per by_class record; larger classes are split into balanced chunks of "
        "at least half this size (keep it >= 2 m)")),
    ("--images_per_batch", int, 0, (
        "images handed to a worker as one Beam element (Beam's per-element cost is paid per "
        f"batch, not per image); 0: {LOCAL_POOL_BATCH} when the image work runs in local "
        f"image processes, {BATCH} elsewhere")),
    ("--image_processes", int, 0, (
        "on the local DirectRunner (in-memory mode): processes forked for the image work; 0: "
        "one per core; 1: none, the image work runs on --image_threads threads of the Beam "
        "process")),
    ("--image_threads", int, 0, (
        "threads decoding and encoding images in each Beam worker when no image processes "
        "are used (remote runners, Beam's multi_processing mode, --image_processes 1); 0: "
        "one per core on the local DirectRunner")),
    ("--verbose", bool, False, "also show Apache Beam's own INFO logging"),
    ("--max_failure_fraction", float, 0.01, (
        "the job fails (exit 1) when more than this fraction of a split's inputs end up in "
        "the dead letters")),
)

# The listing jobs' (folder, glyphs) link option.
FOLLOW_EXTERNAL_LINKS = ("--follow_external_links", bool, False, (
    "follow symlinks (files and folders) that leave INPUT_DIR; without it they are listed "
    "in ignored_files.jsonl"))


def add_options(parser: argparse.ArgumentParser, rows) -> None:
    """Add ``(flag, type, default, help)`` rows: type ``bool`` is a ``store_true`` flag,
    a tuple the choices."""
    for flag, kind, default, text in rows:
        if kind is bool:
            parser.add_argument(flag, action="store_true", help=text)
        elif isinstance(kind, tuple):
            parser.add_argument(flag, choices=kind, default=default, help=text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=text)


def build_parser(description: str, rows=(), *,
                 input_dir_required: bool = True) -> argparse.ArgumentParser:
    """Return a parser holding the options every job shares, then the job's ``rows``."""
    parser = argparse.ArgumentParser(
        description=description,
        epilog=_BEAM_EPILOG,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--input_dir", required=input_dir_required,
                        help="root of the raw dataset (local path or any Beam filesystem URL)")
    parser.add_argument("--output_dir", required=True,
                        help="where <split>/ folders of TFRecords and manifests are written")
    add_options(parser, SHARED_OPTIONS + tuple(rows))
    return parser


class JobOptions:
    """Beam's part of a job's command line; ``runner``, ``direct_running_mode`` (None off
    the DirectRunner) and ``direct_num_workers`` read as Beam reads them, without Beam."""

    def __init__(self, argv: list[str], verbose: bool = False):
        self.argv = list(argv)
        self.verbose = verbose
        known, _ = _BEAM_PEEK.parse_known_args(self.argv)
        self.runner = known.runner
        self.direct_running_mode = (known.direct_running_mode
                                    if "direct" in self.runner.lower() else None)
        self.direct_num_workers = known.direct_num_workers

    def pipeline_options(self):
        """Beam's ``PipelineOptions`` for these arguments (imports Beam)."""
        console.import_beam_quietly()
        from apache_beam.options.pipeline_options import PipelineOptions

        argv = self.argv
        if not self.verbose and not any(a.startswith("--default_sdk_harness_log_level")
                                        for a in argv):
            argv = [*argv, "--default_sdk_harness_log_level", "ERROR"]
        return PipelineOptions(argv)


# Beam's own parser takes no abbreviations either: `--run X` is not --runner.
_BEAM_PEEK = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
_BEAM_PEEK.add_argument("--runner", default="DirectRunner")
_BEAM_PEEK.add_argument("--direct_running_mode", default="in_memory",
                        choices=("in_memory", "multi_threading", "multi_processing"))
_BEAM_PEEK.add_argument("--direct_num_workers", type=int, default=1)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None):
    """Split ``argv`` into the job's arguments and Beam's (:class:`JobOptions`)."""
    started = time.time()
    args, beam_argv = parser.parse_known_args(argv)
    _validate(args)
    args._started = started
    return args, JobOptions(beam_argv, verbose=args.verbose)


def emit_lag(options: JobOptions) -> int:
    """Batches ``ProcessBatchDoFn`` may hold back until ``finish_bundle``: 2, but 0 on the
    DaskRunner, which drops what is emitted there (Beam 2.77)."""
    return 0 if options.runner.rsplit(".", 1)[-1].lower() == "daskrunner" else 2


def image_threads(args, options: JobOptions) -> int:
    """``--image_threads``, or the cores this worker may use when it is 0."""
    if getattr(args, "image_threads", 0):
        return args.image_threads
    mode = options.direct_running_mode
    if mode is None:
        return 2  # remote workers already run one process per core
    cpus = available_cores()
    if mode == "multi_processing":
        return max(1, cpus // max(1, options.direct_num_workers or cpus))
    return cpus


def image_processes(args, options: JobOptions) -> int:
    """Forked processes doing the image work: ``--image_processes`` (0: one per core) on
    the in-memory DirectRunner where ``fork`` exists; else 1 (threads)."""
    if options.direct_running_mode != "in_memory" or not W.can_fork():
        return 1
    return getattr(args, "image_processes", 0) or available_cores()


def _validate(args) -> None:
    if not 1 <= args.jpeg_quality <= 100:
        raise ValueError(f"--jpeg_quality must be in 1..100, got {args.jpeg_quality}")
    for name in ("max_side", "num_shards", "image_threads", "image_processes",
                 "images_per_batch"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
    for name in ("records_per_shard", "class_chunk_size", "min_side", "max_pixels"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    check_failure_fraction(args.max_failure_fraction)


def check_failure_fraction(fraction: float) -> None:
    """``--max_failure_fraction``, which every job takes, in [0, 1] (NaN is not)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--max_failure_fraction must be in [0, 1], got {fraction}")
