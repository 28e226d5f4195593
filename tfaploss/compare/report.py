"""The comparison's tables (markdown) and figures (PNG): the baselines (frozen
features, PCA), test MAP@R with 95 % intervals per (budget, loss, batch), each loss's
difference from the frozen features and its paired difference against the best peer,
the settings each tuning picked (those at the edge of their range flagged), and the
validation curves of the evaluation runs."""

from __future__ import annotations

import math
import os
from pathlib import Path

from tfaploss.compare.protocol import (
    AP_LOSSES,
    EDGE,
    LR_RANGE,
    PEERS,
    SEARCH_SPACES,
    TRIALS_RULE,
    settings_text,
)
from tfaploss.durable import atomic

BASELINE_NAMES = {"frozen": "frozen features (no head)",
                  "pca": "PCA of the training features"}


def _num(value, digits=1):
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _cell(r) -> str:
    text = _num(r["test_map@r"])
    if math.isfinite(r.get("ci95") or float("nan")):
        text += f" ± {_num(r['ci95'])}"
    if r["budget"] == "seconds":  # each loss's updates in the same time
        text += f" ({r['updates']} u)"
    bad = [s for s in r["statuses"] if s != "ok"]
    if bad:
        text += f" ({len(bad)}/{len(r['statuses'])} {', '.join(sorted(set(bad)))})"
    return text


def _pair(diff, is_best=False) -> str:
    if diff is None:
        return "best peer" if is_best else "–"
    mean, half = diff
    if not math.isfinite(mean):
        return "–"
    return f"{mean:+.1f} ± {_num(half)}" if math.isfinite(half) else f"{mean:+.1f}"


def _column(r, batch) -> str:
    if r["budget"] == "seconds":
        return f"B={batch} ({r['budget_seconds']:g} s)"
    return f"B={batch} ({r['updates']} u, {r['images']:,} im)"


def search_words(protocol, settings_from: str | None = None) -> str:
    """How the settings were searched, in words."""
    lr = f"lr in [{protocol.lr_range[0]:g}, {protocol.lr_range[1]:g}] (log)"
    if protocol.search() == "carried":
        return (f"the settings of `{settings_from}` at lr x "
                f"{', '.join(f'{f:g}' for f in protocol.lr_factors)}")
    if protocol.search() == "grid":
        return (f"a grid: {protocol.grid} learning rates log-spaced over {lr} x "
                f"{protocol.grid_knob_points} point(s) of each knob of the loss (its "
                "range's middle for one point), every point tried")
    counts = ", ".join(f"{loss} {protocol.trials_for(loss)}" for loss in protocol.losses)
    return (f"Optuna TPE over {lr} and each loss's knobs, base {protocol.trials} trials "
            f"({TRIALS_RULE}: {counts})")


def interval_words(protocol) -> str:
    if protocol.tuning_repeats > 1:
        by = (", each picking on its own class-disjoint fold of the validation classes"
              if protocol.folds else "")
        return (f"mean ± 95 % t-interval over the {protocol.tuning_repeats} tuning "
                f"repeats' means{by} ({protocol.tuning_repeats} x {len(protocol.seeds)} "
                "(repeat, seed) runs per cell: tuning noise and seed noise)")
    return (f"mean ± 95 % t-interval over the {len(protocol.seeds)} evaluation seeds (one "
            "tuning: seed noise only, not the tuning's; --tuning-repeats adds it)")


def header(*, tier, config, val, protocol, m, setup, runs, hours, quick=False,
           settings_from=None) -> str:
    """The report's opening paragraph: what was compared, how, and at what cost."""
    repeats = protocol.tuning_repeats
    seeds = ", ".join(map(str, protocol.seeds))
    head = ""
    if tier == "features":
        head = (f" Head `{setup.get('head')}`"
                + (" (full width, the identity at step 0)" if setup.get("head") != "mlp"
                   else " (random start)") + ".")
    text = (f"## tfaploss compare: {tier} tier\n\nConfig `{config}`, validation `{val}`; "
            f"losses {', '.join(protocol.losses)}; {search_words(protocol, settings_from)}; "
            f"{repeats} tuning repeat(s) (tuning seed {protocol.tuning_seed}"
            + (" + r for repeat r" if repeats > 1 and not protocol.folds
               else "; repeat r picks on validation fold r" if repeats > 1 else "")
            + f"); evaluation seeds {seeds}"
            + (" (repeat r runs seed s as s + 10000 r)" if repeats > 1 else "")
            + f"; m={m}.{head} Intervals: {interval_words(protocol)}. The best peer of a "
            "cell is chosen on the validation classes. Setup: "
            + ", ".join(f"{k} {v}" for k, v in setup.items() if k != "tier")
            + f". Cost: {runs} runs, {hours:.2f} hours of run time (wall clock of each run "
            "on this machine, summed).")
    if quick:
        text += ("\n\n**--quick**: a first look that the command runs on your data. Its "
                 "few trials and 2 seeds make the intervals not informative; drop "
                 "--quick for an answer.")
    return text


