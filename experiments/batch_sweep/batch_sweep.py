"""Every loss x batch size on a retrieval set: MAP@R and R@1 on unseen classes.

One sweep, two backends (``--backend``): ``tensorflow`` (the default) trains each cell
with ``tfaploss train`` on CPU, up to B=2048; ``jax`` trains on one GPU with Keras on
JAX, batches up to 16,384 and a wider CNN, from the glyph splits exported to one array
file (below). Both pick the learning rate on the validation classes and report the mean
and half-range over seeds alike.

The papers' claim: optimising AP directly beats pair and triplet losses, and gains more
as the batch grows (Revaud et al. ICCV'19 Fig. 4 / Table 2; Smooth-AP, ROADMAP). This
sweep measures it on any set a ``pipelines`` job wrote (train / val / test splits with
disjoint classes), by default the CJK glyph set of ``make data-glyphs``.

Protocol of ``--backend tensorflow`` (the same for every cell, stated in the report):

* backbone ``small_cnn`` (3 stages of 2 conv-BN-ReLU, GeM, linear head to
  ``--embedding-dim``, L2), trained from scratch at ``--image-size`` with the same
  augmentation (random resized crops of 60-100 % of the area; no flips unless
  ``--flip``), Adam, cosine decay to 0, ``m=4`` images per class;
* two budgets, side by side: **equal images seen** (``--images`` per run, so a batch B
  gets ``images / B`` updates) and **equal updates** (``--updates`` per run);
* learning rate: the grid ``base_lr * (B / base_batch) ** a`` for ``a`` in
  ``--lr-exponents`` (0: constant, 0.5: square-root rule, 1: linear rule), each tried
  with the first seed and picked by MAP@R on the *validation* split (held-out training
  classes; never the test split); the other seeds then run at the picked rate. Every
  loss gets the same grid: an equal tuning budget. Other loss arguments are the
  library's defaults;
* batches larger than ``--chunk-size`` go through ``MultiStageModel`` (exact
  multi-staged backprop), so the sweep exercises it;
* the batch-health check of ``tfaploss train`` runs in every cell; a run it stopped
  (collapsed embeddings) is reported as such.

Every finished cell (loss, batch, updates, lr, seed) of ``--backend tensorflow`` is cached under ``--out`` (its
``tfaploss train`` run directory and a ``metrics.json``) and skipped on the next run,
so the full sweep can be spread over several sittings; a killed cell resumes from its
last epoch. Two budgets that ask for the same cell share it. The cache is not committed;
the report's ``sweep.json`` is, and it is the **ledger** of a fresh checkout
(``--ledger``, by default the ``sweep.json`` already in ``--report``): a cell it holds,
run with the same protocol on the same data (the split manifests' SHA-256), counts as
finished, so a new sitting extends the committed table instead of rerunning it.

    make data-glyphs
    python experiments/batch_sweep/batch_sweep.py --quick                       # minutes
    nice python experiments/batch_sweep/batch_sweep.py                          # hours; resumable
    python experiments/batch_sweep/batch_sweep.py --losses APLoss,TripletLoss --batch-sizes 128,2048 \\
        --train data/sop/train --val data/sop/val --test data/sop/test

Writes ``sweep.md`` (the tables), ``sweep.png`` (MAP@R against batch size, one line per
loss, error bars over seeds) and ``sweep.json`` to ``--report`` (default: ``--out``).
``--report-only`` needs no data: a ledger that recorded its splits' fingerprints
rewrites its report alone (``docs/batch_sweep/first_sweep.md``).

``--backend jax``, for one GPU. The training needs no TensorFlow beyond the batches'
sampler (:func:`tfaploss.data.samplers.m_per_class_rows`, a CPU build suffices):

1. Here, the glyph set's three splits are decoded once into one compressed array file
   (``--export``): grayscale, the 64² canvas resized to ``--source-size`` (36²; a 32²
   centre crop of it is what the CPU sweep evaluates on: the shorter side resized to
   32 / 0.875), quantised to 16 grey levels (the JPEG noise of black-on-white glyphs is
   what makes the file large: 16 levels and xz give 20 MiB instead of 67).

       python experiments/batch_sweep/batch_sweep.py --backend jax --export gpu_data/glyphs36.npz.xz

2. On the GPU (``KERAS_BACKEND=jax`` is set here):

       python experiments/batch_sweep/batch_sweep.py --backend jax --data gpu_data/glyphs36.npz --out OUT

Its protocol (printed with the table): small_cnn with widths (64, 128, 256) (the CPU
sweep: 32, 64, 128), GeM, a linear head to 128-d, L2-normalised, from scratch with live
BatchNorm; Keras's ``mixed_bfloat16`` policy for the backbone (``--precision``; the
embeddings and the losses are float32); random resized crops of 60-100 % of the area,
aspect 3/4-4/3, bilinear, to 32², on the GPU, evaluation on the 32² centre crop;
``m = max(4, B / 1024)`` images per class (the train split has 1,200 classes, so
B=16,384 takes 1,024 classes of 16); equal updates (``--updates``, default 64), Adam
with a cosine decay to 0; the learning-rate grid as above (default a in {0, 0.5}),
picked per (loss, batch) on the validation classes with seed 0; MAP@R and R@1 on the
unseen test classes, exact search (``tfaploss.evaluation.retrieval_metrics``).

Work is ordered so that a run stopped by ``--deadline`` (seconds) leaves a complete
table for the cells it reached: every cell's tuning runs first, batch by batch, then
the remaining seeds. Each finished run is appended to ``OUT/sweep_jax.jsonl``; the
Markdown table and the plot (``sweep_jax.md``, ``sweep_jax.png``) are rewritten from it
(``--report-only`` too). ``--repeat`` trains the seed-0 tuning runs once more into
``OUT/sweep_jax_repeat.jsonl``; the report then sets each repeat beside its first run.
GPU training is not bitwise deterministic, so that gap is the noise floor of the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = ROOT / "data" / "glyphs"
DEFAULT_OUT = ROOT / "experiments" / "batch_sweep" / "results"

# Loss name -> (tfaploss.losses class, constructor arguments). Library defaults, except
# PNP's variant, named for clarity. The successors (RS@k, SupRecall, SupNDCG) run without SiMix.
LOSSES = {
    "APLoss": ("APLoss", {}),
    "FastAP": ("FastAPLoss", {}),
    "SmoothAP": ("SmoothAPLoss", {}),
    "ROADMAP": ("ROADMAPLoss", {}),
    "PNP-Dq": ("PNPLoss", {"variant": "Dq"}),
    "BlackBox": ("BlackBoxAPLoss", {}),
    "RS@k": ("RecallAtKLoss", {}),
    "SupRecall": ("SupRecallLoss", {}),
    "SupNDCG": ("SupNDCGLoss", {}),
    "Triplet-semihard": ("TripletLoss", {"mining": "semihard"}),
    "Contrastive": ("ContrastiveLoss", {}),
    # TF Addons' all-pairs mean gives positives (m-1)/(B-1) of the weight; this one
    # averages a query's positives and negatives apart, so the balance holds at any B.
    "Contrastive-per-query": ("ContrastiveLoss", {"averaging": "per_query"}),
}
# the peers the AP losses must beat
PAIR_LOSSES = ("Triplet-semihard", "Contrastive", "Contrastive-per-query")

FULL = {"batch_sizes": "128,512,2048", "seeds": "0,1", "images": 49152, "updates": 96,
        "lr_exponents": "0,0.5,1", "image_size": 32, "eval_images": 0,
        "out": str(DEFAULT_OUT)}
QUICK = {"batch_sizes": "32,128", "seeds": "0", "images": 1024, "updates": 8,
         "lr_exponents": "0", "image_size": 24, "eval_images": 3000,
         "out": str(DEFAULT_OUT) + "_quick"}
JAX = {"losses": "APLoss,FastAP,SmoothAP,Triplet-semihard,Contrastive",
       "batch_sizes": "1024,4096,16384", "seeds": "0,1", "updates": 64,
       "lr_exponents": "0,0.5", "out": "experiments/batch_sweep/results/jax"}
WIDTHS = (64, 128, 256)  # the JAX backend's small_cnn
CROP, EMBEDDING_DIM, EVAL_CHUNK = 32, 128, 4096
LEDGER, REPEAT_LEDGER = "sweep_jax.jsonl", "sweep_jax_repeat.jsonl"
JAX_ONLY = ("backend", "export", "splits", "source_size", "array_file", "deadline", "device",
            "precision", "limit", "repeat")  # not written to the CPU sweep's ledger


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("tensorflow", "jax"), default="tensorflow",
                   help="tensorflow: each cell a `tfaploss train` run (CPU); jax: one GPU, "
                        "Keras on JAX, from the --export array file")
    p.add_argument("--train", default=str(DEFAULT_DATA / "train"),
                   help="training split (by-class TFRecords of a pipelines job)")
    p.add_argument("--val", default=str(DEFAULT_DATA / "val"),
                   help="validation split (classes disjoint from train and test) used to "
                        "pick the learning rate; 'none' disables tuning")
    p.add_argument("--test", default=str(DEFAULT_DATA / "test"),
                   help="test split (classes never seen in training)")
    p.add_argument("--losses", help=f"comma-separated, from {', '.join(LOSSES)} (default: "
                                    f"all; jax: {JAX['losses']})")
    p.add_argument("--batch-sizes", help=f"comma-separated (default {FULL['batch_sizes']})")
    p.add_argument("--seeds", help=f"comma-separated (default {FULL['seeds']})")
    p.add_argument("--budgets", default="images,updates",
                   help="'images' (equal images seen), 'updates' (equal updates), or both")
    p.add_argument("--images", type=int, help=f"images per run, equal-images budget "
                                              f"(default {FULL['images']})")
    p.add_argument("--updates", type=int, help=f"updates per run, equal-updates budget "
                                               f"(default {FULL['updates']})")
    p.add_argument("--base-lr", type=float, default=1e-3, help="Adam learning rate at "
                                                               "--base-batch")
    p.add_argument("--base-batch", type=int, default=128)
    p.add_argument("--lr-exponents", help="lr = base_lr * (B/base_batch)**a for each a "
                                          f"(default {FULL['lr_exponents']})")
    p.add_argument("--image-size", type=int, help=f"training crops (default "
                                                  f"{FULL['image_size']})")
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--m", type=int, default=4, help="images per class in a batch")
    p.add_argument("--chunk-size", type=int, default=512,
                   help="batches larger than this use multi-staged backprop in chunks of it")
    p.add_argument("--flip", action="store_true",
                   help="random horizontal flips (off by default: a mirrored glyph is "
                        "another character or none; turn on for natural images)")
    p.add_argument("--freeze-bn", action="store_true",
                   help="frozen BatchNorm with statistics calibrated at initialisation "
                        "(the setting before the from-scratch fix; for comparison)")
    p.add_argument("--eval-images", type=int,
                   help="evaluate on the first N images of val and test (0: all; "
                        "a smoke test's shortcut, the numbers then differ)")
    p.add_argument("--out", help=f"cache of finished cells (default {DEFAULT_OUT})")
    p.add_argument("--report", help="where sweep.md/png/json go (default: --out)")
    p.add_argument("--quick", action="store_true",
                   help="a few minutes: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--dry-run", action="store_true", help="list the cells and stop")
    p.add_argument("--ledger", help="a sweep.json whose runs count as finished cells "
                        "when their protocol and data match (default: <report>/sweep.json "
                        "if present; 'none' to ignore it)")
    p.add_argument("--report-only", action="store_true",
                   help="write the report from the cells already cached; train nothing "
                        "(cells not run yet show as '—')")
    jax = p.add_argument_group("--backend jax")
    jax.add_argument("--export", help="write the glyph splits to this .npz (needs TensorFlow)")
    jax.add_argument("--splits", default="data/glyphs",
                     help="folder with train/, val/, test/ of a pipelines job (for --export)")
    jax.add_argument("--source-size", type=int, default=36)
    jax.add_argument("--data", dest="array_file", help="the .npz written by --export")
    jax.add_argument("--deadline", type=float, default=0,
                     help="seconds after which no new run starts (0: none)")
    jax.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    jax.add_argument("--precision", choices=("mixed_bfloat16", "float32"),
                     default="mixed_bfloat16",
                     help="Keras dtype policy of the backbone (the losses run in float32)")
    jax.add_argument("--limit", type=int, default=0,
                     help="use the first N images of each split (a CPU smoke test)")
    jax.add_argument("--repeat", action="store_true",
                     help="train the seed-0 tuning runs again into OUT/sweep_jax_repeat.jsonl: "
                          "the same (loss, B, lr, seed) twice measures run-to-run noise")
    args = p.parse_args(argv)
    defaults = {**FULL, "losses": ",".join(LOSSES), **(QUICK if args.quick else {})}
    if args.backend == "jax":
        defaults.update(JAX)
        if not args.export and not args.array_file and not args.report_only:
            p.error("--backend jax: give --export (here) or --data (where the sweep runs)")
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
        args.seeds = _ints(args.seeds, "--seeds", minimum=0)
        args.lr_exponents = [float(a) for a in str(args.lr_exponents).split(",")]
    except ValueError as err:
        p.error(str(err))
    args.losses = [s.strip() for s in args.losses.split(",") if s.strip()]
    unknown = [name for name in args.losses if name not in LOSSES]
    if unknown:
        p.error(f"--losses: unknown {unknown}; choose from {', '.join(LOSSES)}")
    args.budgets = [s.strip() for s in args.budgets.split(",") if s.strip()]
    if not args.budgets or any(b not in ("images", "updates") for b in args.budgets):
        p.error(f"--budgets must name 'images' and/or 'updates', received {args.budgets}")
    for name in ("images", "updates", "embedding_dim", "chunk_size", "base_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, received {getattr(args, name)}")
    if any(b % args.m for b in args.batch_sizes):
        p.error(f"--batch-sizes must be multiples of --m={args.m}, received "
                f"{args.batch_sizes}")
    args.report = args.report or args.out
    if args.backend == "jax":
        return args
    if args.val.lower() == "none":
        args.val = None
    for split in ("train", "val", "test"):
        path = getattr(args, split)
        if path is not None and not (Path(path) / "manifest.json").is_file() \
                and not args.report_only:
            p.error(f"--{split} {path!r} holds no manifest.json: not a split written by a "
                    "pipelines job. Build the glyph set with `make data-glyphs`, or pass "
                    "the split folders of another job.")
    args.data = data_fingerprint(args)
    args.ledger_rows = load_ledger(args)
    return args


# The arguments that make two runs of the same (loss, batch, updates, lr, seed) the same
# experiment; the data is compared by fingerprint.
PROTOCOL = ("image_size", "embedding_dim", "m", "chunk_size", "flip", "freeze_bn",
            "eval_images")


def data_fingerprint(args) -> dict:
    """SHA-256 (first 16 hex digits) of each split's manifest: same manifest, same set."""
    import hashlib

    manifests = {split: Path(getattr(args, split)) / "manifest.json"
                 for split in ("train", "val", "test") if getattr(args, split) is not None}
    if not all(path.is_file() for path in manifests.values()):
        return None  # --report-only without the data: the ledger's own are taken
    return {split: hashlib.sha256(path.read_bytes()).hexdigest()[:16]
            for split, path in manifests.items()}


