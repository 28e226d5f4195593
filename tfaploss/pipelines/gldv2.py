"""Google Landmarks Dataset v2 (Weyand et al., CVPR'20) -> TFRecords.

``--subset train`` (the training set) or ``retrieval`` (index and test, with
``test/ground_truth.json``); the files read: docs/pipelines.md.

    python -m tfaploss.pipelines.gldv2 --input_dir gldv2 --output_dir out/gldv2 \\
        --train_csv train_clean.csv --max_side 512 --runner DataflowRunner ...
"""

from __future__ import annotations

import collections
import csv
import io
import json
import sys

from tfaploss.pipelines import images as I
from tfaploss.pipelines import options as opts
from tfaploss.pipelines import runner as R
from tfaploss.pipelines import storage


def parser():
    return opts.build_parser(__doc__.splitlines()[0], (
        ("--subset", ("train", "retrieval"), "train",
         "train: the training set; retrieval: the index and test sets"),
        ("--train_csv", str, "train_clean.csv",
         "train.csv (id,url,landmark_id) or train_clean.csv (landmark_id,images)"),
        ("--min_images_per_class", int, 1,
         "leave out landmarks with fewer listed training images"),
        ("--index_csv", str, "index_image_to_landmark.csv", None),
        ("--solution_csv", str, "retrieval_solution_v2.1.csv", None),
        ("--include_non_landmark_queries", bool, False,
         "also write test queries whose solution is 'None'")))


def _record(root: str, folder: str, image_id: str, labels: dict, landmark) -> dict:
    """The work-list record of an image of ``landmark`` (None: none, label -1)."""
    rel = f"{folder}/{image_id[0]}/{image_id[1]}/{image_id[2]}/{image_id}.jpg"
    return {"id": image_id, "path": storage.join(root, rel), "relpath": rel, "super_label": -1,
            "label": -1 if landmark is None else labels[landmark],
            "class_text": "" if landmark is None else str(landmark)}


def _read_csv(path: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    if not storage.exists(path):
        raise FileNotFoundError(f"GLDv2 file not found: {path}")
    reader = csv.reader(io.StringIO(storage.read_text(path)))
    header = next(reader, [])
    return header, [(i, row) for i, row in enumerate(reader, start=2)]


def _bad(path: str, lineno: int, row, why: str) -> dict:
    return {"id": f"line {lineno}", "path": ",".join(row)[:200], "reason": I.BAD_ANNOTATION,
            "detail": f"{path}:{lineno}: {why}"}


def read_train(path: str) -> tuple[list[tuple[str, int]], list[dict]]:
    """``[(image id, landmark id)]`` from train.csv or train_clean.csv, plus bad rows."""
    header, rows = _read_csv(path)
    pairs, bad = [], []
    if header[:1] == ["id"] and "landmark_id" in header:
        col = header.index("landmark_id")
        for lineno, row in rows:
            try:
                if len(row) != len(header) or len(row[0]) < 3:
                    raise ValueError(f"expected {len(header)} fields and an id")
                pairs.append((row[0], int(row[col])))
            except ValueError as e:
                bad.append(_bad(path, lineno, row, str(e)))
    elif header == ["landmark_id", "images"]:
        for lineno, row in rows:
            try:
                if len(row) != 2:
                    raise ValueError("expected landmark_id,images")
                landmark = int(row[0])
                pairs.extend((i, landmark) for i in row[1].split() if len(i) >= 3)
            except ValueError as e:
                bad.append(_bad(path, lineno, row, str(e)))
    else:
        raise ValueError(f"{path}: unknown header {header}; expected 'id,url,landmark_id' "
                         "(train.csv) or 'landmark_id,images' (train_clean.csv)")
    return pairs, bad


def plan_train(args) -> list[R.SplitPlan]:
    pairs, bad = read_train(storage.join(args.input_dir, args.train_csv))
    counts = collections.Counter(lm for _, lm in pairs)
    keep = {lm for lm, n in counts.items() if n >= args.min_images_per_class}
    labels = R.contiguous_labels(keep)
    records, dups = R.dedupe_and_index([_record(args.input_dir, "train", image_id, labels, lm)
                                        for image_id, lm in pairs if lm in keep])
    dropped = {"num_classes_below_min": len(counts) - len(keep),
               "num_images_below_min": sum(n for lm, n in counts.items() if lm not in keep)}
    return [R.SplitPlan("train", records, bad + dups,
                        label_map={v: str(k) for k, v in labels.items()}, extra=dropped)]


def plan_retrieval(args) -> list[R.SplitPlan]:
    index_csv = storage.join(args.input_dir, args.index_csv)
    header, rows = _read_csv(index_csv)
    if header[:2] != ["id", "landmark_id"]:
        raise ValueError(f"{index_csv}: expected header 'id,landmark_id', got {header}")
    index_lm, bad_index = {}, []
    for lineno, row in rows:
        try:
            if len(row) != 2 or len(row[0]) < 3:
                raise ValueError("expected id,landmark_id")
            index_lm[row[0]] = int(row[1].split()[0])
        except (ValueError, IndexError) as e:
            bad_index.append(_bad(index_csv, lineno, row, str(e)))
    labels = R.contiguous_labels(index_lm.values())
    index_records, dups = R.dedupe_and_index([
        _record(args.input_dir, "index", image_id, labels, lm)
        for image_id, lm in index_lm.items()])

    solution_csv = storage.join(args.input_dir, args.solution_csv)
    header, rows = _read_csv(solution_csv)
    if header[:2] != ["id", "images"]:
        raise ValueError(f"{solution_csv}: expected header 'id,images,Usage', got {header}")
    truth, test_records, bad_test = [], [], []
    for lineno, row in rows:
        if len(row) < 2 or len(row[0]) < 3:
            bad_test.append(_bad(solution_csv, lineno, row, "expected id,images,Usage"))
            continue
        relevant = [] if row[1].strip() == "None" else row[1].split()
        if not relevant and not args.include_non_landmark_queries:
            continue
        usage = row[2] if len(row) > 2 else ""
        known = [index_lm[i] for i in relevant if i in index_lm]
        truth.append({"id": row[0], "relevant": relevant, "usage": usage})
        test_records.append(_record(args.input_dir, "test", row[0], labels,
                                    known[0] if known else None))
    test_records, test_dups = R.dedupe_and_index(test_records)
    truth_json = json.dumps(sorted(truth, key=lambda t: t["id"]), sort_keys=True)
    label_map = {v: str(k) for k, v in labels.items()}
    return [R.SplitPlan("index", index_records, bad_index + dups, label_map=label_map,
                        by_class=False),
            R.SplitPlan("test", test_records, bad_test + test_dups, label_map=label_map,
                        by_class=False, extra={"ground_truth": "ground_truth.json"},
                        files={"ground_truth.json": truth_json})]


def plan(args) -> list[R.SplitPlan]:
    if args.min_images_per_class < 1:
        raise ValueError(f"--min_images_per_class must be >= 1, got {args.min_images_per_class}")
    return plan_train(args) if args.subset == "train" else plan_retrieval(args)


def run(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the job in-process; returns ``{split: manifest}``."""
    return R.run_command("gldv2", parser(), plan, argv)


if __name__ == "__main__":
    sys.exit(R.main_wrapper(run))
