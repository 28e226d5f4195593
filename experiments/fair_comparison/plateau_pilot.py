"""The pre-registered study's plateau pilot (docs/batch_sweep.md): the smallest
power-of-two image budget at which the runs plateau, for every loss at its default
setting (the loss's own defaults; learning rate 1e-3, or the best of ``--lrs``),
measured on the validation classes only.

    python experiments/fair_comparison/plateau_pilot.py \\
        --config experiments/fair_comparison/glyphs_pretrained.yaml --val data/glyphs/val \\
        --cache experiments/fair_comparison/results/study_strong --batch 4096 \\
        --out experiments/fair_comparison/results/plateau_strong.json

Every loss runs at the powers of two from ``--start`` images (at most ``--largest``), at
each learning rate of ``--lrs``; a loss's score at a budget is its best over them (its
run at that rate is the one measured), so the plateau is that of runs whose learning
rate was picked, as the study's are (amendment 6 in docs/batch_sweep.md); ``--knobs``
moves a loss's knobs off its defaults (a record keeps each setting's runs apart). Two
measures, both on every validation class: the pre-registered one, how much the last
fifth of a run moves validation MAP@R (at 4/5 of its updates and at its end), and the
amended one, how much more any larger budget tried scores. The pre-registered measure
alone cannot fail under the cosine schedule to 0, whose last fifth takes steps of almost
no size (the amendment and its measurement are in docs/batch_sweep.md). A budget I is
the plateau when, for every loss, both are below 0.2, with at least one larger budget
tried: the budgets run in turn until the next one confirms a plateau, up to
``--largest``.

``--cache`` is the study's output folder, so that the pilot and the study train on the
same cached features. The pilot runs at the largest batch of the study: an image budget
gives a smaller batch more updates, so the largest batch is the last to plateau. Prints
one line per run; the JSON record (written to a temporary name first, after every run)
holds every run and the budget found, and a second call resumes it; the plot (the
record's name, .png) shows every run, a panel per loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LOSSES = "SmoothAP,FastAP,ROADMAP,RSk,Triplet,SupCon,MultiSimilarity"
THRESHOLD = 0.2
LR = 1e-3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--cache", required=True, help="the study's output folder (features)")
    p.add_argument("--out", required=True, help="the JSON record")
    p.add_argument("--losses", default=LOSSES)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--start", type=int, default=65536, help="the first image budget")
    p.add_argument("--largest", type=int, default=1 << 20, help="the last budget tried")
    p.add_argument("--seed", type=int, default=1000, help="a tuning seed (not evaluated)")
    p.add_argument("--lrs", default=str(LR),
                   help="comma-separated learning rates; each budget keeps a loss's best")
    p.add_argument("--knobs", default="",
                   help="knobs away from a loss's defaults, e.g. SupCon:temperature=0.023,"
                        "SmoothAP:temperature=0.001 (rows at other knobs do not count)")
    args = p.parse_args(argv)
    lrs = [float(v) for v in args.lrs.split(",")]
    knobs = _parse_knobs(args.knobs)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    from tfaploss.compare.features import FeatureRunner, extract_features
    from tfaploss.compare.protocol import RunSpec
    from tfaploss.config import load_config
    from tfaploss.durable.atomic import atomic_write_json

    cfg = load_config(args.config, [], warn=False)
    data = extract_features(cfg, {"train": cfg.data.train, "val": args.val,
                                  "test": cfg.data.test}, args.cache)
    # curve_classes=None: the curve is scored on every validation class; the test
    # classes are scored too (the runner does so with a curve) but never read here.
    runner = FeatureRunner(data, m=cfg.data.m, curve_points=5, curve_classes=None,
                           test_classes=10)
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    # rows from before several rates were tried carry the record's one rate
    for r in record["runs"]:
        r.setdefault("lr", record.get("lr", LR))
    record.pop("lr", None)
    record.update(batch=args.batch, threshold=THRESHOLD, config=args.config)
    done = {_key(r["loss"], r["images"], r["lr"], r.get("knobs", {})): r
            for r in record["runs"]}
    record.update(rule="plateau at I: for every loss, the last fifth of the run at I "
                       "moves validation MAP@R by < threshold, and no budget tried above "
                       "I scores more than threshold above I; at least one budget above I "
                       "is tried (the largest tried only confirms); a loss's score at a "
                       "budget is its best over the learning rates tried there")

    def measured(loss, images, lr):
        key = _key(loss, images, lr, knobs.get(loss, {}))
        row = done.get(key)
        if row is None:
            updates = max(1, images // args.batch)
            params = tuple(sorted({"lr": lr, **knobs.get(loss, {})}.items()))
            spec = RunSpec(loss, params, args.batch, updates, args.seed, True)
            result = runner(spec)
            curve = result.get("curve") or []
            row = {"loss": loss, "images": images, "lr": lr,
                   **({"knobs": knobs[loss]} if knobs.get(loss) else {}), "updates": updates,
                   "status": result["status"], "val_map@r": result.get("val_map@r"),
                   "curve": curve, "seconds": result["seconds"],
                   "last_fifth": (abs(curve[-1][1] - curve[-2][1]) if len(curve) >= 2
                                  else None)}
            record["runs"].append(row)
            done[key] = row
            atomic_write_json(out, record)
        print(f"{images:>9,} images ({row['updates']} u) {loss:16s} lr {lr:.2g} val "
              f"{_num(row['val_map@r'])}, last fifth moved {_num(row['last_fifth'])} "
              f"({row['status']}, {row['seconds']:.0f} s)", flush=True)
        return row

    losses = args.losses.split(",")
    budgets = []
    images = args.start
    while images <= args.largest:
        budgets.append(images)
        images *= 2
    # What the record already holds at budgets not yet run at every rate (earlier runs
    # at fewer rates) counts against a plateau too: a loss's best there is a lower bound
    # of its best over all the rates, so a gain it shows is real (a curve can be flat
    # for a few doublings and then climb; the strong regime's was at 1e-3).
    val = {}
    for loss in losses:
        for i in sorted({r["images"] for r in record["runs"] if r["loss"] == loss}):
            rows = [done[k] for k in (_key(loss, i, lr, knobs.get(loss, {})) for lr in lrs)
                    if k in done]
            if rows:
                val[(loss, i)] = _best(rows)
    # Budget by budget, cheapest first, until a larger one confirms a plateau: a pilot
    # cut short keeps its budgets, and none is run past the one that confirms.
    plateau, tried = None, []
    for i in budgets:
        val.update({(loss, i): _best([measured(loss, i, lr) for lr in lrs])
                    for loss in losses})
        tried.append(i)
        plateau = _plateau(tried, losses, val)
        if plateau:
            break
    for i in tried:
        gains = _gains(i, losses, val)
        fifths = {loss: val[(loss, i)]["last_fifth"] for loss in losses}
        if len(lrs) > 1:
            print(f"{i:>9,} images: best rates " + ", ".join(
                f"{loss} {val[(loss, i)]['lr']:.2g} ({_num(val[(loss, i)]['val_map@r'])})"
                for loss in losses), flush=True)
        print(f"{i:>9,} images: more images gain at most "
              + ", ".join(f"{loss} {_num(g)}" for loss, g in gains.items())
              + "; last fifth moved " + ", ".join(f"{_num(f)}" for f in fifths.values()),
              flush=True)
    record["plateau_images"] = plateau
    atomic_write_json(out, record)
    figure = _plot(record, losses, lrs, out.with_suffix(".png"), knobs)
    if figure:
        print(f"plot: {figure}", flush=True)
    print(f"plateau: {plateau:,} images" if plateau else
          f"no plateau up to {tried[-1]:,} images (a larger budget must confirm one)",
          flush=True)


def _plateau(tried, losses, val):
    """The smallest budget of ``tried`` (ascending; run at every rate) where, for every
    loss, the last fifth moved validation by < THRESHOLD and no larger budget in ``val``
    scores THRESHOLD more; the largest tried can only confirm (nothing tried above it
    to measure the gain)."""
    for i in tried[:-1]:
        gains = _gains(i, losses, val).values()
        fifths = [val[(loss, i)]["last_fifth"] for loss in losses]
        if all(g < THRESHOLD for g in gains) and all(
                f is not None and f < THRESHOLD for f in fifths):
            return i
    return None


def _parse_knobs(text: str) -> dict:
    """``"SupCon:temperature=0.023,..."`` -> ``{"SupCon": {"temperature": 0.023}}``."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        loss, _, setting = item.partition(":")
        name, _, value = setting.partition("=")
        if not (loss and name and value):
            raise SystemExit(f"--knobs: {item!r} is not LOSS:KNOB=VALUE")
        out.setdefault(loss, {})[name] = float(value)
    return out