def _cell_key(row):
    return row["loss"], row["batch"], row["updates"], float(row["lr"]), row["seed"]


def load_ledger(args) -> dict:
    """Runs of an earlier report that count as finished cells: {cell key: row}.

    Used only when the report was made with the same protocol (``PROTOCOL``) and, where
    it recorded one, the same data fingerprint; otherwise it is ignored, and says why.
    """
    if args.ledger and args.ledger.lower() == "none":
        return {}
    path = Path(args.ledger) if args.ledger else Path(args.report) / "sweep.json"
    if not path.is_file():
        if args.ledger:
            raise SystemExit(f"--ledger {args.ledger!r}: no such file")
        return {}
    report = json.loads(path.read_text())
    old = report.get("args", {})
    differ = [k for k in PROTOCOL if old.get(k) != getattr(args, k)]
    if old.get("data") and args.data is not None and old["data"] != args.data:
        differ.append("data (split manifests)")
    args.data = args.data or old.get("data")
    if differ:
        print(f"ledger {path}: not used, its runs differ in {', '.join(differ)}")
        return {}
    rows = {}
    for group in report.get("results", []):
        for row in group["tried"] + group["runs"]:
            # a run listed twice (tried, then reported) keeps every metric of both
            rows[_cell_key(row)] = {**rows.get(_cell_key(row), {}), **row}
    note = "" if old.get("data") else " (it recorded no data fingerprint: same paths assumed)"
    print(f"ledger {path}: {len(rows)} finished runs{note}")
    return rows


