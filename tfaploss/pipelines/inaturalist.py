"""iNaturalist-2018 with the metric-learning split of Brown et al. (Smooth-AP) -> TFRecords.

Reads the split lists (docs/pipelines.md). Expected: train 325,846 images / 5,690
classes, test 136,093 / 2,452.

    python -m tfaploss.pipelines.inaturalist --input_dir iNat2018 --output_dir out/inat
"""

from __future__ import annotations

import sys

from tfaploss.pipelines import images as I
from tfaploss.pipelines import options as opts
from tfaploss.pipelines import runner as R
from tfaploss.pipelines import storage


def parser():
    return opts.build_parser(__doc__.splitlines()[0], (
        ("--train_list", str, "Inaturalist_train_set1.txt",
         "train split list, relative to --input_dir"),
        ("--test_list", str, "Inaturalist_test_set1.txt",
         "test split list, relative to --input_dir"),
        ("--splits", str, "train,test", "splits to write: train, test")))


def read_list(path: str) -> tuple[list[dict], list[dict]]:
    if not storage.exists(path):
        raise FileNotFoundError(f"iNaturalist split list not found: {path}")
    lines = storage.read_text(path).splitlines()
    rows, bad = [], []
    for lineno, line in enumerate(lines, start=1):
        rel = line.strip()
        if not rel:
            continue
        parts = rel.split("/")
        if len(parts) < 3 or not parts[-2].isdigit():
            bad.append({"id": rel, "path": rel, "reason": I.BAD_ANNOTATION,
                        "detail": f"{path}:{lineno}: expected <supercategory>/<category id>/"
                                  "<file>.jpg at the end of the path"})
            continue
        rows.append({"id": rel, "relpath": rel, "class_id": int(parts[-2]),
                     "super_id": parts[-3], "super_name": parts[-3]})
    return rows, bad


def plan(args) -> list[R.SplitPlan]:
    lists = {"train": args.train_list, "test": args.test_list}
    return [R.class_split_plan(split, *read_list(storage.join(args.input_dir, lists[split])),
                               args.input_dir)
            for split in R.listed_splits(args.splits, lists)]


def run(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the job in-process; returns ``{split: manifest}``."""
    return R.run_command("inaturalist", parser(), plan, argv)


if __name__ == "__main__":
    sys.exit(R.main_wrapper(run))
