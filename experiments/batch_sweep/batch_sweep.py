"""Every loss x batch size on a retrieval set: MAP@R and R@1 on unseen classes.

The papers' claim: optimising AP directly beats pair and triplet losses, and gains more
as the batch grows (Revaud et al. ICCV'19 Fig. 4 / Table 2; Smooth-AP, ROADMAP). This
sweep measures it on any set a ``pipelines`` job wrote (train / val / test splits with
disjoint classes), by default the CJK glyph set of ``make data-glyphs``.

Protocol (the same for every cell, stated in the report):

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

Every finished cell (loss, batch, updates, lr, seed) is cached under ``--out`` (its
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", default=str(DEFAULT_DATA / "train"),
                   help="training split (by-class TFRecords of a pipelines job)")
    p.add_argument("--val", default=str(DEFAULT_DATA / "val"),
                   help="validation split (classes disjoint from train and test) used to "
                        "pick the learning rate; 'none' disables tuning")
    p.add_argument("--test", default=str(DEFAULT_DATA / "test"),
                   help="test split (classes never seen in training)")
    p.add_argument("--losses", default=",".join(LOSSES),
                   help=f"comma-separated, from {', '.join(LOSSES)}")
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
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else FULL
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
    if args.val.lower() == "none":
        args.val = None
    for split in ("train", "val", "test"):
        path = getattr(args, split)
        if path is not None and not (Path(path) / "manifest.json").is_file():
            p.error(f"--{split} {path!r} holds no manifest.json: not a split written by a "
                    "pipelines job. Build the glyph set with `make data-glyphs`, or pass "
                    "the split folders of another job.")
    args.report = args.report or args.out
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

    return {split: hashlib.sha256((Path(getattr(args, split)) / "manifest.json")
                                  .read_bytes()).hexdigest()[:16]
            for split in ("train", "val", "test") if getattr(args, split) is not None}


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
    if old.get("data") and old["data"] != args.data:
        differ.append("data (split manifests)")
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


def _ints(text, flag, minimum=1):
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


def _save(path: Path, row: dict) -> dict:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(row, indent=1))
    os.replace(tmp, path)
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
    """(mean, half-range, count) of ``key`` over the runs that have it; shared with
    ``batch_sweep_jax.py`` so that both sweeps report spreads alike."""
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
    args = argparse.Namespace(**{**vars(args), **shown})
    del args.ledger_rows
    out = ROOT / args.report if not Path(args.report).is_absolute() else Path(args.report)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(args, results)
    for name, content in (("sweep.md", text),
                          ("sweep.json", json.dumps({"args": vars(args), "results": results},
                                                    indent=1, default=str))):
        tmp = out / (name + ".tmp")
        tmp.write_text(content)
        os.replace(tmp, out / name)
    plot(args, results, out / "sweep.png")
    return text


def main(argv=None):
    args = parse_args(argv)
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