def _ints(text, flag="--batch-sizes", minimum=1):
    values = [int(v) for v in str(text).split(",") if v.strip()]
    if not values or any(v < minimum for v in values):
        raise ValueError(f"{flag} must be integers >= {minimum}, received {text!r}")
    return values


# -- cells ---------------------------------------------------------------------------

def updates_for(args, budget, batch):
    if budget == "images":
        return max(1, round(args.images / batch))
    return args.updates


def learning_rates(args, batch):
    """The grid at this batch size, deduplicated (at the base batch every rule agrees)."""
    rates = {}
    for a in args.lr_exponents:
        lr = float(f"{args.base_lr * (batch / args.base_batch) ** a:.3g}")
        rates.setdefault(lr, a)
    return rates  # lr -> exponent


def cell_dir(args, loss, batch, updates, lr, seed) -> Path:
    bn = "frozenbn" if args.freeze_bn else "livebn"
    subset = f"_eval{args.eval_images}" if args.eval_images else ""
    return (Path(args.out) / f"{bn}_s{args.image_size}_d{args.embedding_dim}{subset}" / loss
            / f"b{batch}" / f"u{updates}" / f"lr{lr:g}" / f"seed{seed}")


def row_dir(args, row) -> Path:
    """The run directory of a cell's result row."""
    return cell_dir(args, row["loss"], row["batch"], row["updates"], row["lr"], row["seed"])


def cell_config(args, loss, batch, updates, lr, seed, run_dir):
    from tfaploss.config import config_from_dict

    cls, kwargs = LOSSES[loss]
    epochs = min(4, updates)
    steps = math.ceil(updates / epochs)
    chunk = args.chunk_size if batch > args.chunk_size else None
    raw = {
        "description": f"batch sweep: {loss} B={batch} {updates} updates lr={lr:g} "
                       f"seed={seed}",
        "run_dir": str(run_dir),
        "data": {"train": args.train, "test": args.test, "sampler": "m_per_class",
                 "batch_size": batch, "m": args.m, "image_size": args.image_size,
                 "augmentation": {"crop": "random_resized_crop", "scale": [0.6, 1.0],
                                  "flip": args.flip},
                 "seed": seed},
        "model": {"backbone": "small_cnn", "pooling": "gem",
                  "embedding_dim": args.embedding_dim, "weights": None,
                  "freeze_bn": bool(args.freeze_bn),
                  "bn_calibration_images": 256 if args.freeze_bn else 0},
        "loss": {"name": cls, **kwargs},
        "optimizer": {"name": "adam", "lr": lr,
                      "schedule": {"name": "cosine", "end_lr": 0.0}},
        "training": {"epochs": epochs, "steps_per_epoch": steps, "chunk_size": chunk,
                     "seed": seed},
        "evaluation": {"at_end": False, "every_n_epochs": 0, "ks": [1],
                       "backend": "exact"},
    }
    return config_from_dict(raw, warn=False)


