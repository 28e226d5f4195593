"""Stanford Online Products (Song et al., CVPR'16) -> TFRecords.

Reads ``Ebay_train.txt`` / ``Ebay_test.txt`` (docs/pipelines.md). Expected: train
59,551 images / 11,318 classes, test 60,502 / 11,316.

    python -m tfaploss.pipelines.sop --input_dir Stanford_Online_Products --output_dir out/sop
"""

from __future__ import annotations

import sys

from tfaploss.pipelines import images as I
from tfaploss.pipelines import options as opts
from tfaploss.pipelines import runner as R
from tfaploss.pipelines import storage

SPLIT_FILES = {"train": "Ebay_train.txt", "test": "Ebay_test.txt"}


def parser():
    return opts.build_parser(__doc__.splitlines()[0], (
        ("--splits", str, "train,test", "splits to write: train, test"),))


def read_annotations(path: str) -> tuple[list[dict], list[dict]]:
    """Rows of an Ebay_*.txt file as dicts, and dead letters for malformed rows."""
    if not storage.exists(path):
        raise FileNotFoundError(f"SOP annotation file not found: {path}")
    rows, bad = [], []
    lines = storage.read_text(path).splitlines()
    header = lines[0].split() if lines else []
    if header != ["image_id", "class_id", "super_class_id", "path"]:
        raise ValueError(f"{path}: expected header 'image_id class_id super_class_id path', "
                         f"got {' '.join(header)!r}")
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 4:
                raise ValueError(f"{len(parts)} fields instead of 4")
            image_id, class_id, super_id = parts[0], int(parts[1]), int(parts[2])
        except ValueError as e:
            bad.append({"id": f"line {lineno}", "path": line.strip()[:200],
                        "reason": I.BAD_ANNOTATION, "detail": f"{path}:{lineno}: {e}"})
            continue
        rows.append({"id": image_id, "class_id": class_id, "super_id": super_id,
                     "relpath": parts[3], "super_name": parts[3].split("/")[0]})
    return rows, bad


def plan(args) -> list[R.SplitPlan]:
    return [R.class_split_plan(split, *read_annotations(
                storage.join(args.input_dir, SPLIT_FILES[split])), args.input_dir)
            for split in R.listed_splits(args.splits, SPLIT_FILES)]


def run(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the job in-process; returns ``{split: manifest}``."""
    return R.run_command("sop", parser(), plan, argv)


if __name__ == "__main__":
    sys.exit(R.main_wrapper(run))