def _baseline_table(baselines: dict) -> list[str]:
    lines = ["", "### Baselines (no training, same validation and test classes)", "",
             "| baseline | dim | val MAP@R | test MAP@R | test R@1 |", "|---|---|---|---|---|"]
    for name, b in baselines.items():
        lines.append(f"| {BASELINE_NAMES[name]} | {b['dim']} | {_num(b['val_map@r'])} | "
                     f"{_num(b['test_map@r'])} | {_num(b['test_r@1'])} |")
    return lines


def edge_summary(results: list[dict], lr_range=LR_RANGE) -> str:
    """One line: how many picks have a knob in the outer :data:`EDGE` of its range."""
    picks = [(r, p) for r in results for p in r["picks"]]
    flagged = [(r, p) for r, p in picks if p["edges"]]
    if not flagged:
        return (f"No pick has a setting in the outer {EDGE:.0%} of its range "
                f"({len(picks)} picks).")
    where = "; ".join(f"{r['loss']} B={r['batch']}"
                      + (f" r{p['repeat']}" if len(r["picks"]) > 1 else "")
                      + f": {', '.join(p['edges'])}" for r, p in flagged)
    return (f"**{len(flagged)} of {len(picks)} picks have a setting in the outer "
            f"{EDGE:.0%} of its range** (log scale for the learning rate, "
            f"[{lr_range[0]:g}, {lr_range[1]:g}], and log knobs): {where}. A wider range "
            "(or more trials) may move them.")


def _ranges(losses) -> str:
    parts = []
    for loss in losses:
        knobs = SEARCH_SPACES[loss][2]
        parts.append(f"{loss}: " + ", ".join(
            f"{name} {low:g}–{high:g}{' (log)' if kind == 'log' else ''}"
            for name, (kind, low, high) in knobs.items()))
    return "; ".join(parts)