def _write(path: Path, data: str | bytes) -> None:
    """``data`` to ``path`` through a temporary name (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
    os.replace(tmp, path)


def _save(path: Path, row: dict) -> dict:
    _write(path, json.dumps(row, indent=1))
    return row


def _evaluate(args, row, split, path):
    """Add ``{split}_map@r`` and ``{split}_r@1`` of the cell's saved model to ``row``."""
    import keras

    from tfaploss.config import load_config
    from tfaploss.run.trainer import evaluate_split

    run_dir = row_dir(args, row)
    cfg = load_config(run_dir / "config.yaml", warn=False)
    started = time.time()
    m = evaluate_split(keras.saving.load_model(run_dir / "model.keras"), cfg, path,
                       args.eval_images or None)
    row[f"{split}_map@r"] = 100 * m["map@r"]
    row[f"{split}_r@1"] = 100 * m["recall@1"]
    row["seconds"] = round(row["seconds"] + time.time() - started, 1)


def with_test(args, row) -> dict:
    """``row`` with its test metrics (computed once, only for the runs reported)."""
    if row["status"] == "non-finite" or "test_map@r" in row:
        return row
    if not (row_dir(args, row) / "model.keras").is_file():
        # a ledger run picked now, whose model this checkout does not have: train it
        row = run_cell(args, row["loss"], row["batch"], row["updates"], row["lr"],
                       row["seed"], use_ledger=False)
        if row["status"] == "non-finite" or "test_map@r" in row:
            return row
    _evaluate(args, row, "test", args.test)
    return _save(row_dir(args, row) / "metrics.json", row)


class NotRun(Exception):
    """A cell that ``--report-only`` found no cached result for."""


def run_cell(args, loss, batch, updates, lr, seed, use_ledger=True) -> dict:
    """Train one cell (or reuse it from the cache or the ledger) and return its metrics:
    validation metrics always (they pick the learning rate), test metrics through
    :func:`with_test`."""
    run_dir = cell_dir(args, loss, batch, updates, lr, seed)
    metrics_path = run_dir / "metrics.json"
    if metrics_path.is_file():
        return json.loads(metrics_path.read_text())
    ledger_row = args.ledger_rows.get((loss, batch, updates, float(lr), seed))
    if use_ledger and ledger_row is not None:
        return dict(ledger_row)
    if args.report_only:
        raise NotRun
    import keras

    from tfaploss.run.trainer import train
    from tfaploss.training.guards import NonFiniteTrainingError

    cfg = cell_config(args, loss, batch, updates, lr, seed, run_dir)
    keras.backend.clear_session()
    started = time.time()
    row = {"loss": loss, "batch": batch, "updates": updates, "lr": lr, "seed": seed,
           "images": updates * batch}
    try:
        summary = train(cfg, verbose=0)
    except NonFiniteTrainingError as err:
        row.update(status="non-finite", detail=str(err).splitlines()[0])
    else:
        stopped = summary.get("stopped_early")
        row.update(status=f"stopped: {stopped['reason']}" if stopped else "ok",
                   stopped_early=stopped, updates_done=summary.get("updates"),
                   final_loss=summary.get("final_loss"))
        last = (summary.get("history") or [{}])[-1]
        row["emb_cos"] = last.get("emb_cos")
    row["seconds"] = round(time.time() - started, 1)
    if args.val is not None and row["status"] != "non-finite":
        _evaluate(args, row, "val", args.val)
    return _save(metrics_path, row)


def plan(args):
    """The (loss, budget, batch, updates) groups, smallest batch first: a sweep cut
    short has every loss at the batches it reached."""
    for batch in args.batch_sizes:
        for budget in args.budgets:
            for loss in args.losses:
                yield loss, budget, batch, updates_for(args, budget, batch)


def sweep(args):
    results = []
    groups = list(plan(args))
    todo = sum(len(learning_rates(args, b)) + len(args.seeds) - 1 for *_, b, _ in groups)
    done, t0 = 0, time.time()

    def progress(row):
        nonlocal done
        done += 1
        rate = (time.time() - t0) / done
        val = row.get("val_map@r")
        test = row.get("test_map@r")
        print(f"[{done}/{todo}] {row['loss']:>16} B={row['batch']:<5} "
              f"{row['updates']:>4} upd lr={row['lr']:<8g} seed={row['seed']} "
              f"{row['status']:>9}  val MAP@R {_fmt(val)}  test MAP@R {_fmt(test)}  "
              f"({row['seconds']:.0f} s; ~{rate * (todo - done) / 60:.0f} min left)",
              flush=True)

    for loss, budget, batch, updates in groups:
        first, *others = args.seeds
        tried, chosen = [], []
        try:
            for lr, exponent in learning_rates(args, batch).items():
                row = run_cell(args, loss, batch, updates, lr, first)
                row["lr_exponent"] = exponent
                tried.append(row)
                progress(row)
            best = with_test(args, max(
                tried, key=lambda r: (r.get("val_map@r") if args.val else 0) or -1))
            chosen.append(best)
            for s in others:
                chosen.append(with_test(args, run_cell(args, loss, batch, updates,
                                                       best["lr"], s)))
                progress(chosen[-1])
        except NotRun:
            if not chosen:
                continue  # the learning rate is not picked yet: nothing to report
        results.append({"loss": loss, "budget": budget, "batch": batch, "updates": updates,
                        "lr": chosen[0]["lr"], "lr_exponent": chosen[0]["lr_exponent"],
                        "tried": tried, "runs": chosen})
    return results


# -- report --------------------------------------------------------------------------

def _fmt(value, digits=1):
    return "—" if value is None else f"{value:.{digits}f}"


def seed_stats(runs, key):
    """(mean, half-range, count) of ``key`` over the runs that have it (both backends)."""
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return None, None, 0
    spread = (max(values) - min(values)) / 2 if len(values) > 1 else 0.0
    return statistics.fmean(values), spread, len(values)


