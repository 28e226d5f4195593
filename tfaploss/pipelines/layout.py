"""Where each record of a split goes (shard ``i * num_shards // n`` of the records
sorted by id), and the work list of batches the Beam pipeline reads by byte range
(docs/pipelines.md)."""

from __future__ import annotations

import collections
import itertools
import json
import math
import zlib
from dataclasses import asdict, dataclass

from tfaploss.pipelines import storage
from tfaploss.pipelines.plan import SplitPlan, shard_of


@dataclass
class Layout:
    """Shard counts of one split; each of its work-list batches carries them."""

    num_shards: int
    num_labels: int
    num_class_shards: int  # 0: no by-class layout


def num_shards(args, n: int) -> int:
    """``--num_shards``, else enough shards of ``--records_per_shard`` for ``n``."""
    if args.num_shards:
        return args.num_shards
    return max(1, math.ceil(n / args.records_per_shard))


def wants_by_class(args, plan: SplitPlan) -> bool:
    """Whether the split gets the per-class layout (the plan's say, else ``--by_class``)."""
    if plan.by_class is not None:
        return plan.by_class
    return args.by_class == "all" or (args.by_class == "train" and plan.name == "train")


def layout(args, plan: SplitPlan) -> Layout:
    """The shard counts of ``plan``'s split."""
    n = plan.num_records_hint or len(plan.records)
    shards = max(1, min(num_shards(args, n), n or 1))
    labels = [r.get("label", -1) for r in plan.records]
    num_labels = max(1, len(plan.label_map), *(x + 1 for x in labels))
    planned_classes = len({x for x in labels if x >= 0}) or len(plan.label_map) or 1
    class_shards = (max(1, min(shards, planned_classes))
                    if wants_by_class(args, plan) else 0)
    return Layout(shards, num_labels, class_shards)


def batches(plan: SplitPlan, lay: Layout, per_batch: int, root: str | None):
    """The work list of a planned split: batches of at most ``per_batch`` records of one
    shard (``root``: the real folder the records must resolve into)."""
    n, counts = len(plan.records), asdict(lay)
    bounds = collections.defaultdict(list)
    for i in range(n):
        bounds[shard_of(i, n, lay.num_shards)].append(i)
    for shard, members in sorted(bounds.items()):
        lo, hi = members[0], members[-1] + 1
        for start in range(lo, hi, per_batch):
            recs = plan.records[start:min(start + per_batch, hi)]
            yield {"split": plan.name, "shard": shard, **counts,
                   "records": [r if "root" in r or root is None else {**r, "root": root}
                               for r in recs]}


def write_work_list(path: str, plan: SplitPlan, lay: Layout, per_batch: int,
                    root: str | None) -> list[tuple[str, int, int]]:
    """Write the work list of a planned split to ``path``; returns the byte range
    ``(path, offset, length)`` of each shard's batches, in shard order."""
    pieces, chunks, offset = [], [], 0
    for _, group in itertools.groupby(batches(plan, lay, per_batch, root),
                                      key=lambda b: b["shard"]):
        text = storage.json_lines(group).encode("utf-8")
        pieces.append(text)
        chunks.append((path, offset, len(text)))
        offset += len(text)
    storage.write_atomic(path, b"".join(pieces), fault="work_list")
    return chunks


def read_work_chunk(chunk: tuple[str, int, int]):
    """The batches of one ``(path, offset, length)`` of :func:`write_work_list`."""
    path, offset, length = chunk
    for line in storage.read_range(path, offset, length).decode("utf-8").splitlines():
        if line.strip():
            yield json.loads(line)


def source_batches(p, plan: SplitPlan, lay: Layout, per_batch: int):
    """Records from a source transform -> batches, sharded by a hash of the id (their
    number is only known afterwards)."""
    import apache_beam as beam

    counts = asdict(lay)

    def to_batches(kv):
        shard, recs = kv
        recs = sorted(recs, key=lambda r: (r.get("index", 0), r["id"]))
        for start in range(0, len(recs), per_batch):
            yield {"split": plan.name, "shard": shard, **counts,
                   "records": recs[start:start + per_batch]}

    s = plan.name
    return (plan.source(p, s)
            | f"{s}/KeyByShard" >> beam.Map(
                lambda r: (zlib.crc32(r["id"].encode("utf-8")) % lay.num_shards, r))
            | f"{s}/GroupByShard" >> beam.GroupByKey()
            | f"{s}/Batch" >> beam.FlatMap(to_batches))
