"""The pre-registered rule of the study (docs/batch_sweep.md), applied to its results:

    "AP beats the best peer at large batch" if and only if, at the plateau budget, in
    both regimes, at B = 2048 and at B = 4096, the paired difference between the
    validation-chosen best AP loss and the validation-chosen best peer has a 95 % lower
    bound above 0.

    python experiments/fair_comparison/decide.py \\
        strong=experiments/fair_comparison/results/study_strong/results.json \\
        weak=experiments/fair_comparison/results/study_weak/results.json

Prints one line per cell (the two losses, the paired difference and its lower bound)
and the answer: "yes", "no" (a cell's lower bound is at or below 0), or "undecided"
(a cell is missing: its runs are not done). Exits 0 whatever the answer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BATCHES = (2048, 4096)


def cell(results: list[dict], batch: int, budget: str = "images") -> dict | None:
    """The rule's cell at ``batch``: the validation-chosen best AP loss against the
    validation-chosen best peer (``tfaploss compare``'s ``best_ap``, ``best_peer`` and
    ``vs_best_peer``), or None when the cell is not in ``results``."""
    rows = {r["loss"]: r for r in results if r["budget"] == budget and r["batch"] == batch}
    any_row = next(iter(rows.values()), None)
    if any_row is None or not any_row.get("best_ap") or not any_row.get("best_peer"):
        return None
    ap = rows[any_row["best_ap"]]
    if not ap.get("vs_best_peer"):
        return None
    mean, half = ap["vs_best_peer"]
    return {"batch": batch, "ap": ap["loss"], "peer": any_row["best_peer"],
            "difference": mean, "half_width": half, "lower": mean - half,
            "interval": ap.get("interval")}


def verdict(regimes: dict[str, list[dict]], batches=BATCHES, budget: str = "images"):
    """``(answer, cells)``: the rule's answer over every regime and batch, and each
    ``(regime, batch, cell)`` (``cell`` None where missing)."""
    cells = [(name, b, cell(results, b, budget)) for name, results in regimes.items()
             for b in batches]
    if any(c is not None and not c["lower"] > 0 for *_, c in cells):
        return "no", cells
    if any(c is None for *_, c in cells):
        return "undecided", cells
    return "yes", cells


def _load(path: str) -> list[dict]:
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    return document["results"] if isinstance(document, dict) else document


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("regimes", nargs="+", metavar="NAME=RESULTS_JSON")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--budget", default="images")
    args = p.parse_args(argv)
    regimes = {}
    for item in args.regimes:
        name, sep, path = item.partition("=")
        if not sep:
            p.error(f"expected NAME=RESULTS_JSON; received {item!r}")
        if not Path(path).is_file():
            print(f"{name}: no results at {path} yet")
        regimes[name] = _load(path) if Path(path).is_file() else []
    batches = tuple(int(b) for b in args.batches.split(","))
    answer, cells = verdict(regimes, batches, args.budget)
    for name, batch, c in cells:
        if c is None:
            print(f"{name:8s} B={batch:>5}: missing (its runs are not done)")
            continue
        print(f"{name:8s} B={batch:>5}: {c['ap']} - {c['peer']} = "
              f"{c['difference']:+.2f} ± {c['half_width']:.2f} (lower bound "
              f"{c['lower']:+.2f}; interval over {c['interval']})")
    print(f"AP beats the best peer at large batch: {answer}")


if __name__ == "__main__":
    main()