def _cell_text(group, key):
    mean, spread, n = seed_stats(group["runs"], key)
    if mean is None:
        return "—"
    flags = {r["status"] for r in group["runs"] if r["status"] != "ok"}
    text = f"{mean:.1f} ± {spread:.1f}" if n > 1 else f"{mean:.1f} (1 seed)"
    return text + (f" ({', '.join(sorted(flags))})" if flags else "")


def markdown(args, results) -> str:
    bn = ("frozen BatchNorm (calibrated at init)" if args.freeze_bn else
          "BatchNorm with batch statistics (per chunk under multi-stage), re-estimated "
          "after training")
    setup = (f"Backbone small_cnn from scratch, {args.image_size}² crops, "
             f"{args.embedding_dim}-d, m={args.m}, Adam + cosine, {bn}; "
             f"lr grid {args.base_lr:g}·(B/{args.base_batch})^a, a ∈ {args.lr_exponents}, "
             f"picked on val MAP@R with seed {args.seeds[0]}; seeds {args.seeds}; "
             f"batches > {args.chunk_size} multi-staged. Values: mean ± half-range over "
             "seeds, in %."
             + (f" Evaluated on the first {args.eval_images} images of each split only "
                "(a smoke test)." if args.eval_images else ""))
    lines = [f"# Batch-size sweep on `{args.train}`", "", setup, ""]
    for budget in args.budgets:
        sub = [g for g in results if g["budget"] == budget]
        if not sub:
            continue
        what = (f"equal images seen ({args.images:,} per run)" if budget == "images"
                else f"equal updates ({args.updates} per run)")
        for key, title in (("test_map@r", "MAP@R"), ("test_r@1", "R@1")):
            lines += [f"## Test {title}, {what}", "",
                      "| loss | " + " | ".join(f"B={b}" for b in args.batch_sizes) + " |",
                      "|---|" + "---|" * len(args.batch_sizes)]
            for loss in args.losses:
                cells = []
                for b in args.batch_sizes:
                    g = next((g for g in sub if g["loss"] == loss and g["batch"] == b), None)
                    cells.append(_cell_text(g, key) if g else "—")
                lines.append(f"| {loss} | " + " | ".join(cells) + " |")
            lines.append("")
        lines += [f"Learning rate picked ({what}): " + "; ".join(
            f"{g['loss']} B={g['batch']}: {g['lr']:g} (a={g['lr_exponent']:g})"
            for g in sub), ""]
    header = ("| loss | B | updates | lr | seed | status | val MAP@R | test MAP@R | "
              "test R@1 | final emb_cos | s |")
    lines += ["## Every run", "", header, "|---" * 11 + "|"]
    seen = set()
    for g in results:
        for r in g["tried"] + g["runs"]:
            key = (r["loss"], r["batch"], r["updates"], r["lr"], r["seed"])
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"| {r['loss']} | {r['batch']} | {r['updates']} | {r['lr']:g} | "
                         f"{r['seed']} | {r['status']} | {_fmt(r.get('val_map@r'))} | "
                         f"{_fmt(r.get('test_map@r'))} | {_fmt(r.get('test_r@1'))} | "
                         f"{_fmt(r.get('emb_cos'), 3)} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(args, results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.budgets), figsize=(6 * len(args.budgets), 4.5),
                             squeeze=False)
    # One colour per loss of LOSSES, the same in every plot (tab10 has only ten).
    palette = list(plt.get_cmap("tab10").colors) + ["black", "dimgray", "gold"]
    colour = {name: palette[i % len(palette)] for i, name in enumerate(LOSSES)}
    for ax, budget in zip(axes[0], args.budgets):
        for loss in args.losses:
            xs, ys, es = [], [], []
            for g in results:
                if g["loss"] == loss and g["budget"] == budget:
                    mean, spread, _ = seed_stats(g["runs"], "test_map@r")
                    if mean is not None:
                        xs.append(g["batch"])
                        ys.append(mean)
                        es.append(spread)
            style = "--" if loss in PAIR_LOSSES else "-"
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, linestyle=style, label=loss,
                        color=colour[loss])
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.batch_sizes, [str(b) for b in args.batch_sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel("test MAP@R (%)")
        ax.set_title("equal images seen" if budget == "images" else "equal updates")
        ax.grid(alpha=0.3)
    # Outside the axes: inside, it hid points wherever it went.
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)
    plt.close(fig)


