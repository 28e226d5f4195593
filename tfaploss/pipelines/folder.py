"""Class-per-subfolder image tree -> TFRecords (a user's own data, the demo's digits).

``INPUT_DIR/<class name>/**/<image>``; every file ends up in the records, the dead
letters or ``ignored_files.jsonl``. The split options and rules: docs/pipelines.md.

    python -m tfaploss.pipelines.folder --input_dir digits/ --output_dir out/ --test_classes 6,7,8,9
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field

from tfaploss.pipelines import images as I
from tfaploss.pipelines import links as LK
from tfaploss.pipelines import options as opts
from tfaploss.pipelines import runner as R
from tfaploss.pipelines import storage

SPLIT_FOLDER_NAMES = frozenset({"train", "training", "test", "testing", "val", "valid",
                                "validation", "query", "queries", "gallery", "database",
                                "index", "eval"})


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
    g.add_argument("--splits_from_folders", action="store_true",
                   help="INPUT_DIR holds one folder per split (train/, test/, ...), each "
                        "with class folders; write each as its own split")
    opts.add_options(p, (opts.FOLLOW_EXTERNAL_LINKS, (
        "--split_name", str, "train",
        "name of the single split when no class split is asked for")))
    return p


@dataclass
class Listing:
    """What :func:`list_tree` found. ``classes``: class -> [(relpath, real root the file
    must stay in)]; ``dead`` / ``ignored``: class (``None``: outside any class) ->
    dead letters / ``{"path", "reason"}``."""

    classes: dict[str, list[tuple[str, str | None]]] = field(default_factory=dict)
    dead: dict[str | None, list[dict]] = field(default_factory=dict)
    ignored: dict[str | None, list[dict]] = field(default_factory=dict)

    def add_dead(self, cls, rel, code, detail):
        self.dead.setdefault(cls, []).append({"id": rel, "path": rel, "reason": code,
                                              "detail": detail})

    def add_ignored(self, cls, rel, reason):
        self.ignored.setdefault(cls, []).append({"path": rel, "reason": reason})


def _list_class(listing: Listing, policy: LK.LinkPolicy, cls: str, path: str,
                rel_cls: str) -> None:
    files = listing.classes.setdefault(cls, [])

    def ignore(rel: str, why: str) -> None:
        listing.add_ignored(cls, rel, why)

    def add_file(rel: str, _path: str, real: str) -> None:
        if policy.admit(rel, real, I.IMAGE_EXTENSIONS, "not an image file extension",
                        ignore):
            files.append((rel, policy.bound(real)))

    LK.walk(path, rel_cls, policy, add_file, ignore,
            lambda rel, code, detail: listing.add_dead(cls, rel, code, detail))


def _list_url(listing: Listing, root: str, prefix: str) -> None:
    base = storage.join(root, prefix) if prefix else root
    for path in storage.glob(base.rstrip("/") + "/**"):
        rel = path[len(root.rstrip("/")) + 1:]
        parts = rel[len(prefix) + 1:].split("/") if prefix else rel.split("/")
        cls = parts[0] if len(parts) > 1 else None
        if len(parts) == 1:
            listing.add_ignored(None, rel, "not inside a class folder")
        elif any(p.startswith((".", "_")) for p in parts):
            listing.add_ignored(cls, rel, LK.hidden_reason(next(
                p for p in parts if p.startswith((".", "_")))))
        elif not rel.lower().endswith(I.IMAGE_EXTENSIONS):
            listing.add_ignored(cls, rel, "not an image file extension")
        else:
            listing.classes.setdefault(cls, []).append((rel, None))


def list_tree(input_dir: str, prefix: str = "", follow_external_links: bool = False) -> Listing:
    """List the class folders of ``input_dir`` (of ``input_dir/prefix`` when given;
    relative paths still start at ``input_dir``). See the module doc for the rules;
    ``follow_external_links``: follow symlinks that leave ``input_dir``."""
    root = input_dir.rstrip("/") or "/"
    top = storage.join(root, prefix) if prefix else root
    if not storage.isdir(top):
        raise FileNotFoundError(f"--input_dir {top!r} is not a directory")
    listing = Listing()
    if storage.is_url(root):
        _list_url(listing, root, prefix)
        return listing
    policy = LK.LinkPolicy(root, follow_external_links)
    real_top = os.path.realpath(top)
    for e in sorted(os.scandir(top), key=lambda e: e.name):  # the class folders
        shown = storage.printable_name(e.name) or e.name
        rel = f"{prefix}/{shown}" if prefix else shown
        if LK.screen(e, rel, lambda r, why: listing.add_ignored(None, r, why),
                     lambda r, code, detail: listing.add_dead(None, r, code, detail)):
            continue  # not UTF-8, or hidden (R.STAGING among them)
        if e.is_symlink() and e.is_dir():
            policy.defer(lambda e=e, rel=rel: _class_link(listing, policy, e, rel, real_top))
        elif e.is_dir():
            _list_class(listing, policy, e.name, e.path, rel)
        else:
            listing.add_ignored(None, rel, "not inside a class folder")
    policy.drain()
    for cls in listing.classes:
        listing.classes[cls].sort()
    return listing


def _class_link(listing: Listing, policy: LK.LinkPolicy, e: os.DirEntry, rel: str,
                real_top: str) -> None:
    # A class folder that is a link: the same rule as a folder link inside a class.
    why = policy.dir_link_reason(e.path, real_top)
    if why:
        listing.add_ignored(None, rel, why)
    else:
        _list_class(listing, policy, e.name, e.path, rel)


def _looks_split(input_dir: str, listing: Listing) -> bool:
    names = set(listing.classes)
    if not names or not names <= SPLIT_FOLDER_NAMES or not names & {"train", "test"}:
        return False
    # Images sit in class folders one level down, not directly in train/ or test/.
    files = [rel for cls in names for rel, _ in listing.classes[cls]]
    return sum(rel.count("/") >= 2 for rel in files) > len(files) / 2


def _class_groups(args, names: list[str]) -> dict[str, list[str]]:
    if args.test_classes:
        test = [c.strip() for c in args.test_classes.split(",") if c.strip()]
        unknown = sorted(set(test) - set(names))
        if unknown:
            raise ValueError(f"--test_classes names unknown classes {unknown}; "
                             f"the class folders are {names[:20]}")
        return {"train": [c for c in names if c not in test],
                "test": [c for c in names if c in test]}
    if args.split_classes:
        if not 0 < args.split_classes < len(names):
            raise ValueError(f"--split_classes must be in 1..{len(names) - 1} for "
                             f"{len(names)} classes, got {args.split_classes}")
        return {"train": names[:args.split_classes], "test": names[args.split_classes:]}
    return {args.split_name: names}


def _records(args, listing: Listing, members: list[str], split: str,
             outside: bool) -> R.SplitPlan:
    """The plan of ``members``' images (``outside``: with the listing's entries outside
    any class; the manifest sorts them)."""
    records = [{"id": rel, "path": storage.join(args.input_dir, rel), "relpath": rel,
                "label": label, "super_label": -1, "class_text": cls,
                **({"root": root} if root else {})}
               for label, cls in enumerate(members) for rel, root in listing.classes[cls]]
    records, failures = R.dedupe_and_index(records)
    keys = [*members, None] if outside else members
    dead = [d for cls in keys for d in listing.dead.get(cls, [])]
    ignored = [d for cls in keys for d in listing.ignored.get(cls, [])]
    return R.SplitPlan(split, records, dead + failures, label_map=dict(enumerate(members)),
                       ignored=ignored)


def plan(args) -> list[R.SplitPlan]:
    listing = list_tree(args.input_dir,
                        follow_external_links=getattr(args, "follow_external_links", False))
    names = sorted(listing.classes, key=_natural_key)
    if getattr(args, "splits_from_folders", False):
        return _plan_split_folders(args, listing, names)
    if not names:
        raise ValueError(f"--input_dir {args.input_dir!r} has no class subfolders")
    if _looks_split(args.input_dir, listing):
        raise ValueError(
            f"--input_dir {args.input_dir!r} looks already split: its folders "
            f"{names} hold class folders, so they would become {len(names)} classes named "
            f"{names}. Run with --splits_from_folders to write each as its own split (its "
            "subfolders are the classes), or point --input_dir at one of them.")
    return [_records(args, listing, members, split, outside=i == 0)
            for i, (split, members) in enumerate(_class_groups(args, names).items())]


def _plan_split_folders(args, top: Listing, splits: list[str]) -> list[R.SplitPlan]:
    if not splits:
        raise ValueError(f"--splits_from_folders: {args.input_dir!r} has no split folders")
    plans = []
    for split in sorted(splits, key=lambda s: (s not in ("train", "training"), s)):
        listing = list_tree(args.input_dir, prefix=split,
                            follow_external_links=getattr(args, "follow_external_links", False))
        names = sorted(listing.classes, key=_natural_key)
        if not names:
            raise ValueError(f"--splits_from_folders: {split}/ has no class subfolders")
        plans.append(_records(args, listing, names, split, outside=True))
    plans[0].failures = top.dead.get(None, []) + plans[0].failures
    plans[0].ignored = top.ignored.get(None, []) + plans[0].ignored
    return plans


def run(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the job in-process; returns ``{split: manifest}``."""
    return R.run_command("folder", parser(), plan, argv)


if __name__ == "__main__":
    sys.exit(R.main_wrapper(run))
