"""Revisited Oxford5k / Paris6k (Radenović et al., CVPR'18) -> TFRecords + JSON truth.

Splits ``database`` and ``queries`` (cropped to their boxes) and
``OUTPUT_DIR/gnd_<dataset>.json``. The ground-truth pickle is untrusted: read only with
the expected SHA-256 or when named, and then in :mod:`tfaploss.pipelines.pickle_sandbox`
(docs/pipelines.md).

    python -m tfaploss.pipelines.revisited --input_dir roxford5k --dataset roxford5k \\
        --output_dir out \\
        --expected_sha256 <SHA-256 of the published gnd_roxford5k.pkl>
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys

from tfaploss.evaluation.revisited import check_revisited_gnd
from tfaploss.pipelines import images as I
from tfaploss.pipelines import options as opts
from tfaploss.pipelines import pickle_sandbox, storage
from tfaploss.pipelines import runner as R

DATASETS = ("roxford5k", "rparis6k")
# The SHA-256 of http://cmp.felk.cvut.cz/revisitop/data/datasets/<dataset>/gnd_<dataset>.pkl:
# not recorded until checked on a verified download (a wrong pin refuses the genuine file);
# meanwhile the user gives it (--expected_sha256) or names the file.
PUBLISHED_SHA256: dict[str, str | None] = {"roxford5k": None, "rparis6k": None}


def _sha256(text: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        raise argparse.ArgumentTypeError(f"not a SHA-256 (64 hex digits): {text!r}")
    return text.lower()


def parser():
    p = opts.build_parser(__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=DATASETS, required=True)
    p.add_argument("--images_subdir", default="jpg", help="image folder inside --input_dir")
    p.add_argument("--ground_truth_only", action="store_true",
                   help="only convert gnd_<dataset>.pkl to OUTPUT_DIR/gnd_<dataset>.json "
                        "(what evaluation's --gnd reads); no image is read")
    p.add_argument("--expected_sha256", type=_sha256,
                   help="the SHA-256 the ground-truth pickle must have (the published "
                        "file's, as you checked it)")
    p.add_argument("--ground_truth",
                   help="read this pickle rather than INPUT_DIR/gnd_<dataset>.pkl, even "
                        "with no SHA-256 expected (in the same sandbox)")
    p.set_defaults(by_class="none")
    return p


def read_pickled_ground_truth(path: str, expected_sha256: str | None,
                              named: bool = False) -> dict:
    """Check and read a ``gnd_*.pkl`` (only with SHA-256 ``expected_sha256``, or with none
    expected if the user ``named`` it) in :mod:`~tfaploss.pipelines.pickle_sandbox`;
    returns JSON-able data with ``source`` (file name and SHA-256) added. Costs a child
    process (about 0.2 s) plus hashing the file.
    """
    data = storage.read_range(path, 0, pickle_sandbox.MAX_BYTES + 1)
    sha256 = hashlib.sha256(data).hexdigest()
    if expected_sha256 and sha256 != expected_sha256:
        raise ValueError(f"{path}: SHA-256 {sha256}, not the expected {expected_sha256}")
    if not expected_sha256 and not named:
        raise ValueError(
            f"{path}: SHA-256 {sha256}, and no SHA-256 is expected (the published file's is "
            "not recorded here): compare it with the published file's and pass "
            f"--expected_sha256 {sha256}, or name the file with --ground_truth {path}")
    gnd = check_revisited_gnd(pickle_sandbox.read_pickle(data, str(path)), path)
    gnd["source"] = {"file": str(path).replace("\\", "/").rsplit("/", 1)[-1],
                     "sha256": sha256}
    return gnd


def load_ground_truth(args) -> dict:
    """:func:`read_pickled_ground_truth` of the job's pickle, plus what the job needs:
    non-empty name lists and every query's box (to crop it)."""
    path = args.ground_truth or storage.join(args.input_dir, f"gnd_{args.dataset}.pkl")
    expected = args.expected_sha256 or PUBLISHED_SHA256[args.dataset]
    gnd = read_pickled_ground_truth(path, expected, named=bool(args.ground_truth))
    missing = [k for k in ("imlist", "qimlist") if not gnd[k]]
    if missing:
        raise ValueError(f"{path}: ground truth lacks (or has empty) {missing}")
    for i, q in enumerate(gnd["gnd"]):
        if "bbx" not in q:
            raise ValueError(f"{path}: 'gnd'[{i}] has no 'bbx' (the query's box)")
    return gnd


def plan(args) -> tuple[list[R.SplitPlan], dict]:
    """The two splits, and the ground truth (written by :func:`run` once they are out).
    An untrusted image name that would leave ``--input_dir/--images_subdir``, or a link
    to elsewhere, is an ``unsafe_path`` dead letter."""
    gnd_name = f"gnd_{args.dataset}"
    gnd = load_ground_truth(args)

    def records(names, boxes=None):
        out, unsafe = [], []
        for i, name in enumerate(names):
            rel = f"{args.images_subdir}/{name}.jpg"
            r = {"id": str(name), "path": storage.join(args.input_dir, rel), "relpath": rel,
                 "index": i, "label": -1, "super_label": -1, "class_text": ""}
            why = I.safe_relpath(name)
            if why is not None:
                unsafe.append(I.dead_letter(r, I.UNSAFE_PATH, f"{name!r} in the ground "
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


def run(argv: list[str] | None = None) -> dict[str, dict] | str:
    """Run the job in-process; returns ``{"database": manifest, "queries": manifest}``,
    or with ``--ground_truth_only`` the path of the JSON ground truth written."""
    args, options = opts.parse_args(parser(), argv)
    truth = storage.join(args.output_dir, f"gnd_{args.dataset}.json")
    if args.ground_truth_only:
        gnd = load_ground_truth(args)
        storage.makedirs(args.output_dir)
        storage.write_json(truth, gnd)
        return truth
    plans, gnd = plan(args)
    try:
        manifests = R.run_job("revisited", plans, args, options)
    except R.TooManyFailuresError:
        storage.write_json(truth, gnd)  # the splits were published
        raise
    storage.write_json(truth, gnd)
    return manifests


def describe(result) -> str:
    """The result line: the splits written, or the ground truth alone."""
    if isinstance(result, str):
        return f"ground truth: {result}"
    return R.describe_manifests(result)


if __name__ == "__main__":
    sys.exit(R.main_wrapper(run, describe=describe))