def _shown(path):
    """``path`` relative to the repository when inside it (reports carry no machine paths)."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def write_report(args, results):
    shown = {k: _shown(getattr(args, k)) for k in ("train", "val", "test", "out", "report",
                                                    "ledger")}
    args = argparse.Namespace(**{k: v for k, v in {**vars(args), **shown}.items()
                                 if k not in JAX_ONLY})
    del args.ledger_rows
    out = ROOT / args.report if not Path(args.report).is_absolute() else Path(args.report)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(args, results)
    _write(out / "sweep.md", text)
    _write(out / "sweep.json", json.dumps({"args": vars(args), "results": results}, indent=1,
                                          default=str))
    plot(args, results, out / "sweep.png")
    return text


# -- the JAX backend: one GPU, from an exported array file ----------------------------

def export(args) -> None:
    """Decode the three splits into one xz-compressed .npz of uint8 (N, S, S) images."""
    import hashlib
    import io
    import lzma

    import numpy as np
    import tensorflow as tf

    from tfaploss.data import records

    arrays, fingerprints = {}, {}
    for split in ("train", "val", "test"):
        folder = Path(args.splits) / split
        fingerprints[split] = hashlib.sha256(
            (folder / "manifest.json").read_bytes()).hexdigest()[:16]
        images, labels = [], []
        ds = records.load_split(str(folder), decode=True).map(
            lambda e: (tf.image.resize(tf.image.rgb_to_grayscale(e["image"]),
                                       [args.source_size] * 2, method="area"), e["label"]),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).batch(1024)
        for x, y in ds.as_numpy_iterator():
            grey = np.clip(np.round(x[..., 0]), 0, 255).astype(np.uint8)
            images.append((grey // 16) * 17)
            labels.append(y.astype(np.int32))
        arrays[f"x_{split}"] = np.concatenate(images)
        arrays[f"y_{split}"] = np.concatenate(labels)
        print(f"{split}: {len(arrays[f'y_{split}'])} images, "
              f"{len(np.unique(arrays[f'y_{split}']))} classes", flush=True)
    arrays["fingerprints"] = np.array(json.dumps(fingerprints))
    out = Path(args.export)
    out.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    _write(out, lzma.compress(buffer.getvalue(), preset=6))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")


def _setup_backend(device: str) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_PLATFORMS"] = "cuda" if device == "gpu" else "cpu"
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")


def m_for(batch: int) -> int:
    return max(4, batch // 1024)


class Data:
    """The splits on the device: uint8 images, labels, and per-class index lists."""

    def __init__(self, path, limit=0):
        import io
        import lzma

        import jax.numpy as jnp
        import numpy as np

        with np.load(io.BytesIO(lzma.decompress(Path(path).read_bytes()))) as f:
            raw = {k: f[k] for k in f.files}
        self.fingerprints = json.loads(str(raw.pop("fingerprints")))
        for split in ("train", "val", "test"):
            x, y = raw[f"x_{split}"], raw[f"y_{split}"]
            if limit:
                x, y = x[:limit], y[:limit]
            setattr(self, f"x_{split}", jnp.asarray(x))
            setattr(self, f"y_{split}", y)
        self.classes = np.unique(self.y_train)

    def batches(self, batch, m, seed, steps):
        """``steps`` class-balanced index batches: B/m classes, m images of each (the
        sampler of the cached-feature tier, so both draw the same batches)."""
        from tfaploss.data.samplers import m_per_class_rows

        for idx in m_per_class_rows(self.y_train, batch, m, seed).take(steps).as_numpy_iterator():
            yield idx.astype("int32")


def _augment(images_u8, key):
    """Random resized crops (60-100 % of the area, aspect 3/4-4/3) to CROP², bilinear."""
    import jax
    import jax.numpy as jnp

    n, s = images_u8.shape[0], images_u8.shape[1]
    k1, k2, k3, k4 = jax.random.split(key, 4)
    area = jax.random.uniform(k1, (n,), minval=0.6, maxval=1.0) * s * s
    log_ratio = jax.random.uniform(k2, (n,), minval=math.log(3 / 4), maxval=math.log(4 / 3))
    ratio = jnp.exp(log_ratio)
    w = jnp.clip(jnp.sqrt(area * ratio), 1.0, s)
    h = jnp.clip(jnp.sqrt(area / ratio), 1.0, s)
    y0 = jax.random.uniform(k3, (n,)) * (s - h)
    x0 = jax.random.uniform(k4, (n,)) * (s - w)
    grid = (jnp.arange(CROP) + 0.5) / CROP
    ys = y0[:, None] + grid[None] * h[:, None] - 0.5        # (n, CROP) source rows
    xs = x0[:, None] + grid[None] * w[:, None] - 0.5
    images = images_u8.astype(jnp.float32)

    def interp(coords, axis_len):
        c = jnp.clip(coords, 0, axis_len - 1)
        lo = jnp.floor(c).astype(jnp.int32)
        hi = jnp.minimum(lo + 1, axis_len - 1)
        return lo, hi, c - lo

    ylo, yhi, wy = interp(ys, s)
    xlo, xhi, wx = interp(xs, s)
    rows = lambda idx: jnp.take_along_axis(images, idx[:, :, None], axis=1)
    top, bottom = rows(ylo), rows(yhi)                       # (n, CROP, s)
    mixed = top * (1 - wy[..., None]) + bottom * wy[..., None]
    cols = lambda idx: jnp.take_along_axis(mixed, idx[:, None, :], axis=2)
    out = cols(xlo) * (1 - wx[:, None]) + cols(xhi) * wx[:, None]
    return jnp.repeat(out[..., None], 3, axis=-1)   # the models take RGB


def _centre(images_u8):
    s = images_u8.shape[1]
    o = (s - CROP) // 2
    import jax.numpy as jnp

    return jnp.repeat(images_u8[:, o:o + CROP, o:o + CROP, None].astype("float32"), 3, -1)


def build_model(seed):
    import keras

    from tfaploss.models.embedding import build_embedding_model

    keras.utils.set_random_seed(seed)
    return build_embedding_model(
        backbone="small_cnn", input_shape=(CROP, CROP, 3), embedding_dim=EMBEDDING_DIM,
        pooling="gem", weights=None, backbone_kwargs={"widths": WIDTHS})


class Runner:
    """One jitted train step per (loss, batch), shared by every seed and learning rate
    (weights, optimizer state and the learning rate are its arguments)."""

    def __init__(self, data):
        import jax

        self.data = data
        self.template = build_model(0)
        self._steps = {}
        self._embed = jax.jit(self._embed_fn)

    def _embed_fn(self, tv, ntv, x):
        out, _ = self.template.stateless_call(tv, ntv, _centre(x), training=False)
        return out

    def step_fn(self, loss_name, batch):
        key = (loss_name, batch)
        if key in self._steps:
            return self._steps[key]
        import jax
        import keras

        import tfaploss.losses as L

        cls, kwargs = LOSSES[loss_name]
        loss = getattr(L, cls)(**kwargs)
        model = self.template

        # the images are an argument: a closed-over array would become a constant of
        # the compiled program
        def step(tv, ntv, ov, lr_index, lr, images, idx, labels, rng):
            x = _augment(images[idx], rng)

            def objective(tv):
                emb, ntv2 = model.stateless_call(tv, ntv, x, training=True)
                return loss(labels, emb), (ntv2, emb)

            (value, (ntv2, emb)), grads = jax.value_and_grad(objective, has_aux=True)(tv)
            ov = list(ov)
            ov[lr_index] = lr
            tv2, ov2 = self.optimizer.stateless_apply(ov, grads, tv)
            gnorm = keras.ops.sqrt(sum(keras.ops.sum(g * g) for g in grads))
            mean_cos = keras.ops.mean(keras.ops.matmul(emb, keras.ops.transpose(emb)))
            return tv2, ntv2, ov2, value, gnorm, mean_cos

        self._steps[key] = jax.jit(step, static_argnums=(3,), donate_argnums=(0, 1, 2))
        return self._steps[key]

    def train(self, loss_name, batch, lr, seed, updates):
        import jax
        import jax.numpy as jnp
        import keras
        import numpy as np

        model = build_model(seed)
        self.optimizer = keras.optimizers.Adam(learning_rate=lr)
        self.optimizer.build(model.trainable_variables)
        lr_var = self.optimizer._learning_rate
        lr_index = next(i for i, v in enumerate(self.optimizer.variables) if v is lr_var)
        step = self.step_fn(loss_name, batch)
        tv = [v.value for v in model.trainable_variables]
        ntv = [v.value for v in model.non_trainable_variables]
        ov = [v.value for v in self.optimizer.variables]
        rng = jax.random.PRNGKey(seed)
        m = m_for(batch)
        history, t0, status = [], time.perf_counter(), "ok"
        for i, idx in enumerate(self.data.batches(batch, m, seed, updates)):
            lr_t = 0.5 * lr * (1 + math.cos(math.pi * i / updates))
            rng, sub = jax.random.split(rng)
            labels = jnp.asarray(self.data.y_train[idx])
            tv, ntv, ov, value, gnorm, cos = step(
                tv, ntv, ov, lr_index, jnp.float32(lr_t), self.data.x_train, jnp.asarray(idx),
                labels, sub)
            if i % 8 == 0 or i == updates - 1:
                value, gnorm, cos = (float(v) for v in (value, gnorm, cos))
                history.append({"update": i, "loss": value, "grad_norm": gnorm,
                                "mean_cos": cos})
                if not np.isfinite(value):
                    status = "non-finite loss"
                    break
        jax.block_until_ready(tv)
        seconds = time.perf_counter() - t0
        return tv, ntv, history, seconds, status

    def embed(self, tv, ntv, x):
        import jax.numpy as jnp

        parts = []
        for start in range(0, x.shape[0], EVAL_CHUNK):
            chunk = x[start:start + EVAL_CHUNK]
            pad = EVAL_CHUNK - chunk.shape[0]
            if pad:
                chunk = jnp.concatenate([chunk, jnp.zeros((pad,) + chunk.shape[1:], chunk.dtype)])
            parts.append(self._embed(tv, ntv, chunk)[:EVAL_CHUNK - pad])
        return jnp.concatenate(parts)


def retrieval(embeddings, labels):
    """MAP@R and R@1 (%) of each item against all others (itself excluded), exact, by
    ``tfaploss.evaluation.retrieval_metrics``; a query whose class has no other item
    cannot be answered and is left out, as the sweep's tables always did."""
    import numpy as np

    from tfaploss.evaluation.retrieval import retrieval_metrics

    embeddings = np.asarray(embeddings, dtype="float32")
    labels = np.asarray(labels)
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    queries = np.flatnonzero(counts[inverse] > 1)
    metrics = retrieval_metrics(embeddings[queries], labels[queries], embeddings, labels,
                                ks=(1,), exclude=queries)
    return 100 * metrics["map@r"], 100 * metrics["recall@1"]


