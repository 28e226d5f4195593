"""Class-per-subfolder image tree -> TFRecords (a user's own data, the demo's digits).

Layout read: ``INPUT_DIR/<class name>/**/<image>`` with any of
:data:`pipelines.transforms.IMAGE_EXTENSIONS` (JPEG, PNG, BMP, GIF, WebP, TIFF; any
size, e.g. 8x8 PNGs). Class names are sorted in natural order ("2" before "10");
image ids are the paths relative to ``INPUT_DIR``. Other files are listed in the
manifest under ``ignored_files`` and otherwise left alone.

Splits: without a split option everything goes to one split (``--split_name``,
default ``train``). ``--test_classes 6,7,8,9`` puts those classes in ``test`` and the
rest in ``train``; ``--split_classes N`` puts the first N classes (natural order) in
``train`` and the rest in ``test`` (the zero-shot retrieval protocol of CUB/Cars/SOP).
Labels are contiguous ``0..C-1`` within each split; the manifest's ``label_map`` gives
the folder name of each label.

    python -m pipelines.folder --input_dir digits/ --output_dir out/ --test_classes 6,7,8,9
"""

from __future__ import annotations

import re
import sys

from pipelines import options as opts
from pipelines import transforms as T


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def parser():
    p = opts.build_parser(__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--test_classes", default="",
                   help="comma-separated class folder names that form the 'test' split; "
                        "the other classes form 'train'")
    g.add_argument("--split_classes", type=int, default=0,
                   help="first N classes (natural order) form 'train', the rest 'test'")
    p.add_argument("--split_name", default="train",
                   help="name of the single split when no class split is asked for")
    return p


def list_tree(input_dir: str) -> tuple[dict[str, list[str]], list[str]]:
    """``{class: [relative image paths]}`` and the relative paths of ignored files."""
    gfile = T._gfile()
    if not gfile.isdir(input_dir):
        raise FileNotFoundError(f"--input_dir {input_dir!r} is not a directory")
    classes: dict[str, list[str]] = {}
    ignored: list[str] = []
    root = input_dir.rstrip("/")
    for entry in sorted(gfile.listdir(root)):
        name = entry.rstrip("/")
        if name.startswith((".", "_")):
            continue
        path = T.join(root, name)
        if not gfile.isdir(path):
            ignored.append(name)
            continue
        files = []
        for dirpath, _, filenames in gfile.walk(path):
            rel_dir = dirpath[len(root):].strip("/")
            for fn in filenames:
                rel = f"{rel_dir}/{fn}"
                if fn.startswith("."):
                    continue
                (files if fn.lower().endswith(T.IMAGE_EXTENSIONS) else ignored).append(rel)
        classes[name] = sorted(files)
    return classes, sorted(ignored)


def plan(args) -> list[T.SplitPlan]:
    classes, ignored = list_tree(args.input_dir)
    names = sorted(classes, key=_natural_key)
    if not names:
        raise ValueError(f"--input_dir {args.input_dir!r} has no class subfolders")
    if args.test_classes:
        test = [c.strip() for c in args.test_classes.split(",") if c.strip()]
        unknown = sorted(set(test) - set(names))
        if unknown:
            raise ValueError(f"--test_classes names unknown classes {unknown}; "
                             f"the class folders are {names[:20]}")
        groups = {"train": [c for c in names if c not in test],
                  "test": [c for c in names if c in test]}
    elif args.split_classes:
        if not 0 < args.split_classes < len(names):
            raise ValueError(f"--split_classes must be in 1..{len(names) - 1} for "
                             f"{len(names)} classes, got {args.split_classes}")
        groups = {"train": names[:args.split_classes], "test": names[args.split_classes:]}
    else:
        groups = {args.split_name: names}
    plans = []
    for split, members in groups.items():
        records = [{"id": rel, "path": T.join(args.input_dir, rel), "relpath": rel,
                    "label": label, "super_label": -1, "class_text": cls}
                   for label, cls in enumerate(members) for rel in classes[cls]]
        records, failures = T.dedupe_and_index(records)
        plans.append(T.SplitPlan(
            split, records, failures, label_map=dict(enumerate(members)),
            extra={"ignored_files": ignored[:1000], "num_ignored_files": len(ignored)}))
    return plans


def run(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the job in-process; returns ``{split: manifest}``."""
    args, options = opts.parse_args(parser(), argv)
    return T.run_job("folder", plan(args), args, options)


if __name__ == "__main__":
    sys.exit(T.main_wrapper(run))
