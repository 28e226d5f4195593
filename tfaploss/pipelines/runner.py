"""The job runner every preprocessing job shares: plan -> Beam -> publish.

Each job hands :func:`run_job` one :class:`~tfaploss.pipelines.plan.SplitPlan` per
split; the runner writes the work lists, starts the local image processes before it
imports Beam, runs the pipeline, checks that every planned image is accounted for once,
and publishes each split only when all are complete (docs/pipelines.md). Importing it
does not import Beam; ``__all__`` is what the jobs, tests and benchmarks import.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures.process import BrokenProcessPool

from tfaploss.durable import atomic, locks
from tfaploss.pipelines import console, storage
from tfaploss.pipelines import image_workers as W
from tfaploss.pipelines import layout as L
from tfaploss.pipelines import manifests as M
from tfaploss.pipelines import options as opts
from tfaploss.pipelines.console import LAST_TIMING, describe_manifests, main_wrapper
from tfaploss.pipelines.manifests import IncompleteRunError, TooManyFailuresError
from tfaploss.pipelines.options import emit_lag, image_processes, image_threads
from tfaploss.pipelines.plan import (
    SplitPlan,
    class_split_plan,
    contiguous_labels,
    dedupe_and_index,
    listed_splits,
)

__all__ = [  # what the jobs, tests and benchmarks import from here
    "LAST_TIMING", "STAGING", "IncompleteRunError", "SplitPlan", "TooManyFailuresError",
    "class_split_plan", "contiguous_labels", "dedupe_and_index", "describe_manifests",
    "listed_splits", "main_wrapper", "run_command", "run_job",
]

STAGING = ".incoming"
join = storage.join
# Images each local image process gets before Beam is imported: about 5 s of work, a few
# times what Beam's import and start-up take, but not the whole work list of a large job.
AHEAD_IMAGES_PER_PROCESS = 512


def _assemble(p, plans: list[SplitPlan], layouts: dict, chunks: list, per_batch: int,
              process, write) -> None:
    """The job's Beam graph: work-list byte ranges (``chunks``) and source splits ->
    ``process`` -> group by output file -> ``write``."""
    beam = console.import_beam_quietly()
    inputs = []
    if chunks:
        # The Reshuffle spreads a shard's batches over the workers instead of leaving
        # them fused to the worker that read the range.
        inputs.append(p
                      | "WorkLists" >> beam.Create(chunks)
                      | "ReadWorkLists" >> beam.FlatMap(L.read_work_chunk)
                      | "Spread" >> beam.Reshuffle())
    for plan in plans:
        if plan.source is not None:
            inputs.append(L.source_batches(p, plan, layouts[plan.name], per_batch))
    batches = inputs[0] if len(inputs) == 1 else tuple(inputs) | "Inputs" >> beam.Flatten()
    _ = (batches
         | "Process" >> beam.ParDo(process)
         | "GroupByFile" >> beam.GroupByKey()
         | "WriteFiles" >> beam.ParDo(write))


def run_command(job: str, parser, plan, argv: list[str] | None) -> dict[str, dict]:
    """Parse a job's command line and run it: ``plan(args)`` -> :func:`run_job`."""
    args, options = opts.parse_args(parser, argv)
    return run_job(job, plan(args), args, options)


def run_job(job: str, plans: list[SplitPlan], args, options) -> dict[str, dict]:
    """Run the Beam pipeline for all ``plans``, then publish every split; returns
    ``{split: manifest}``.

    Raises :class:`TooManyFailuresError` after publishing; with nothing published,
    ``LockHeldError`` (another job writes the folder), ``WorkerDiedError``,
    :class:`IncompleteRunError` or ``DiskFullError``.
    """
    started = getattr(args, "_started", None) or time.time()
    storage.makedirs(args.output_dir)
    with locks.exclusive(args.output_dir, "output folder",
                         log=lambda line: console.LOG.warning("%s", line)), \
            storage.disk_full_whole(join(args.output_dir, STAGING)):
        return _run_job(job, plans, args, options, started)