def jax_run(args) -> None:
    _setup_backend(args.device)
    import jax
    import keras

    keras.mixed_precision.set_global_policy(args.precision)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ledger = out / (REPEAT_LEDGER if args.repeat else LEDGER)
    done = {(r["loss"], r["batch"], r["lr"], r["seed"]): r for r in read_runs(ledger)}
    data = Data(args.array_file, args.limit)
    runner = Runner(data)
    print(f"devices: {jax.devices()}; keras {keras.__version__}, jax {jax.__version__}; "
          f"train {len(data.y_train)} images / {len(data.classes)} classes, "
          f"test {len(data.y_test)}", flush=True)
    losses, batches, seeds = args.losses, args.batch_sizes, args.seeds
    t_start = time.perf_counter()

    def one(loss, batch, lr, seed, with_test):
        key = (loss, batch, lr, seed)
        if key in done:
            return done[key]
        if args.deadline and time.perf_counter() - t_start > args.deadline:
            return None
        t0 = time.perf_counter()
        tv, ntv, history, seconds, status = runner.train(loss, batch, lr, seed, args.updates)
        row = {"loss": loss, "batch": batch, "m": m_for(batch), "lr": lr, "seed": seed,
               "precision": args.precision,
               "updates": args.updates, "images": batch * args.updates, "status": status,
               "train_seconds": round(seconds, 2), "history": history,
               "data": data.fingerprints, "device": str(jax.devices()[0]),
               "device_kind": jax.devices()[0].device_kind}
        if status == "ok":
            row["val_map@r"], row["val_r@1"] = retrieval(
                runner.embed(tv, ntv, data.x_val), data.y_val)
            if with_test:
                row["test_map@r"], row["test_r@1"] = retrieval(
                    runner.embed(tv, ntv, data.x_test), data.y_test)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        with open(ledger, "a") as f:
            f.write(json.dumps(row) + "\n")
        done[key] = row
        print(f"{loss:>17s} B={batch:<6d} lr={lr:<8.2g} seed={seed} {status}: val MAP@R "
              f"{row.get('val_map@r', float('nan')):5.1f}, test MAP@R "
              f"{row.get('test_map@r', float('nan')):5.1f}, R@1 "
              f"{row.get('test_r@1', float('nan')):5.1f}; final loss "
              f"{history[-1]['loss']:.4f}, mean cos {history[-1]['mean_cos']:.3f}; "
              f"{seconds:.1f} s train, {row['seconds']:.1f} s all "
              f"(t={time.perf_counter() - t_start:.0f} s)", flush=True)
        return row

    def lr_grid(batch):
        return [round(args.base_lr * (batch / args.base_batch) ** a, 6)
                for a in args.lr_exponents]

    # every cell's tuning runs first (seed 0, with test metrics: one of them is kept)
    for batch in batches:
        for loss in losses:
            for lr in lr_grid(batch):
                one(loss, batch, lr, seeds[0], with_test=True)
    for seed in ([] if args.repeat else seeds[1:]):
        for batch in batches:
            for loss in losses:
                picked = pick(done, loss, batch, lr_grid(batch), seeds[0])
                if picked is not None:
                    one(loss, batch, picked, seed, with_test=True)
    jax_write_report(args, read_runs(out / LEDGER))


def read_runs(path):
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def pick(done, loss, batch, lrs, seed0):
    tried = [done.get((loss, batch, lr, seed0)) for lr in lrs]
    tried = [r for r in tried if r is not None]
    if len(tried) < len(lrs):
        return None
    return max(tried, key=lambda r: r.get("val_map@r", -1.0))["lr"]


def jax_cells(rows, args):
    """{(loss, batch): (picked lr, [test rows at that lr], tried)}."""
    by = {}
    for r in rows:
        by.setdefault((r["loss"], r["batch"]), []).append(r)
    table = {}
    for (loss, batch), group in by.items():
        lrs = [round(args.base_lr * (batch / args.base_batch) ** a, 6)
               for a in args.lr_exponents]
        seed0 = min(r["seed"] for r in group)
        index = {(r["lr"], r["seed"]): r for r in group}
        tried = [index[(lr, seed0)] for lr in lrs if (lr, seed0) in index]
        if not tried:
            continue
        # a cell whose tuning a deadline cut short is shown, marked (markdown: †)
        best = max(tried, key=lambda r: r.get("val_map@r", -1.0))["lr"]
        runs = [r for r in group if r["lr"] == best and "test_map@r" in r]
        table[(loss, batch)] = (best, runs, tried)
    return table


