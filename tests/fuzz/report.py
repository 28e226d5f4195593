"""Add up the fuzz tallies that ``make fuzz`` left in a folder and print one table.

Each pytest process of the run wrote ``tally-<pid>.json`` there
(:func:`tests.fuzz.harness.write_report`): per target, the cases, their outcomes and
the worst time and memory of one case. Targets of several processes (pytest-xdist
workers, the loss fuzz on each Keras backend) are added up: cases and outcomes summed,
the worst kept.

    python tests/fuzz/report.py .cache/fuzz-report
"""

from __future__ import annotations

import glob
import json
import os
import sys


def merge(folder: str) -> dict[str, dict]:
    targets: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(folder, "tally-*.json"))):
        with open(path, encoding="utf-8") as f:
            for name, tally in json.load(f).items():
                into = targets.setdefault(name, {"cases": 0, "outcomes": {}, "worst_s": 0.0,
                                                 "worst_case": "", "worst_rss_mb": 0.0,
                                                 "worst_rss_case": ""})
                into["cases"] += tally["cases"]
                for outcome, n in tally["outcomes"].items():
                    into["outcomes"][outcome] = into["outcomes"].get(outcome, 0) + n
                if tally["worst_s"] > into["worst_s"]:
                    into["worst_s"], into["worst_case"] = tally["worst_s"], tally["worst_case"]
                if tally["worst_rss_mb"] > into["worst_rss_mb"]:
                    into["worst_rss_mb"] = tally["worst_rss_mb"]
                    into["worst_rss_case"] = tally["worst_rss_case"]
    return targets


def table(targets: dict[str, dict]) -> str:
    lines = ["| target | cases | outcomes | worst time | worst memory |", "|---|---|---|---|---|"]
    for name, t in sorted(targets.items()):
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(t["outcomes"].items(),
                                                            key=lambda kv: -kv[1]))
        lines.append(f"| {name} | {t['cases']} | {outcomes} | {t['worst_s']:.2f} s "
                     f"({t['worst_case']}) | +{t['worst_rss_mb']:.0f} MB "
                     f"({t['worst_rss_case']}) |")
    total = sum(t["cases"] for t in targets.values())
    lines.append(f"\n{total} cases in all.")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder = argv[0] if argv else os.path.join(".cache", "fuzz-report")
    targets = merge(folder)
    if not targets:
        print(f"no fuzz tallies in {folder}", file=sys.stderr)
        return 1
    print(table(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
