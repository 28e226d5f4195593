"""Revisited Oxford5k / Paris6k (Radenović et al., CVPR'18) -> TFRecords + JSON truth.

Reads ``INPUT_DIR/gnd_<dataset>.pkl`` (a dict with ``imlist``, ``qimlist`` and ``gnd``,
one dict per query with ``bbx``, ``easy``, ``hard``, ``junk``) and the images
``INPUT_DIR/jpg/<name>.jpg``. Writes two splits:

* ``database``: every ``imlist`` image, ``image/index`` = its position in ``imlist``;
* ``queries``: every ``qimlist`` image cropped to its ``bbx`` (as the protocol
  requires), ``image/index`` = its position in ``qimlist``, ``image/bbox`` = the box;

and the ground truth as ``OUTPUT_DIR/gnd_<dataset>.json`` (same structure as the pickle,
arrays as lists). Labels are -1: retrieval is scored with the ground truth, by index.

The pickle is untrusted input: it is read with :mod:`tfaploss.utils.safe_pickle`, which
refuses anything but plain containers, numbers, strings and numpy arrays.

    python -m pipelines.revisited --input_dir roxford5k --dataset roxford5k --output_dir out
"""

from __future__ import annotations

import json
import sys

from pipelines import options as opts
from pipelines import transforms as T
from tfaploss.utils import safe_pickle

DATASETS = ("roxford5k", "rparis6k")


def parser():
    p = opts.build_parser(__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=DATASETS, required=True)
    p.add_argument("--images_subdir", default="jpg", help="image folder inside --input_dir")
    p.set_defaults(by_class="none")
    return p


def _plain(value):
    """numpy arrays/scalars -> lists/numbers, recursively, for JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def load_ground_truth(path: str) -> dict:
    """Safely load and check a ``gnd_*.pkl``; returns it as plain JSON-able data."""
    gnd = _plain(safe_pickle.safe_load_path(path))
    missing = [k for k in ("imlist", "qimlist", "gnd") if k not in gnd]
    if missing:
        raise ValueError(f"{path}: ground truth lacks {missing}")
    if len(gnd["gnd"]) != len(gnd["qimlist"]):
        raise ValueError(f"{path}: {len(gnd['gnd'])} gnd entries for "
                         f"{len(gnd['qimlist'])} queries")
    for i, q in enumerate(gnd["gnd"]):
        if "bbx" not in q or len(q["bbx"]) != 4:
            raise ValueError(f"{path}: query {i} has no 4-number 'bbx'")
    return gnd


def plan(args) -> list[T.SplitPlan]:
    gnd_name = f"gnd_{args.dataset}"
    gnd = load_ground_truth(T.join(args.input_dir, f"{gnd_name}.pkl"))
    gfile = T._gfile()
    gfile.makedirs(args.output_dir)
    with gfile.GFile(T.join(args.output_dir, f"{gnd_name}.json"), "w") as f:
        json.dump(gnd, f)

    def records(names, boxes=None):
        out = []
        for i, name in enumerate(names):
            rel = f"{args.images_subdir}/{name}.jpg"
            r = {"id": name, "path": T.join(args.input_dir, rel), "relpath": rel,
                 "index": i, "label": -1, "super_label": -1, "class_text": ""}
            if boxes is not None:
                r["bbox"] = [float(v) for v in boxes[i]]
            out.append(r)
        return T.dedupe_and_index(out)

    db, db_dups = records(gnd["imlist"])
    queries, q_dups = records(gnd["qimlist"], [q["bbx"] for q in gnd["gnd"]])
    extra = {"ground_truth": f"../{gnd_name}.json", "dataset": args.dataset}
    return [T.SplitPlan("database", db, db_dups, extra=extra, by_class=False),
            T.SplitPlan("queries", queries, q_dups, extra=extra, by_class=False)]


def run(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the job in-process; returns ``{"database": manifest, "queries": manifest}``."""
    args, options = opts.parse_args(parser(), argv)
    return T.run_job("revisited", plan(args), args, options)


if __name__ == "__main__":
    sys.exit(T.main_wrapper(run))
