"""The job runner every preprocessing job shares: plan -> Beam -> publish.

Plan in the driver, process in the workers. Each job reads its annotation files in the
driver (cheap: ids, paths and labels only), remaps labels, finds duplicate ids, rows
that point nowhere and names that would leave the input folder, and hands
:func:`run_job` one :class:`SplitPlan` per split. The runner then:

1. sorts each split by id and assigns record ``i`` of ``n`` to shard
   ``i * num_shards // n`` and class ``c`` of ``C`` to by-class shard
   ``c * num_class_shards // C``: the same input always gives the same files;
2. writes the work list as JSON lines of *batches* (``--images_per_batch`` images of one
   shard) into a staging folder, so neither the job graph nor Beam's per-element cost
   grows with the number of images;
3. on the local DirectRunner, forks one image process per core
   (:mod:`pipelines.image_workers`) before Beam starts its threads;
4. runs one Beam pipeline: :class:`ProcessBatchDoFn` hands each batch to the image
   processes (or, on other runners, to threads of the Beam worker), which decode,
   resize and re-encode the images and write their framed records to part files in the
   staging folder; only where each record lies travels through Beam, grouped by output
   file, and :class:`WriteOutputsDoFn` has the per-image shards (records in index
   order) and the by-class shards (label, chunk order) assembled from the parts
   (:mod:`pipelines.shard_writers`), side by side on the same workers, under temporary
   names renamed into place;
5. writes ``dead_letters.jsonl`` and ``manifest.json`` into each staged split and only
   then publishes it over the old one (:func:`pipelines.storage.publish`): a killed or
   failed run leaves the previous dataset as it was.

Anything that fails goes to the dead letters with its id, path and reason; the runner
raises :class:`TooManyFailuresError` (after publishing) when a split's failure fraction
exceeds ``--max_failure_fraction``.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pipelines import console, storage
from pipelines import image_workers as W
from pipelines import images as I
from pipelines import shard_writers as S
from pipelines import tf_example as X

beam = console.import_beam_quietly()

LOG = logging.getLogger("pipelines")

SCHEMA_VERSION = 1
STAGING = ".incoming"
join = storage.join


class TooManyFailuresError(RuntimeError):
    """A split's failure fraction exceeded ``--max_failure_fraction``.

    The outputs and manifests were written; ``manifests`` holds them.
    """

    def __init__(self, message: str, manifests: dict):
        super().__init__(message)
        self.manifests = manifests


# ------------------------------------------------------------------------------ planning


@dataclass
class SplitPlan:
    """What the driver decided for one split before any image is read.

    ``records``: work-list dicts with ``id``, ``path`` (full), ``relpath``, ``label``,
    ``super_label``, ``class_text``, optionally ``bbox`` and ``root`` (the real folder
    the file must resolve into; default: ``--input_dir``); ``failures``: dead letters
    found while planning; ``ignored``: ``{"path", "reason"}`` of files deliberately
    left out; ``label_map`` / ``super_label_map``: label -> dataset name; ``extra``:
    more manifest entries; ``files``: ``{name: text}`` written into the split folder
    with the records; ``by_class``: whether to write the per-class layout (``None``:
    decided by ``--by_class``); ``source``: instead of a work list, a function
    ``(pipeline, step_prefix) -> PCollection`` of records carrying their image bytes
    under ``"_bytes"`` (TFDS), with ``num_records_hint`` records expected.
    """

    name: str
    records: list[dict]
    failures: list[dict] = field(default_factory=list)
    label_map: dict[int, str] = field(default_factory=dict)
    super_label_map: dict[int, str] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    by_class: bool | None = None
    source: Callable | None = None
    num_records_hint: int | None = None
    ignored: list[dict] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)


dead_letter = I.dead_letter


def dedupe_and_index(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """Sort records by id, set ``index``; repeated ids and names that would leave the
    input folder (``..``, absolute paths) go to the dead letters."""
    seen: dict[str, dict] = {}
    failures = []
    for r in records:
        why = I.safe_relpath(r.get("relpath", ""))
        if why is not None:
            failures.append(dead_letter(r, I.UNSAFE_PATH, f"{r.get('relpath')!r}: {why}"))
        elif r["id"] in seen:
            failures.append(dead_letter(
                r, I.DUPLICATE_ID, f"id already used by {seen[r['id']].get('relpath', '')}"))
        else:
            seen[r["id"]] = r
    kept = sorted(seen.values(), key=lambda r: r["id"])
    for i, r in enumerate(kept):
        r.setdefault("index", i)
    return kept, failures


def contiguous_labels(keys: Iterable, *, sort_key=None) -> dict:
    """Map the distinct ``keys`` (sorted) to ``0..C-1``."""
    return {k: i for i, k in enumerate(sorted(set(keys), key=sort_key))}


def shard_of(i: int, n: int, num_shards: int) -> int:
    """Shard of the ``i``-th of ``n`` sorted records: contiguous, balanced, fixed."""
    return i * num_shards // max(n, 1)


# ------------------------------------------------------------------------------- workers


def _fault_after_images() -> int:
    spec = os.environ.get(storage.FAULT_ENV, "")
    return int(spec.split(":", 1)[1]) if spec.startswith("images:") else 0


class _PooledDoFn(beam.DoFn):
    """A DoFn whose work runs on the image workers' pool: the local processes that
    ``pool_token`` names in this process, else ``threads`` threads of its own (none for
    one thread: the work then runs inline)."""

    def __init__(self, threads: int, pool_token: str | None):
        self.threads = max(1, threads)
        self.pool_token = pool_token

    def setup(self):
        self.processes = W.local_pool(self.pool_token)
        self.own_pool = None if self.processes else W.thread_pool(self.threads)
        self.pool = self.processes or self.own_pool

    def teardown(self):
        if getattr(self, "own_pool", None) is not None:
            self.own_pool.shutdown(wait=False)


class ProcessBatchDoFn(_PooledDoFn):
    """A batch of work-list records -> descriptions of the output files' contents.

    The image work runs in :mod:`pipelines.image_workers` (a pool of local processes
    when ``pool_token`` names one in this process, else ``threads`` threads), which
    writes the framed records into part files under ``parts_dir``. Every output is keyed
    by the file it belongs to:

    * ``(IMAGES, split, shard, num_shards)``: ``[(index, id, part, offset, length)]``;
    * ``(CLASSES, split, class_shard, num_class_shards)``: ``[(label, id, super, part,
      jpeg_offset, jpeg_length)]``, for splits with a by-class layout;
    * ``(REPORT,)``: one dict per batch with the counts per (label, super_label), the
      dead letters and the batch's wall-clock span.
    """

    def __init__(self, settings: dict, threads: int, root: str | None, parts_dir: str,
                 pool_token: str | None = None):
        super().__init__(threads, pool_token)
        self.settings = settings
        self.root = root
        self.parts_dir = parts_dir

    def setup(self):
        super().setup()
        self.task_images = W.PROCESS_TASK_IMAGES if self.processes else None
        self.fault_after = _fault_after_images()
        self.progress = console.Progress("images processed")

    def start_bundle(self):
        self.pending = collections.deque()

    def process(self, batch: dict):
        # Tasks are submitted as batches come and emitted two batches behind, so the
        # workers never wait for the slowest image of a batch before starting the next.
        records = batch["records"]
        size = self.task_images or max(1, math.ceil(len(records) / self.threads))
        tasks = [records[i:i + size] for i in range(0, len(records), size)]
        paths = [W.part_path(self.parts_dir, batch["split"], t) for t in tasks]
        futures = ([self.pool.submit(W.process_task, t, self.settings, self.root, path)
                    for t, path in zip(tasks, paths)] if self.pool is not None else None)
        self.pending.append((batch, tasks, paths, futures, time.time()))
        while len(self.pending) > 2:
            yield from self._emit(*self.pending.popleft())

    def finish_bundle(self):
        while self.pending:
            for out in self._emit(*self.pending.popleft()):
                yield _windowed(out)

    def _emit(self, batch: dict, tasks: list, paths: list, futures, t0: float):
        split = batch["split"]
        by_class = batch.get("num_class_shards")
        examples, dead, counts, classes = [], [], collections.Counter(), {}
        for i, (task, path) in enumerate(zip(tasks, paths)):
            results = (futures[i].result() if futures is not None
                       else W.process_task(task, self.settings, self.root, path))
            for r, res in zip(task, results):
                if isinstance(res, dict):
                    dead.append(res)
                    continue
                offset, length, jpeg_offset, jpeg_length = res
                label, sup = int(r.get("label", -1)), int(r.get("super_label", -1))
                examples.append((int(r["index"]), r["id"], path, offset, length))
                counts[(label, sup)] += 1
                if by_class and label >= 0:
                    cs = shard_of(label, batch["num_labels"], batch["num_class_shards"])
                    classes.setdefault(cs, []).append(
                        (label, r["id"], sup, path, jpeg_offset, jpeg_length))
        if examples:
            yield (IMAGES, split, batch["shard"], batch["num_shards"]), examples
        for cs, items in sorted(classes.items()):
            yield (CLASSES, split, cs, batch["num_class_shards"]), items
        n = len(batch["records"])
        yield (REPORT,), {
            "split": split, "counts": sorted([k[0], k[1], c] for k, c in counts.items()),
            "dead": dead, "n": n, "t0": t0, "t1": time.time()}
        self.progress.add(n)
        if self.fault_after and self.progress.done >= self.fault_after:
            storage.fault_point(os.environ[storage.FAULT_ENV])


IMAGES, CLASSES, REPORT = "images", "classes", "report"


def _windowed(value):
    from apache_beam.transforms.window import GlobalWindows

    return GlobalWindows.windowed_value(value)


class WriteOutputsDoFn(_PooledDoFn):
    """``(key, [values])`` from :class:`ProcessBatchDoFn`, grouped -> the split's files.

    The TFRecord files are assembled by :mod:`pipelines.shard_writers` on the same pool
    as the image work, so they are written side by side; the report (one JSON line per
    batch) goes to ``report_path``. Yields ``(kind, split, file name, records)``.
    """

    def __init__(self, stage: str, report_path: str, chunk_size: int, threads: int,
                 pool_token: str | None = None):
        super().__init__(threads, pool_token)
        self.stage = stage
        self.report_path = report_path
        self.chunk_size = chunk_size

    def start_bundle(self):
        self.pending = []

    def process(self, keyed):
        key, groups = keyed
        if key[0] == REPORT:
            storage.write_atomic(self.report_path, _to_json_lines(groups))
            return
        kind, split, shard, num_shards = key
        items = [t for group in groups for t in group]
        if kind == IMAGES:
            name = f"images-{shard:05d}-of-{num_shards:05d}.tfrecord"
            call = (S.write_image_shard, join(self.stage, split, name), items)
        else:
            name = f"classes-{shard:05d}-of-{num_shards:05d}.tfrecord"
            call = (S.write_class_shard, join(self.stage, split, "by_class", name), items,
                    self.chunk_size)
        if self.pool is None:
            yield kind, split, name, call[0](*call[1:])
        else:
            self.pending.append(((kind, split, name), self.pool.submit(*call)))

    def finish_bundle(self):
        for out, future in self.pending:
            yield _windowed((*out, future.result()))


# ------------------------------------------------------------------------------- running


def _num_shards(args, n: int) -> int:
    if args.num_shards:
        return args.num_shards
    return max(1, math.ceil(n / args.records_per_shard))


def _wants_by_class(args, plan: SplitPlan) -> bool:
    if plan.by_class is not None:
        return plan.by_class
    return args.by_class == "all" or (args.by_class == "train" and plan.name == "train")


def _to_json_lines(rows: Iterable[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)


@dataclass
class _Layout:
    """Shard counts of one split."""

    num_shards: int
    num_labels: int
    num_class_shards: int  # 0: no by-class layout


def _layout(args, plan: SplitPlan) -> _Layout:
    n = plan.num_records_hint or len(plan.records)
    num_shards = max(1, min(_num_shards(args, n), n or 1))
    labels = [r.get("label", -1) for r in plan.records]
    num_labels = max(1, len(plan.label_map), *(x + 1 for x in labels))
    planned_classes = len({x for x in labels if x >= 0}) or len(plan.label_map) or 1
    class_shards = (max(1, min(num_shards, planned_classes))
                    if _wants_by_class(args, plan) else 0)
    return _Layout(num_shards, num_labels, class_shards)


def _batches(plan: SplitPlan, lay: _Layout, per_batch: int, root: str | None):
    n = len(plan.records)
    bounds = collections.defaultdict(list)
    for i in range(n):
        bounds[shard_of(i, n, lay.num_shards)].append(i)
    for shard, members in sorted(bounds.items()):
        lo, hi = members[0], members[-1] + 1
        for start in range(lo, hi, per_batch):
            recs = plan.records[start:min(start + per_batch, hi)]
            yield {"split": plan.name, "shard": shard, "num_shards": lay.num_shards,
                   "num_labels": lay.num_labels, "num_class_shards": lay.num_class_shards,
                   "records": [r if "root" in r or root is None else {**r, "root": root}
                               for r in recs]}


def _source_batches(p, plan: SplitPlan, lay: _Layout, per_batch: int):
    """Records from a source transform -> batches; shard by a hash of the id (the
    number of records is only known afterwards), ordered by index within a shard."""

    def to_batches(kv):
        shard, recs = kv
        recs = sorted(recs, key=lambda r: (r.get("index", 0), r["id"]))
        for start in range(0, len(recs), per_batch):
            yield {"split": plan.name, "shard": shard, "num_shards": lay.num_shards,
                   "num_labels": lay.num_labels, "num_class_shards": lay.num_class_shards,
                   "records": recs[start:start + per_batch]}

    s = plan.name
    return (plan.source(p, s)
            | f"{s}/KeyByShard" >> beam.Map(
                lambda r: (zlib.crc32(r["id"].encode("utf-8")) % lay.num_shards, r))
            | f"{s}/GroupByShard" >> beam.GroupByKey()
            | f"{s}/Batch" >> beam.FlatMap(to_batches))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _direct_mode(options) -> str | None:
    """The DirectRunner's running mode, or None for any other runner."""
    from apache_beam.options.pipeline_options import DirectOptions, StandardOptions

    runner = (options.view_as(StandardOptions).runner or "DirectRunner").lower()
    if "direct" not in runner:
        return None
    return options.view_as(DirectOptions).direct_running_mode or "in_memory"


