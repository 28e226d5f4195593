"""What a job decides in the driver before any image is read: one :class:`SplitPlan`
per split, and the helpers the jobs build them with."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tfaploss.pipelines import images as I
from tfaploss.pipelines import storage


@dataclass
class SplitPlan:
    """What the driver decided for one split before any image is read.

    ``records``: work-list dicts (``id``, ``path``, ``relpath``, ``label``,
    ``super_label``, ``class_text``, optionally ``bbox`` and ``root``, the real folder
    the file must resolve into); ``failures``: dead letters found while planning;
    ``ignored``: ``{"path", "reason"}``; ``extra``: more manifest entries; ``files``:
    ``{name: text}`` written with the records; ``by_class``: None lets ``--by_class``
    decide; ``source``: instead of a work list, ``(pipeline, step_prefix) ->
    PCollection`` of records with their bytes under ``"_bytes"`` (TFDS).
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


def dedupe_and_index(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """Sort records by id, set ``index``; repeated ids and names that would leave the
    input folder (``..``, absolute paths) go to the dead letters."""
    seen: dict[str, dict] = {}
    failures = []
    for r in records:
        why = I.safe_relpath(r.get("relpath", ""))
        if why is not None:
            failures.append(I.dead_letter(r, I.UNSAFE_PATH, f"{r.get('relpath')!r}: {why}"))
        elif r["id"] in seen:
            failures.append(I.dead_letter(
                r, I.DUPLICATE_ID, f"id already used by {seen[r['id']].get('relpath', '')}"))
        else:
            seen[r["id"]] = r
    kept = sorted(seen.values(), key=lambda r: r["id"])
    for i, r in enumerate(kept):
        r.setdefault("index", i)
    return kept, failures


def listed_splits(names: str, known) -> list[str]:
    """The comma-separated ``--splits``, each one of ``known``."""
    splits = [s.strip() for s in names.split(",") if s.strip()]
    for split in splits:
        if split not in known:
            raise ValueError(f"--splits: unknown split {split!r}; expected one or more "
                             f"of {list(known)}")
    return splits


def class_split_plan(split: str, rows: list[dict], failures: list[dict],
                     input_dir: str) -> SplitPlan:
    """The plan of a split listed image by image with a class and a super-class (SOP,
    iNaturalist): ``rows`` of ``id``, ``relpath``, ``class_id``, ``super_id``,
    ``super_name``; labels contiguous by sorted class id, super-labels by ``super_id``."""
    labels = contiguous_labels(r["class_id"] for r in rows)
    supers = contiguous_labels(r["super_id"] for r in rows)
    records = [{"id": r["id"], "path": storage.join(input_dir, r["relpath"]),
                "relpath": r["relpath"], "label": labels[r["class_id"]],
                "super_label": supers[r["super_id"]], "class_text": str(r["class_id"])}
               for r in rows]
    records, dups = dedupe_and_index(records)
    return SplitPlan(split, records, failures + dups,
                     label_map={v: str(k) for k, v in labels.items()},
                     super_label_map={supers[r["super_id"]]: r["super_name"] for r in rows})


def contiguous_labels(keys: Iterable) -> dict:
    """Map the distinct ``keys`` (sorted) to ``0..C-1``."""
    return {k: i for i, k in enumerate(sorted(set(keys)))}


def shard_of(i: int, n: int, num_shards: int) -> int:
    """Shard of the ``i``-th of ``n`` sorted records: contiguous, balanced, fixed."""
    return i * num_shards // max(n, 1)
