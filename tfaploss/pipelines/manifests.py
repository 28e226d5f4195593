"""The bookkeeping of a finished split: :func:`finish_split` writes its dead letters,
ignored files and manifest (last) before the runner publishes it;
:func:`raise_if_too_many` checks ``--max_failure_fraction`` after."""

from __future__ import annotations

import collections
import os

from tfaploss.data.framing import manifest_checksums
from tfaploss.data.split_manifest import MANIFEST
from tfaploss.pipelines import storage
from tfaploss.pipelines import tf_example as X
from tfaploss.pipelines.plan import SplitPlan

SCHEMA_VERSION = 1
DEAD_LETTERS = "dead_letters.jsonl"
IGNORED_FILES = "ignored_files.jsonl"


class TooManyFailuresError(RuntimeError):
    """A split's failure fraction exceeded ``--max_failure_fraction``; the outputs were
    written, ``manifests`` holds their manifests."""

    def __init__(self, message: str, manifests: dict):
        super().__init__(message)
        self.manifests = manifests


class IncompleteRunError(RuntimeError):
    """The pipeline finished without exactly one result for each planned image of a
    split (a runner lost or repeated some); nothing was published."""


def finish_split(job: str, plan: SplitPlan, args, report: list[dict],
                 split_dir: str) -> dict:
    """Write a staged split's dead letters, ignored files, extra files and manifest from
    the workers' ``report`` rows; returns the manifest."""
    join = storage.join
    counts, supers = collections.Counter(), {}
    dead = list(plan.failures)
    for r in report:
        for label, sup, n in r["counts"]:
            counts[int(label)] += int(n)
            supers[int(label)] = int(sup)
        dead.extend(r["dead"])
    dead.sort(key=lambda d: (d["reason"], d["id"], d["path"]))
    storage.write_atomic(join(split_dir, DEAD_LETTERS), storage.json_lines(dead),
                         fault="manifest")
    ignored = sorted(plan.ignored, key=lambda d: (d["path"], d["reason"]))
    if ignored:
        storage.write_atomic(join(split_dir, IGNORED_FILES), storage.json_lines(ignored),
                             fault="manifest")
    for name, text in plan.files.items():
        storage.write_atomic(join(split_dir, name), text, fault="manifest")
    shards = [os.path.basename(p) for p in storage.glob(join(split_dir, "images-*.tfrecord"))]
    by_class = [os.path.basename(p)
                for p in storage.glob(join(split_dir, "by_class", "classes-*.tfrecord"))]
    num_images = sum(counts.values())
    num_inputs = num_images + len(dead)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "job": f"tfaploss.pipelines.{job}",
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
        "dead_letters": DEAD_LETTERS,
        # For `tfaploss verify` and `tfaploss train`'s start-up check (object stores
        # have their own).
        "checksums": (None if "://" in split_dir else manifest_checksums(
            split_dir, shards + [f"by_class/{b}" for b in by_class])),
        "features": {k: v[0] for k, v in X.IMAGE_FEATURES.items()},
        "options": {k: getattr(args, k) for k in sorted(vars(args)) if not k.startswith("_")},
        **plan.extra,
    }
    manifest.update({"num_ignored_files": len(ignored), "ignored_files": ignored[:1000],
                     "ignored_list": IGNORED_FILES if ignored else None})
    storage.write_json(join(split_dir, MANIFEST), manifest, indent=1, sort_keys=True,
                       fault="manifest")
    return manifest


def failure_report(manifests: dict[str, dict], max_failure_fraction: float) -> list[str]:
    """One line per split whose failure fraction exceeds ``max_failure_fraction``."""
    return [f"{split}: {m['num_failures']} of {m['num_inputs']} inputs failed "
            f"({m['failure_fraction']:.2%})"
            for split, m in manifests.items() if m["failure_fraction"] > max_failure_fraction]


def raise_if_too_many(manifests: dict[str, dict], max_failure_fraction: float) -> None:
    """:class:`TooManyFailuresError` naming the splits of :func:`failure_report`."""
    too_many = failure_report(manifests, max_failure_fraction)
    if too_many:
        raise TooManyFailuresError(
            "more failures than --max_failure_fraction="
            f"{max_failure_fraction}: " + "; ".join(too_many)
            + ". See dead_letters.jsonl in each split folder.", manifests)
