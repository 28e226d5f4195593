"""The comparison's tables (markdown) and figures (PNG): test MAP@R with 95 % intervals
per (budget, loss, batch), the paired differences against the best peer, the settings
each loss picked, and the validation curves of the evaluation seeds."""

from __future__ import annotations

import math
import os
from pathlib import Path

from tfaploss.compare.protocol import AP_LOSSES, PEERS
from tfaploss.durable import atomic


def _num(value, digits=1):
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _cell(r) -> str:
    text = _num(r["test_map@r"])
    if math.isfinite(r.get("ci95") or float("nan")):
        text += f" ± {_num(r['ci95'])}"
    bad = [s for s in r["statuses"] if s != "ok"]
    if bad:
        text += f" ({len(bad)}/{len(r['statuses'])} {', '.join(sorted(set(bad)))})"
    return text


def _pair(r) -> str:
    diff = r.get("vs_best_peer")
    if diff is None:
        return "best peer" if r.get("best_peer") == r["loss"] else "–"
    mean, half = diff
    return f"{mean:+.1f} ± {_num(half)}" if math.isfinite(mean) else "–"


def _settings(params: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in sorted(params.items()))


def markdown(results: list[dict], header: str = "") -> str:
    """The tables of one comparison."""
    lines = [header] if header else []
    budgets = list(dict.fromkeys(r["budget"] for r in results))
    losses = list(dict.fromkeys(r["loss"] for r in results))
    batches = sorted({r["batch"] for r in results})
    by = {(r["budget"], r["loss"], r["batch"]): r for r in results}
    for budget in budgets:
        cols = [b for b in batches if any((budget, l, b) in by for l in losses)]
        first = next(r for r in results if r["budget"] == budget)
        lines += ["", f"### Budget: {budget}", "",
                  ("Test MAP@R (%), mean ± 95 % t-interval over the evaluation seeds; "
                   "updates (images) per cell in the header."), "",
                  "| loss | " + " | ".join(
                      f"B={b} ({by_any(by, budget, losses, b)['updates']} u, "
                      f"{by_any(by, budget, losses, b)['images']:,} im)" for b in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for loss in losses:
            kind = " (AP)" if loss in AP_LOSSES else " (peer)" if loss in PEERS else ""
            lines.append(f"| {loss}{kind} | " + " | ".join(
                _cell(by[(budget, loss, b)]) if (budget, loss, b) in by else "–"
                for b in cols) + " |")
        lines += ["", ("Paired difference against the best peer of the cell (test MAP@R "
                       "points, same seeds):"), "", "| loss | " + " | ".join(f"B={b}" for b in cols)
                  + " |", "|---|" + "---|" * len(cols)]
        for loss in losses:
            lines.append(f"| {loss} | " + " | ".join(
                _pair(by[(budget, loss, b)]) if (budget, loss, b) in by else "–"
                for b in cols) + " |")
        lines += ["", ("Settings picked on the validation classes (best validation MAP@R "
                       f"of {first['trials']} trials):"), "", "| loss | B | val MAP@R | settings |",
                  "|---|---|---|---|"]
        for loss in losses:
            for b in cols:
                r = by.get((budget, loss, b))
                if r is not None:
                    lines.append(f"| {loss} | {b} | {_num(r['val_map@r'])} | "
                                 f"{_settings(r['params'])} |")
    return "\n".join(lines) + "\n"


def by_any(by, budget, losses, batch):
    return next(by[(budget, l, batch)] for l in losses if (budget, l, batch) in by)


def plot(results: list[dict], path: str | os.PathLike) -> Path | None:
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
    for j, budget in enumerate(budgets):
        ax = axes[0][j]
        for loss in losses:
            rows = sorted((r for r in results if r["budget"] == budget and r["loss"] == loss),
                          key=lambda r: r["batch"])
            xs = [r["batch"] for r in rows]
            ys = [r["test_map@r"] for r in rows]
            err = [r["ci95"] if math.isfinite(r["ci95"] or float("nan")) else 0 for r in rows]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=colors[loss],
                        linestyle="-" if loss in AP_LOSSES else "--", label=loss)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("test MAP@R (%)")
        ax.set_title(f"budget: {budget}")
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
        ax.set_title(f"{budget}: curves at the largest batch, every seed")
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
