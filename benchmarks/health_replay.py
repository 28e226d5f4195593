"""Which runs would another batch-health line have stopped? Replays logged runs.

``tfaploss train`` logs what its batch-health check saw at every step
(``health_steps`` in each run's ``epochs.jsonl``). This script finds every run under
the folders given that has such a log, replays it through
:func:`tfaploss.training.health.replay` with the run's own ``training.health``
settings and, in turn, each ``--cone-chance`` line (``cone_chance_ap``), and prints
for each run where each line stops it, beside its validation MAP@R (``metrics.json``
of ``benchmarks/batch_sweep.py``, when there) and what the run itself did (the line
it was trained with: the peer each replay is read against). A line is good when it
stops the runs that did not learn and none of those that did.

    python benchmarks/health_replay.py benchmarks/results/batch_sweep \\
        --cone-chance 0.15,0.2,0.25,0.3,0.35

Runs written before ``health_steps`` existed are counted and skipped. Cost: O(steps)
Python per run and line; no model is loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", help="folders searched for run folders")
    p.add_argument("--cone-chance", default="0.15,0.2,0.25,0.3,0.35",
                   help="comma-separated cone_chance_ap lines to replay")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        args.lines = [float(x) for x in args.cone_chance.split(",") if x.strip()]
    except ValueError:
        p.error(f"--cone-chance: numbers separated by commas; received "
                f"{args.cone_chance!r}")
    if not args.lines or not all(0 <= x <= 1 for x in args.lines):
        p.error(f"--cone-chance: numbers in [0, 1]; received {args.cone_chance!r}")
    missing = [f for f in args.folders if not Path(f).is_dir()]
    if missing:
        p.error(f"not a folder: {missing}")
    return args


def load_run(run_dir: Path):
    """(epoch rows, health settings, epochs, steps per epoch, validation MAP@R, the
    run's ``stopped_early``) of a finished run folder, or None when its log has no
    per-step values."""
    rows = [json.loads(line) for line in
            (run_dir / "epochs.jsonl").read_text(encoding="utf-8").splitlines() if line]
    if not rows or any("health_steps" not in row for row in rows):
        return None
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    metrics = run_dir / "metrics.json"
    val = (json.loads(metrics.read_text(encoding="utf-8")).get("val_map@r")
           if metrics.is_file() else None)
    health = dict(cfg["training"]["health"])
    return (rows, health, cfg["training"]["epochs"], summary["steps_per_epoch"], val,
            summary.get("stopped_early"))


def replay_run(rows, health, epochs, steps, line):
    """Step at which the run's health check, with ``cone_chance_ap=line``, stops it
    (None: it runs to the end)."""
    from tfaploss.training.health import replay

    kwargs = {k: v for k, v in health.items() if k != "enabled"}
    kwargs["cone_chance_ap"] = line
    monitor = replay(rows, total_epochs=epochs, steps_per_epoch=steps, **kwargs)
    return None if monitor.stopped is None else monitor.stopped["step"]


def _shown(path: Path) -> str:
    cwd = Path.cwd()
    return str(path.relative_to(cwd)) if path.is_relative_to(cwd) else str(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    found = sorted({p.parent for f in args.folders for p in Path(f).rglob("summary.json")
                    if (p.parent / "epochs.jsonl").is_file()})
    table, skipped = [], 0
    for run_dir in found:
        run = load_run(run_dir)
        if run is None or not run[1].get("enabled", True):
            skipped += 1
            continue
        rows, health, epochs, steps, val, stopped = run
        own = health.get("cone_chance_ap")
        table.append({
            "run": _shown(run_dir), "val_map@r": val, "steps": epochs * steps,
            "trained_with": own, "stopped_at": None if stopped is None else stopped["step"],
            # the run's own line replayed: must give what the run did
            "replayed_own": replay_run(rows, health, epochs, steps, own),
            "replayed": {str(x): replay_run(rows, health, epochs, steps, x)
                         for x in args.lines}})
    print(f"{len(table)} runs with per-step health logs; {skipped} skipped (no "
          f"health_steps: written before they were logged, or the check was off)")
    if not table:
        return 0
    head = " ".join(f"{x:>6g}" for x in args.lines)
    print(f"{'val MAP@R':>9} {'steps':>5} {'as run (line)':>14} | stop step at "
          f"cone_chance_ap {head} | run")
    mismatches = 0
    for row in sorted(table, key=lambda r: (r["val_map@r"] is None, r["val_map@r"] or 0)):
        val = "—" if row["val_map@r"] is None else f"{row['val_map@r']:.1f}"
        as_run = f"{row['stopped_at'] or 'end'} ({row['trained_with']:g})"
        if row["replayed_own"] != row["stopped_at"]:
            mismatches += 1
            as_run += " ≠replay"
        cells = " ".join(f"{row['replayed'][str(x)] or '—':>6}" for x in args.lines)
        print(f"{val:>9} {row['steps']:>5} {as_run:>14} | {'':>27}{cells} | {row['run']}")
    print("'—': runs to the end. 'as run': where the run itself was stopped, with the "
          "line it was trained with (the peer of each replayed line).")
    if mismatches:
        print(f"{mismatches} runs replayed with their own line do not stop where they "
              f"did (≠replay): the per-step log does not reproduce the run.")
    if args.out:
        from tfaploss.training.checkpoints import atomic_write_json

        atomic_write_json(Path(args.out), table)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