def markdown(results: list[dict], header: str = "", baselines: dict | None = None) -> str:
    """The tables of one comparison."""
    lines = [header] if header else []
    if baselines:
        lines += _baseline_table(baselines)
    budgets = list(dict.fromkeys(r["budget"] for r in results))
    losses = list(dict.fromkeys(r["loss"] for r in results))
    batches = sorted({r["batch"] for r in results})
    by = {(r["budget"], r["loss"], r["batch"]): r for r in results}
    kinds = {r.get("interval", "seeds") for r in results}
    for budget in budgets:
        cols = [b for b in batches if any((budget, l, b) in by for l in losses)]
        # any result of each column: what the cell shares (its updates, its best peer)
        some = {b: next(by[(budget, l, b)] for l in losses if (budget, l, b) in by)
                for b in cols}
        lines += ["", f"### Budget: {budget}", "",
                  ("Test MAP@R (%), " + ("mean ± 95 % t-interval over the tuning repeats' "
                                         "means" if kinds == {"repeats"} else
                                         "mean ± 95 % t-interval over the seeds")
                   + ("; every loss trains for the seconds in the header, its updates "
                      "in brackets." if budget == "seconds" else
                      "; updates (images) per cell in the header.")), "",
                  "| loss | " + " | ".join(_column(some[b], b) for b in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for name, b in (baselines or {}).items():
            lines.append(f"| {BASELINE_NAMES[name]} | "
                         + " | ".join(_num(b["test_map@r"]) for _ in cols) + " |")
        for loss in losses:
            kind = " (AP)" if loss in AP_LOSSES else " (peer)" if loss in PEERS else ""
            lines.append(f"| {loss}{kind} | " + " | ".join(
                _cell(by[(budget, loss, b)]) if (budget, loss, b) in by else "–"
                for b in cols) + " |")
        if budget == "seconds":
            timed = {b: ", ".join(f"{loss} {by[(budget, loss, b)]['step_seconds']:.3g}"
                                  for loss in losses if (budget, loss, b) in by)
                     for b in cols}
            lines += ["", "Seconds per update, timed once per loss and batch with the "
                      "loss's knobs at their ranges' middle: "
                      + "; ".join(f"B={b}: {text}" for b, text in timed.items()) + "."]
        if baselines:
            lines += ["", ("Difference from the frozen features (test MAP@R points; the "
                           "interval is the loss's own):"), "",
                      "| loss | " + " | ".join(f"B={b}" for b in cols) + " |",
                      "|---|" + "---|" * len(cols)]
            for loss in losses:
                lines.append(f"| {loss} | " + " | ".join(
                    _pair(by[(budget, loss, b)].get("vs_frozen"))
                    if (budget, loss, b) in by else "–" for b in cols) + " |")
        peers = {b: some[b].get("best_peer") for b in cols}
        lines += ["", ("Paired difference against the best peer of the cell, chosen by "
                       "the validation MAP@R of its evaluation runs (test MAP@R points, "
                       "same (repeat, seed) runs):"), "",
                  "| loss | " + " | ".join(f"B={b} (vs {peers[b] or '–'})" for b in cols)
                  + " |", "|---|" + "---|" * len(cols)]
        for loss in losses:
            lines.append(f"| {loss} | " + " | ".join(
                _pair(by[(budget, loss, b)].get("vs_best_peer"), peers[b] == loss)
                if (budget, loss, b) in by else "–" for b in cols) + " |")
        chosen = []
        for b in cols:
            ap = some[b].get("best_ap")
            if ap is not None and peers[b] is not None:
                diff = by[(budget, ap, b)].get("vs_best_peer")
                if diff is not None and math.isfinite(diff[0]):
                    low = diff[0] - diff[1] if math.isfinite(diff[1]) else float("nan")
                    chosen.append(f"B={b}: {ap} vs {peers[b]} {_pair(diff)} (95 % lower "
                                  f"bound {_num(low)})")
        if chosen:
            lines += ["", "The AP loss chosen on validation against the best peer: "
                      + "; ".join(chosen) + "."]
        lines += ["", ("Settings picked on the validation classes (the best validation "
                       "MAP@R of each tuning's trials; ⚠ marks a setting in the outer "
                       f"{EDGE:.0%} of its range):"), "",
                  "| loss | B | repeat | trials | val MAP@R | settings | at an edge |",
                  "|---|---|---|---|---|---|---|"]
        cell = [r for r in results if r["budget"] == budget]
        for loss in losses:
            for b in cols:
                r = by.get((budget, loss, b))
                for p in (r["picks"] if r is not None else ()):
                    edges = f"⚠ {', '.join(p['edges'])}" if p["edges"] else ""
                    lines.append(f"| {loss} | {b} | {p['repeat']} | {p['trials']} | "
                                 f"{_num(p['val_map@r'])} | {settings_text(p['params'], ', ')} | "
                                 f"{edges} |")
        lines += ["", edge_summary(cell)]
    lines += ["", f"Knob ranges: {_ranges(losses)}."]
    return "\n".join(lines) + "\n"


def clipped_error(mean: float, half: float) -> tuple[float, float]:
    """``(below, above)`` of an interval clipped to [0, 100] (MAP@R is a percentage)."""
    if not (math.isfinite(mean) and math.isfinite(half)):
        return 0.0, 0.0
    return max(0.0, min(half, mean)), max(0.0, min(half, 100.0 - mean))


def plot(results: list[dict], path: str | os.PathLike, baselines: dict | None = None, *,
         quick: bool = False) -> Path | None:
    """Test MAP@R against the batch per budget, and the validation curves; None when
    matplotlib is not installed (``pip install 'tfaploss[viz]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    budgets = list(dict.fromkeys(r["budget"] for r in results))
    losses = list(dict.fromkeys(r["loss"] for r in results))
    fig, axes = plt.subplots(2, len(budgets), figsize=(5.5 * len(budgets), 8.5),
                             squeeze=False)
    colors = {loss: f"C{i}" for i, loss in enumerate(losses)}
    units = max((len(r["per_seed"]) for r in results), default=0)
    repeats = max((len(set(r.get("repeats", [0]))) for r in results), default=1)
    for j, budget in enumerate(budgets):
        ax = axes[0][j]
        for loss in losses:
            rows = sorted((r for r in results if r["budget"] == budget and r["loss"] == loss),
                          key=lambda r: r["batch"])
            err = [clipped_error(r["test_map@r"], r["ci95"] if r["ci95"] is not None
                                 else float("nan")) for r in rows]
            ax.errorbar([r["batch"] for r in rows], [r["test_map@r"] for r in rows],
                        yerr=[[e[0] for e in err], [e[1] for e in err]], marker="o",
                        capsize=3, color=colors[loss],
                        linestyle="-" if loss in AP_LOSSES else "--", label=loss)
        for name, style in (("frozen", "-"), ("pca", ":")):
            if baselines and name in baselines:
                ax.axhline(baselines[name]["test_map@r"], color="black", linestyle=style,
                           linewidth=1, label=BASELINE_NAMES[name])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("test MAP@R (%)")
        n = (f"n = {units} runs per point ({repeats} tuning repeats x seeds)" if repeats > 1
             else f"n = {units} seeds per point")
        ax.set_title(f"budget: {budget}; 95 % intervals, {n}"
                     + ("\n--quick: intervals not informative" if quick else ""), fontsize=9)
        ax.grid(alpha=0.3)
        ax = axes[1][j]
        for r in results:
            if r["budget"] != budget or r["batch"] != max(x["batch"] for x in results
                                                          if x["budget"] == budget):
                continue
            for curve in r["curves"]:
                if curve:
                    ax.plot([c[0] for c in curve], [c[1] for c in curve], alpha=0.6,
                            color=colors[r["loss"]])
        ax.set_xlabel("images seen")
        ax.set_ylabel("validation MAP@R (%)")
        ax.set_title(f"{budget}: curves at the largest batch, every run", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    try:
        atomic.atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"),
                            fault="report")
    finally:
        plt.close(fig)
    return path
