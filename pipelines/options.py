"""Command-line handling shared by every job.

Beam jobs conventionally split ``argv`` in two: the job's own arguments (parsed with
argparse here) and everything else, handed to :class:`PipelineOptions` (``--runner``,
``--direct_num_workers``, ``--project``, ``--temp_location``, ``--setup_file``...).
"""

from __future__ import annotations

import argparse
import time

from pipelines import console

console.import_beam_quietly()

from apache_beam.options.pipeline_options import (
    DirectOptions,
    PipelineOptions,
    StandardOptions,
)

_BEAM_EPILOG = (
    "Any other option is passed to Apache Beam, e.g. --runner DataflowRunner --project P "
    "--region R --temp_location gs://... --setup_file ./setup.py, or on a Dask cluster "
    "--runner apache_beam.runners.dask.dask_runner.DaskRunner (the full name) "
    "--dask_client_address HOST:8786 --dask_npartitions N, or for the local "
    "DirectRunner --direct_running_mode in_memory|multi_processing --direct_num_workers N "
    "(default when no runner is given: in_memory, one Beam process whose image work "
    "runs in --image_processes forked processes, one per core)."
)


# Images per Beam element. With local image processes a batch is one wake-up of the
# Beam thread that feeds them: 128 beat 32 in each of 6 rounds (600 and 2,400 images,
# docs/benchmarks.md). Elsewhere a batch is the unit a remote runner spreads over its
# workers, so it stays small.
BATCH = 32
LOCAL_POOL_BATCH = 128


def build_parser(description: str, *, input_dir_required: bool = True) -> argparse.ArgumentParser:
    """Return a parser holding the options every job shares."""
    parser = argparse.ArgumentParser(
        description=description,
        epilog=_BEAM_EPILOG,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--input_dir", required=input_dir_required,
                        help="root of the raw dataset (local path or any Beam filesystem URL)")
    parser.add_argument("--output_dir", required=True,
                        help="where <split>/ folders of TFRecords and manifests are written")
    parser.add_argument("--max_side", type=int, default=0,
                        help="resize so that the longer side is at most this (keeps aspect "
                             "ratio; never upscales); 0 keeps the original size")
    parser.add_argument("--jpeg_quality", type=int, default=90,
                        help="JPEG quality of the re-encoded images (1-100)")
    parser.add_argument("--min_side", type=int, default=1,
                        help="images whose shorter side is below this are rejected")
    parser.add_argument("--max_pixels", type=int, default=100_000_000,
                        help="images with more pixels than this are rejected (decompression bombs)")
    parser.add_argument("--num_shards", type=int, default=0,
                        help="shards per split; 0 picks ceil(images / --records_per_shard)")
    parser.add_argument("--records_per_shard", type=int, default=1024,
                        help="target images per shard when --num_shards is 0")
    parser.add_argument("--by_class", choices=("train", "all", "none"), default="train",
                        help="which splits also get the per-class layout (by_class/) the "
                             "streaming class-balanced samplers read: splits named 'train', "
                             "every split, or none")
    parser.add_argument("--class_chunk_size", type=int, default=32,
                        help="most images per by_class record; larger classes are split into "
                             "balanced chunks of at least half this size (keep it >= 2 m)")
    parser.add_argument("--images_per_batch", type=int, default=0,
                        help="images handed to a worker as one Beam element (Beam's "
                             "per-element cost is paid per batch, not per image); 0: "
                             f"{LOCAL_POOL_BATCH} when the image work runs in local image "
                             f"processes, {BATCH} elsewhere")
    parser.add_argument("--image_processes", type=int, default=0,
                        help="on the local DirectRunner (in-memory mode): processes forked "
                             "for the image work; 0: one per core; 1: none, the image work "
                             "runs on --image_threads threads of the Beam process")
    parser.add_argument("--image_threads", type=int, default=0,
                        help="threads decoding and encoding images in each Beam worker "
                             "when no image processes are used (remote runners, Beam's "
                             "multi_processing mode, --image_processes 1); 0: one per core "
                             "on the local DirectRunner")
    parser.add_argument("--verbose", action="store_true",
                        help="also show Apache Beam's own INFO logging")
    parser.add_argument("--max_failure_fraction", type=float, default=0.01,
                        help="the job fails (exit 1) when more than this fraction of a split's "
                             "inputs end up in the dead letters")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None):
    """Split ``argv`` into the job's arguments and Beam's :class:`PipelineOptions`."""
    started = time.time()
    args, beam_argv = parser.parse_known_args(argv)
    _validate(args)
    args._started = started
    if not args.verbose and not any(a.startswith("--default_sdk_harness_log_level")
                                    for a in beam_argv):
        beam_argv = [*beam_argv, "--default_sdk_harness_log_level", "ERROR"]
    options = PipelineOptions(beam_argv)
    standard = options.view_as(StandardOptions)
    direct = options.view_as(DirectOptions)
    runner = (standard.runner or "DirectRunner").lower()
    if "direct" in runner and not any(a.startswith("--direct_running_mode") for a in beam_argv):
        # One Beam process, its image work in forked processes (pipelines.image_workers):
        # Beam's multi-process mode costs a second of start-up per worker and a gRPC copy
        # of every record.
        direct.direct_running_mode = "in_memory"
        if not any(a.startswith("--direct_num_workers") for a in beam_argv):
            direct.direct_num_workers = 1
    return args, options


def _validate(args) -> None:
    if not 1 <= args.jpeg_quality <= 100:
        raise ValueError(f"--jpeg_quality must be in 1..100, got {args.jpeg_quality}")
    for name in ("max_side", "num_shards"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
    for name in ("image_threads", "image_processes"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.images_per_batch < 0:
        raise ValueError(f"--images_per_batch must be >= 0, got {args.images_per_batch}")
    for name in ("records_per_shard", "class_chunk_size", "min_side", "max_pixels"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.max_failure_fraction <= 1.0:
        raise ValueError(
            f"--max_failure_fraction must be in [0, 1], got {args.max_failure_fraction}")
