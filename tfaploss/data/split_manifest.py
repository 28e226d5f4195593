"""What a split's ``manifest.json`` says about its records: the classes a label may
be, and the job that wrote it and the command that writes it again (for the messages
of :mod:`tfaploss.data.integrity`). Plain ``json``, no TensorFlow: the jobs import it.
"""

from __future__ import annotations

import json
import os
import shlex

# Every job writes its output folder's manifest under this name, last: a folder holding
# one is a job's finished output (a split, or the embedding job's embeddings).
MANIFEST = "manifest.json"


def is_job_output(folder: str) -> bool:
    """Whether the local ``folder`` holds a job's ``manifest.json``."""
    return os.path.isfile(os.path.join(folder, MANIFEST))


def read_manifest(split_dir: str) -> dict | None:
    """The local split folder's ``manifest.json``, or None."""
    if not is_job_output(split_dir):
        return None
    path = os.path.join(split_dir, MANIFEST)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def manifest_classes(manifest: dict | None) -> set[int] | None:
    """The labels a record may carry (the manifest's class list), or None if unknown."""
    if not manifest:
        return None
    keys = set((manifest.get("class_counts") or {}).keys())
    keys |= set((manifest.get("label_map") or {}).keys())
    labels = {int(k) for k in keys if str(k).lstrip("-").isdigit() and int(k) >= 0}
    return labels or None


def label_table(manifest: dict | None) -> list[bool] | None:
    """``table[label]`` is True for a label of the manifest's class list (for the
    in-graph check of :mod:`tfaploss.data.records`); None when the manifest has none."""
    classes = manifest_classes(manifest)
    if not classes:
        return None
    table = [False] * (max(classes) + 1)
    for c in classes:
        table[c] = True
    return table


def job_module(manifest: dict) -> str:
    """The module that runs the manifest's job. Splits written before the jobs moved
    into the ``tfaploss`` namespace name them ``pipelines.<job>``."""
    job = manifest.get("job") or "tfaploss.pipelines.<job>"
    return f"tfaploss.{job}" if job.startswith("pipelines.") else job


def rebuild_command(manifest: dict) -> str:
    """``python -m tfaploss.pipelines.<job> --flag value ...`` from the manifest's options (the
    options left at their off value are left out)."""
    words = ["python", "-m", job_module(manifest)]
    for key, value in sorted((manifest.get("options") or {}).items()):
        if value is None or value is False or value == "" or key == "verbose":
            continue
        words.append(f"--{key}")
        if value is not True:
            words.append(str(value) if not isinstance(value, (list, dict))
                         else json.dumps(value))
    return " ".join(shlex.quote(w) for w in words)


def describe_source(manifest: dict | None, split_dir: str) -> str:
    """``written by tfaploss.pipelines.folder (split train)`` and the command that writes it
    again, from the manifest's ``job``, ``split`` and ``options``."""
    if not manifest or not manifest.get("job"):
        return ("no manifest.json names the job that wrote it; write the split again "
                "with the tfaploss.pipelines job that made it")
    job, split = job_module(manifest), manifest.get("split", os.path.basename(split_dir))
    return f"written by {job} (split {split}); rebuild it: {rebuild_command(manifest)}"