def jax_markdown(args, rows) -> str:
    table = jax_cells(rows, args)
    rates = [f"{a:g}" for a in args.lr_exponents]
    losses = [s for s in args.losses if any(k[0] == s for k in table)]
    batches = sorted({k[1] for k in table})
    device = rows[0].get("device", "?") if rows else "?"
    lines = [f"Keras on JAX, {device}; backbone small_cnn widths {WIDTHS} from scratch, "
             f"{CROP}² crops, {EMBEDDING_DIM}-d; {args.updates} updates per run (equal "
             f"updates); m = max(4, B/1024); lr = {args.base_lr:g}·(B/{args.base_batch})^a, "
             f"a ∈ {{{','.join(rates)}}} picked on val with seed 0. Test MAP@R (R@1), "
             "mean ± half-range over seeds (n), as in batch_sweep.py. Peers in the same table: "
             + ", ".join(p for p in PAIR_LOSSES if p in losses) + ".", ""]
    lines.append("| loss | " + " | ".join(f"B={b}" for b in batches) + " |")
    lines.append("|---" * (len(batches) + 1) + "|")
    for loss in losses:
        cells_text = []
        for b in batches:
            entry = table.get((loss, b))
            if not entry or not entry[1]:
                cells_text.append("—")
                continue
            lr, runs, _ = entry
            mean, spread, n = seed_stats(runs, "test_map@r")
            r1 = seed_stats(runs, "test_r@1")[0]
            text = f"{mean:.1f}" + (f" ± {spread:.1f}" if n > 1 else "")
            short = "†" if len(entry[2]) < len(rates) else ""
            cells_text.append(f"{text} ({r1:.1f}) n={len(runs)}, lr {lr:g}{short}")
        lines.append(f"| {loss} | " + " | ".join(cells_text) + " |")
    if any(len(tried) < len(rates) for _, _, tried in table.values()):
        lines += ["", "†: tuned on fewer rates than the grid (a deadline stopped the run)."]
    lines += ["", "Validation MAP@R of every learning rate tried (seed 0):", "",
              "| loss | B | " + " | ".join(f"a={a}" for a in rates)
              + " | train s (fastest run) |", "|---|---|" + "---|" * (len(rates) + 1)]
    for (loss, b), (_, _, tried) in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        vals = " | ".join([f"{r.get('val_map@r', float('nan')):.1f} (lr {r['lr']:g})"
                           for r in tried] + ["—"] * (len(rates) - len(tried)))
        # the first run of a (loss, batch) in a process also pays XLA's compile and,
        # on a GPU, its convolution autotuning at the new batch (up to ~140 s here)
        secs = min(r["train_seconds"] for r in tried)
        lines.append(f"| {loss} | {b} | {vals} | {secs:.1f} |")
    return "\n".join(lines) + "\n"


def repeat_markdown(rows, repeats) -> str:
    """The same (loss, B, lr, seed) trained twice: how far apart the two runs land.

    GPU kernels are not bitwise deterministic (XLA's atomics, the convolution
    algorithm that autotuning picks on each machine), so a seed fixes the data order and
    the initialisation but not the run. The gap between two such runs is a floor under
    any difference between cells that the table can resolve.
    """
    first = {(r["loss"], r["batch"], r["lr"], r["seed"]): r for r in rows}
    pairs = [(first[k], r) for r in repeats
             if (k := (r["loss"], r["batch"], r["lr"], r["seed"])) in first
             and "val_map@r" in first[k] and "val_map@r" in r]
    if not pairs:
        return ""
    gaps = sorted(abs(a["val_map@r"] - b["val_map@r"]) for a, b in pairs)
    kinds = sorted({r.get("device_kind", r.get("device", "?")) for r in repeats})
    lines = ["", (f"Run-to-run repeat ({REPEAT_LEDGER}, on {', '.join(kinds)}): the seed-0 "
             f"tuning runs trained again. Validation (test) MAP@R, first run → repeat; "
             f"|Δ val| median {statistics.median(gaps):.1f}, max {gaps[-1]:.1f} over "
             f"{len(pairs)} runs."), "",
             "| loss | B | lr | first | repeat | Δ val |", "|---|---|---|---|---|---|"]
    for a, b in pairs:
        lines.append(f"| {a['loss']} | {a['batch']} | {a['lr']:g} | {a['val_map@r']:.1f} "
                     f"({a.get('test_map@r', float('nan')):.1f}) | {b['val_map@r']:.1f} "
                     f"({b.get('test_map@r', float('nan')):.1f}) | "
                     f"{b['val_map@r'] - a['val_map@r']:+.1f} |")
    return "\n".join(lines) + "\n"


def jax_plot(args, rows, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    table = jax_cells(rows, args)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for loss in args.losses:
        pts = sorted((b, seed_stats(runs, "test_map@r")[:2])
                     for (name, b), (_, runs, _) in table.items() if name == loss and runs)
        if not pts:
            continue
        xs = [b for b, _ in pts]
        means = [mean for _, (mean, _) in pts]
        errs = [spread for _, (_, spread) in pts]
        ax.errorbar(xs, means, yerr=errs, marker="o", capsize=3, label=loss,
                    linestyle="--" if loss in PAIR_LOSSES else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("test MAP@R (%)")
    ax.set_title(f"Glyphs, JAX on GPU, {args.updates} updates per run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    return True


def jax_write_report(args, rows) -> None:
    out, report = Path(args.out), Path(args.report)
    text = jax_markdown(args, rows) + repeat_markdown(rows, read_runs(out / REPEAT_LEDGER))
    _write(report / "sweep_jax.md", text)
    jax_plot(args, rows, report / "sweep_jax.png")
    print(text, flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.backend == "jax":
        if args.export:
            export(args)
        elif args.report_only:
            jax_write_report(args, read_runs(Path(args.out) / LEDGER))
        else:
            jax_run(args)
        return 0
    if args.dry_run:
        for loss, budget, batch, updates in plan(args):
            print(f"{loss:>16} {budget:>7} B={batch:<5} {updates:>4} updates, lr "
                  f"{sorted(learning_rates(args, batch))}, seeds {args.seeds}")
        return 0
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    results = sweep(args)
    print(write_report(args, results))
    print(f"report: {Path(args.report) / 'sweep.md'}, {Path(args.report) / 'sweep.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