def _run_job(job: str, plans: list[SplitPlan], args, options, started: float):
    out = args.output_dir
    for plan in plans:
        storage.recover(join(out, plan.name))
        storage.check_owned(join(out, plan.name))
    stage = join(out, STAGING)
    storage.remove_tree(stage)  # what a killed run left; never the live dataset
    work = join(stage, "_work")
    storage.makedirs(work)
    root = None
    if getattr(args, "input_dir", None) and not storage.is_url(args.input_dir):
        root = os.path.realpath(args.input_dir)
    threads = image_threads(args, options)
    processes = image_processes(args, options)
    per_batch = args.images_per_batch or (opts.LOCAL_POOL_BATCH if processes > 1
                                          else opts.BATCH)
    layouts = {plan.name: L.layout(args, plan) for plan in plans}
    chunks = []
    for plan in plans:
        storage.makedirs(join(stage, plan.name))
        if plan.source is None:
            chunks += L.write_work_list(join(work, f"{plan.name}-batches.jsonl"), plan,
                                        layouts[plan.name], per_batch, root)
        console.log_plan(job, plan.name, plan.num_records_hint or len(plan.records),
                         len(plan.failures), len(plan.ignored))
    settings = {k: getattr(args, k) for k in ("max_side", "jpeg_quality", "min_side",
                                               "max_pixels")}
    report_path = join(work, "report.jsonl")
    parts_dir = join(work, "parts")
    storage.makedirs(parts_dir)
    pool_token = W.start_local_pool(processes) if processes > 1 else None
    beam_started = time.time()
    p = None
    try:
        if pool_token is not None:
            # Read back from the work lists (lazily, up to the limit): the tasks then hold
            # the records exactly as Beam hands them to ProcessBatchDoFn.
            W.submit_ahead(pool_token, (b for c in chunks for b in L.read_work_chunk(c)),
                           settings, root, parts_dir, AHEAD_IMAGES_PER_PROCESS * processes)
        beam = console.import_beam_quietly()
        from tfaploss.pipelines.steps import ProcessBatchDoFn, WriteOutputsDoFn

        with console.beam_quiet_on(atomic.DiskFullError), \
                beam.Pipeline(options=options.pipeline_options()) as p:
            _assemble(p, plans, layouts, chunks, per_batch,
                      ProcessBatchDoFn(settings, threads, root, parts_dir, pool_token,
                                       emit_lag=emit_lag(options)),
                      WriteOutputsDoFn(stage, report_path, args.class_chunk_size, threads,
                                       pool_token))
    except Exception as err:
        W.stop_local_pool(pool_token, forget=False)  # every worker reaped: exit codes
        deaths = W.worker_deaths(pool_token)
        if not deaths and not W.caused_by(err, BrokenProcessPool):
            raise
        storage.remove_tree(stage)  # the parts and shards of the unfinished run
        raise W.WorkerDiedError(_death_message(job, plans, out, deaths)) from None
    finally:
        _close_client(p)
        W.stop_local_pool(pool_token)

    report = [json.loads(line) for line in storage.read_text(report_path).splitlines()
              if line.strip()]
    lost = _unaccounted(plans, report)
    if lost:
        storage.remove_tree(stage)
        raise IncompleteRunError(
            f"{job}: the Beam runner returned results for {lost}: images were lost or "
            "counted twice between the steps, so nothing was published. The runner "
            "does not run the job's steps as Beam specifies (a DoFn's finish_bundle "
            "output dropped?); run it on another runner.")
    timing = console.batch_timing(report, started, beam_started)
    manifests = {plan.name: M.finish_split(job, plan, args,
                                           [r for r in report if r["split"] == plan.name],
                                           join(stage, plan.name)) for plan in plans}
    for plan in plans:  # only now is every split complete
        storage.publish(join(stage, plan.name), join(out, plan.name))
    storage.remove_tree(stage)
    console.finish_timing(timing, started, threads, processes)
    console.log_summary(job, manifests, LAST_TIMING)
    M.raise_if_too_many(manifests, args.max_failure_fraction)
    return manifests


def _unaccounted(plans: list[SplitPlan], report: list[dict]) -> str:
    """The work-list splits whose reports do not cover each record exactly once (``""``:
    none; source splits have no count to check)."""
    done: dict[str, int] = {}
    for row in report:
        done[row["split"]] = done.get(row["split"], 0) + row["n"]
    return "; ".join(f"{done.get(plan.name, 0)} of the {len(plan.records)} images of "
                     f"split {plan.name!r}" for plan in plans
                     if plan.source is None and done.get(plan.name, 0) != len(plan.records))


def _close_client(pipeline) -> None:
    """Close the ``dask.distributed`` Client Beam's DaskRunner leaves open (it keeps
    trying to reach a cluster that may be gone)."""
    client = getattr(getattr(pipeline, "result", None), "client", None)
    if client is not None and hasattr(client, "close"):
        client.close()


def _death_message(job: str, plans: list[SplitPlan], out: str, deaths: list[dict]) -> str:
    who = (W.describe_deaths(deaths) if deaths
           else "an image worker process died (its pool broke)")
    state = ", ".join(
        join(out, plan.name) + (" kept its previous version"
                                if storage.exists(join(out, plan.name)) else " was not created")
        for plan in plans)
    return (f"{job}: {who}. The job stopped and published nothing: "
            f"{state}. Rerun the same command to redo the whole job (every split: a job "
            "publishes its splits only once all are complete). If it dies on the same image "
            "again, that image needs more memory than a worker has: see `dmesg` for the "
            "kernel's OOM killer, lower --image_processes or --max_pixels, or remove the "
            "image.")
