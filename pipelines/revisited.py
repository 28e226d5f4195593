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

import sys

from pipelines import images as I
from pipelines import options as opts
from pipelines import runner as R
from pipelines import storage
from tfaploss.evaluation.revisited import check_revisited_gnd
from tfaploss.utils import safe_pickle

DATASETS = ("roxford5k", "rparis6k")


def parser():
    p = opts.build_parser(__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=DATASETS, required=True)
    p.add_argument("--images_subdir", default="jpg", help="image folder inside --input_dir")
    p.set_defaults(by_class="none")
    return p


def load_ground_truth(path: str) -> dict:
    """Safely load and check a ``gnd_*.pkl``; returns it as plain JSON-able data.

    The pickle is untrusted: :mod:`tfaploss.utils.safe_pickle` builds nothing but plain
    data, and :func:`check_revisited_gnd` refuses a wrong structure with a ValueError
    naming the file and the key. The job also needs every query's box, to crop it.
    """
    gnd = check_revisited_gnd(safe_pickle.safe_load_path(path), path)
    missing = [k for k in ("imlist", "qimlist") if not gnd[k]]
    if missing:
        raise ValueError(f"{path}: ground truth lacks (or has empty) {missing}")
    for i, q in enumerate(gnd["gnd"]):
        if "bbx" not in q:
            raise ValueError(f"{path}: 'gnd'[{i}] has no 'bbx' (the query's box)")
    return gnd


def plan(args) -> tuple[list[R.SplitPlan], dict]:
    """The two splits, and the ground truth (written by :func:`run` once they are out).

    Image names come from the pickle, which is untrusted: a name that would leave
    ``--input_dir/--images_subdir`` (``..``, an absolute path, a URL) is a dead letter
    with reason ``unsafe_path``, and so is a file that is a symlink to elsewhere
    (checked when it is read).
    """
    gnd_name = f"gnd_{args.dataset}"
    gnd = load_ground_truth(storage.join(args.input_dir, f"{gnd_name}.pkl"))

    def records(names, boxes=None):
        out, unsafe = [], []
        for i, name in enumerate(names):
            rel = f"{args.images_subdir}/{name}.jpg"
            r = {"id": str(name), "path": storage.join(args.input_dir, rel), "relpath": rel,
                 "index": i, "label": -1, "super_label": -1, "class_text": ""}
            why = I.safe_relpath(name)
            if why is not None:
                unsafe.append(R.dead_letter(r, I.UNSAFE_PATH, f"{name!r} in the ground "
                                                              f"truth: {why}"))
                continue
            if boxes is not None:
                r["bbox"] = [float(v) for v in boxes[i]]
            out.append(r)
        kept, dups = R.dedupe_and_index(out)
        return kept, unsafe + dups

    db, db_dups = records(gnd["imlist"])
    queries, q_dups = records(gnd["qimlist"], [q["bbx"] for q in gnd["gnd"]])
    extra = {"ground_truth": f"../{gnd_name}.json", "dataset": args.dataset}
    return [R.SplitPlan("database", db, db_dups, extra=extra, by_class=False),
            R.SplitPlan("queries", queries, q_dups, extra=extra, by_class=False)], gnd


def run(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the job in-process; returns ``{"database": manifest, "queries": manifest}``."""
    args, options = opts.parse_args(parser(), argv)
    plans, gnd = plan(args)
    truth = storage.join(args.output_dir, f"gnd_{args.dataset}.json")
    try:
        manifests = R.run_job("revisited", plans, args, options)
    except R.TooManyFailuresError:
        storage.write_json(truth, gnd)  # the splits were published
        raise
    storage.write_json(truth, gnd)
    return manifests


if __name__ == "__main__":
    sys.exit(R.main_wrapper(run))
