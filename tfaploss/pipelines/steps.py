"""The two Beam steps of a preprocessing job: :class:`ProcessBatchDoFn` (work-list
batches -> part files, keyed by output file) and :class:`WriteOutputsDoFn` (the shards,
assembled from the parts by :mod:`tfaploss.pipelines.shard_writers`)."""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor

from tfaploss.durable import faults
from tfaploss.pipelines import console, storage
from tfaploss.pipelines import image_workers as W
from tfaploss.pipelines import shard_writers as S
from tfaploss.pipelines.plan import shard_of

beam = console.import_beam_quietly()

IMAGES, CLASSES, REPORT = "images", "classes", "report"


class _PooledDoFn(beam.DoFn):
    """A DoFn whose work runs on the local processes ``pool_token`` names in this
    process, else on ``threads`` threads of its own (one: inline)."""

    def __init__(self, threads: int, pool_token: str | None):
        self.threads = max(1, threads)
        self.pool_token = pool_token

    def setup(self):
        self.processes = W.local_pool(self.pool_token)
        self.own_pool = (ThreadPoolExecutor(self.threads)
                         if not self.processes and self.threads > 1 else None)
        self.pool = self.processes or self.own_pool

    def teardown(self):
        if getattr(self, "own_pool", None) is not None:
            self.own_pool.shutdown(wait=False)


class ProcessBatchDoFn(_PooledDoFn):
    """A batch of work-list records -> part files under ``parts_dir``, and per output
    file (the key) what it holds:

    * ``(IMAGES, split, shard, num_shards)``: ``[(index, id, part, offset, length)]``;
    * ``(CLASSES, split, class_shard, num_class_shards)``: ``[(label, id, super, part,
      jpeg_offset, jpeg_length)]``, for splits with a by-class layout;
    * ``(REPORT,)``: one dict per batch with the counts per (label, super_label), the
      dead letters and the batch's wall-clock span.

    Up to ``emit_lag`` batches are held back, the last emitted from ``finish_bundle``.
    """

    def __init__(self, settings: dict, threads: int, root: str | None, parts_dir: str,
                 pool_token: str | None = None, emit_lag: int = 2):
        super().__init__(threads, pool_token)
        self.settings = settings
        self.root = root
        self.parts_dir = parts_dir
        self.emit_lag = emit_lag

    def setup(self):
        super().setup()
        self.workers = W.local_pool_size(self.pool_token) if self.processes else self.threads
        self.task_images = W.PROCESS_TASK_IMAGES if self.processes else 1
        self.fault_after = faults.threshold("images")  # crash tests only; 0: never
        self.progress = console.Progress("images processed")

    def start_bundle(self):
        self.pending = collections.deque()

    def process(self, batch: dict):
        # Emitted emit_lag batches behind: the workers never wait for a batch's slowest image.
        tasks = W.cut_tasks(batch["records"], self.workers, self.task_images)
        paths = [W.part_path(self.parts_dir, batch["split"], t) for t in tasks]
        where = {k: batch[k] for k in ("split", "shard", "num_shards")}
        futures, t0 = None, time.time()
        if self.pool is not None:
            # A task the job submitted before Beam started (W.submit_ahead) is taken over.
            ahead = [W.claim_ahead(self.pool_token, path) for path in paths]
            futures = [a[0] if a else self.pool.submit(W.process_task, t, self.settings,
                                                       self.root, path, where)
                       for a, t, path in zip(ahead, tasks, paths)]
            t0 = min([a[1] for a in ahead if a] + [t0])
        self.pending.append((batch, tasks, paths, futures, t0))
        while len(self.pending) > self.emit_lag:
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
        if self.fault_after:
            faults.count_reached("images", self.fault_after, self.progress.done)


def _windowed(value):
    from apache_beam.transforms.window import GlobalWindows

    return GlobalWindows.windowed_value(value)


class WriteOutputsDoFn(_PooledDoFn):
    """``(key, [values])`` from :class:`ProcessBatchDoFn`, grouped -> the split's files,
    written on the image work's pool; the report goes to ``report_path``. Yields
    ``(kind, split, file name, records)``."""

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
            storage.write_atomic(self.report_path, storage.json_lines(groups), fault="report")
            return
        kind, split, shard, num_shards = key
        items = [t for group in groups for t in group]
        name = f"{kind}-{shard:05d}-of-{num_shards:05d}.tfrecord"  # images- or classes-
        if kind == IMAGES:
            call = (S.write_image_shard, storage.join(self.stage, split, name), items)
        else:
            call = (S.write_class_shard, storage.join(self.stage, split, "by_class", name),
                    items, self.chunk_size)
        if self.pool is None:
            yield kind, split, name, call[0](*call[1:])
        else:
            where = {"split": split, "shard": shard, "num_shards": num_shards, "file": name}
            self.pending.append(((kind, split, name), self.pool.submit(W.noted, where, *call)))

    def finish_bundle(self):
        for out, future in self.pending:
            yield _windowed((*out, future.result()))