def _key(loss, images, lr, knobs) -> tuple:
    return loss, images, lr, tuple(sorted(knobs.items()))


def _best(rows):
    """The row of the learning rate that scores best on validation (a failed run, with
    no score, only when every rate failed)."""
    return max(rows, key=lambda r: (r.get("val_map@r") is not None,
                                    r.get("val_map@r") or 0.0))


def _gains(i, losses, val):
    """``{loss: the most a budget in val above i scores over i}`` (None: none above)."""
    return {loss: max((_gain(val[(loss, i)], row) for (name, j), row in val.items()
                       if name == loss and j > i), default=None) for loss in losses}


def _gain(row, later):
    """How much more validation MAP@R ``later`` (more images) scores; a failed run
    (no score) counts as no gain."""
    a, b = row.get("val_map@r"), later.get("val_map@r")
    return 0.0 if a is None or b is None else b - a


def _plot(record, losses, lrs, path, knobs=None):
    """Validation MAP@R against the image budget, a panel per loss (its runs at
    ``knobs[loss]``, default: its defaults) and a line per learning rate, the budget
    found marked; written to a temporary name and renamed. None without matplotlib."""
    knobs = knobs or {}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from tfaploss.durable.atomic import atomic_write

    fig, axes = plt.subplots(1, len(losses), figsize=(4 * len(losses), 3.6), sharey=True,
                             squeeze=False)
    for ax, loss in zip(axes[0], losses):
        for lr in lrs:
            rows = sorted((r for r in record["runs"] if r["loss"] == loss and r["lr"] == lr
                           and r.get("knobs", {}) == knobs.get(loss, {})
                           and r.get("val_map@r") is not None), key=lambda r: r["images"])
            ax.plot([r["images"] for r in rows], [r["val_map@r"] for r in rows], marker="o",
                    label=f"lr {lr:.2g}")
        if record.get("plateau_images"):
            ax.axvline(record["plateau_images"], color="black", linestyle=":",
                       label="plateau")
        ax.set_xscale("log", base=2)
        ax.set_title(" ".join([loss, *(f"{k} {v:.2g}" for k, v in
                                        knobs.get(loss, {}).items())]), fontsize=10)
        ax.set_xlabel(f"images (B = {record['batch']})")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation MAP@R (%)")
    axes[0][0].legend(fontsize=8)
    found = (f"plateau at {record['plateau_images']:,} images" if record.get("plateau_images")
             else "no plateau found")
    fig.suptitle(f"{record['config']}: one run per point; {found}", fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path


def _num(value):
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