def image_threads(args, options) -> int:
    """``--image_threads``, or the cores this worker may use when it is 0."""
    if getattr(args, "image_threads", 0):
        return args.image_threads
    mode = _direct_mode(options)
    if mode is None:
        return 2  # remote workers already run one process per core
    cpus = _cores()
    if mode == "multi_processing":
        from apache_beam.options.pipeline_options import DirectOptions

        workers = options.view_as(DirectOptions).direct_num_workers
        return max(1, cpus // max(1, workers or cpus))
    return cpus


def image_processes(args, options) -> int:
    """How many forked processes do the image work: ``--image_processes``, or one per
    core when it is 0, on the local DirectRunner in its in-memory mode where ``fork``
    exists; 1 (threads in the Beam worker) everywhere else."""
    if _direct_mode(options) != "in_memory" or not W.can_fork():
        return 1
    return getattr(args, "image_processes", 0) or _cores()


def run_job(job: str, plans: list[SplitPlan], args, options) -> dict[str, dict]:
    """Run the Beam pipeline for all ``plans``, then publish every split.

    Returns ``{split: manifest}``. Raises :class:`TooManyFailuresError` (after
    publishing) when a split's failure fraction exceeds ``args.max_failure_fraction``.
    """
    started = getattr(args, "_started", None) or time.time()
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
    per_batch = args.images_per_batch
    layouts = {plan.name: _layout(args, plan) for plan in plans}
    total = 0
    for plan in plans:
        storage.makedirs(join(stage, plan.name))
        if plan.source is None:
            storage.write_atomic(join(work, f"{plan.name}-batches.jsonl"), _to_json_lines(
                _batches(plan, layouts[plan.name], per_batch, root)))
        total += plan.num_records_hint or len(plan.records)
        LOG.info("%s/%s: %d images to process, %d rejected and %d ignored while planning",
                 job, plan.name, plan.num_records_hint or len(plan.records),
                 len(plan.failures), len(plan.ignored))
    threads = image_threads(args, options)
    processes = image_processes(args, options)
    settings = {k: getattr(args, k) for k in ("max_side", "jpeg_quality", "min_side",
                                               "max_pixels")}
    report_path = join(work, "report.jsonl")
    parts_dir = join(work, "parts")
    storage.makedirs(parts_dir)
    pool_token = W.start_local_pool(processes) if processes > 1 else None
    beam_started = time.time()
    try:
        with beam.Pipeline(options=options) as p:
            inputs = []
            if any(plan.source is None for plan in plans):
                inputs.append(p
                              | "ReadWorkLists" >> beam.io.ReadFromText(
                                  join(work, "*-batches.jsonl"))
                              | "Parse" >> beam.Map(json.loads))
            for plan in plans:
                if plan.source is not None:
                    inputs.append(_source_batches(p, plan, layouts[plan.name], per_batch))
            batches = (inputs[0] if len(inputs) == 1
                       else tuple(inputs) | "Inputs" >> beam.Flatten())
            _ = (batches
                 | "Process" >> beam.ParDo(
                     ProcessBatchDoFn(settings, threads, root, parts_dir, pool_token))
                 | "GroupByFile" >> beam.GroupByKey()
                 | "WriteFiles" >> beam.ParDo(WriteOutputsDoFn(
                     stage, report_path, args.class_chunk_size, threads, pool_token)))
    finally:
        W.stop_local_pool(pool_token)

    report = [json.loads(line) for line in storage.read_text(report_path).splitlines()
              if line.strip()]
    timing = _timing(report, started, beam_started)
    manifests, too_many = {}, []
    for plan in plans:
        rows = [r for r in report if r["split"] == plan.name]
        manifests[plan.name] = _finish_split(job, plan, args, rows, join(stage, plan.name))
    for plan in plans:  # only now is every split complete
        storage.publish(join(stage, plan.name), join(out, plan.name))
    storage.remove_tree(stage)
    timing["seconds"] = time.time() - started
    # Grouping, writing the shards and by-class records, manifests and publish.
    timing["finish_seconds"] = time.time() - timing.pop("_last_batch_end", started)
    timing["images_per_second"] = timing["images"] / max(timing["seconds"], 1e-9)
    for plan in plans:
        m = manifests[plan.name]
        LOG.info("%s/%s: %d images of %d classes in %d shards, %d failures, %d ignored",
                 job, plan.name, m["num_images"], m["num_classes"], len(m["shards"]),
                 m["num_failures"], m.get("num_ignored_files", 0))
        if m["failure_fraction"] > args.max_failure_fraction:
            too_many.append(f"{plan.name}: {m['num_failures']} of {m['num_inputs']} inputs "
                            f"failed ({m['failure_fraction']:.2%})")
    steady = (f", then {timing['steady_images_per_second']:.1f} images/s"
              if timing["steady_images_per_second"] else "")
    workers = (f"{processes} image processes" if processes > 1
               else f"{threads} image threads per worker")
    LOG.info("%s: %d images in %.1f s (%.1f images/s; start-up %.1f s%s; %s)", job,
             timing["images"], timing["seconds"], timing["images_per_second"],
             timing["startup_seconds"], steady, workers)
    LAST_TIMING.clear()
    LAST_TIMING.update(timing, threads=threads, processes=processes)
    if too_many:
        raise TooManyFailuresError(
            "more failures than --max_failure_fraction="
            f"{args.max_failure_fraction}: " + "; ".join(too_many)
            + ". See dead_letters.jsonl in each split folder.", manifests)
    return manifests


LAST_TIMING: dict = {}
"""Wall-clock figures of the last :func:`run_job` in this process (for benchmarks):
``images``, ``seconds``, ``images_per_second``, ``startup_seconds`` (job start to the
first image work), ``steady_images_per_second`` (after the first batch finished),
``finish_seconds`` (last batch to published), ``planning_seconds``, ``threads``."""


def _timing(report: list[dict], started: float, beam_started: float) -> dict:
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


def _finish_split(job: str, plan: SplitPlan, args, report: list[dict], split_dir: str) -> dict:
    counts, supers = collections.Counter(), {}
    dead = list(plan.failures)
    for r in report:
        for label, sup, n in r["counts"]:
            counts[int(label)] += int(n)
            supers[int(label)] = int(sup)
        dead.extend(r["dead"])
    dead.sort(key=lambda d: (d["reason"], d["id"], d["path"]))
    storage.write_atomic(join(split_dir, "dead_letters.jsonl"), _to_json_lines(dead))
    ignored = sorted(plan.ignored, key=lambda d: (d["path"], d["reason"]))
    if ignored:
        storage.write_atomic(join(split_dir, "ignored_files.jsonl"), _to_json_lines(ignored))
    for name, text in plan.files.items():
        storage.write_atomic(join(split_dir, name), text)
    shards = [os.path.basename(p) for p in storage.glob(join(split_dir, "images-*.tfrecord"))]
    by_class = [os.path.basename(p)
                for p in storage.glob(join(split_dir, "by_class", "classes-*.tfrecord"))]
    num_images = sum(counts.values())
    num_inputs = num_images + len(dead)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "job": f"pipelines.{job}",
        "split": plan.name,
        "num_images": num_images,
        "num_classes": len([c for c, n in counts.items() if n > 0 and c >= 0]),
        "num_inputs": num_inputs,
        "num_failures": len(dead),
        "failure_fraction": (len(dead) / num_inputs) if num_inputs else 0.0,
        "failures_by_reason": dict(sorted(collections.Counter(d["reason"] for d in dead).items())),
        "class_counts": {str(k): counts[k] for k in sorted(counts)},
        "label_map": {str(k): v for k, v in sorted(plan.label_map.items())},
        "super_label_map": {str(k): v for k, v in sorted(plan.super_label_map.items())},
        "class_super_labels": ({str(k): supers[k] for k in sorted(supers)}
                               if any(v >= 0 for v in supers.values()) else {}),
        "shards": shards,
        "by_class": ({"shards": [f"by_class/{b}" for b in by_class],
                      "chunk_size": args.class_chunk_size} if by_class else None),
        "dead_letters": "dead_letters.jsonl",
        "features": {k: v[0] for k, v in X.IMAGE_FEATURES.items()},
        "options": {k: getattr(args, k) for k in sorted(vars(args)) if not k.startswith("_")},
        **plan.extra,
    }
    manifest.update({"num_ignored_files": len(ignored), "ignored_files": ignored[:1000],
                     "ignored_list": "ignored_files.jsonl" if ignored else None})
    storage.write_json(join(split_dir, "manifest.json"), manifest, indent=1, sort_keys=True)
    return manifest


def describe_manifests(manifests: dict[str, dict]) -> str:
    """One line per split of a job's ``{split: manifest}`` result."""
    return "\n".join(
        f"{split}: {m['num_images']} images, {m['num_classes']} classes, "
        f"{m['num_failures']} failures, {len(m['shards'])} shards"
        for split, m in manifests.items()
    )


def main_wrapper(run_fn, argv: list[str] | None = None, describe=describe_manifests) -> int:
    """Shared ``__main__``: quiet logging, exit 1 on too many failures, 2 on bad arguments.

    ``describe`` turns what ``run_fn`` returned into the summary printed on success.
    """
    console.configure(console.wants_verbose(argv))
    try:
        result = run_fn(argv)
    except TooManyFailuresError as e:
        LOG.error("%s", e)
        return 1
    except (ValueError, FileNotFoundError) as e:
        LOG.error("error: %s", e)
        return 2
    print(describe(result))
    sys.stdout.flush()
    return 0
