"""What would another batch-health rule have said about real runs? Replays logged runs.

``tfaploss train`` logs what its batch-health check saw at every step
(``health_steps`` in each run's ``epochs.jsonl``). This script finds every run under
the folders given that has such a log, replays it through
:func:`tfaploss.training.health.replay` with the run's own ``training.health``
settings and, in turn, each value of one threshold (``--vary``), and prints for
each run what each value does: where it stops the run and what it warns about, beside
the run's validation MAP@R (``metrics.json`` of ``benchmarks/batch_sweep.py``, when
there) and what the run itself did (the settings it was trained with: the peer each
replay is read against). A rule is good when it reports the runs that did not learn and
none of those that did.

    python experiments/health_replay/health_replay.py experiments/batch_sweep/results \\
        --vary cone_chance_ap=0.15,0.2,0.25,0.3,0.35
    python experiments/health_replay/health_replay.py experiments/batch_sweep/results \\
        --vary stall_chance_ap=0.2,0.25,0.3,0.4 --epoch-means

Runs written before ``health_steps`` existed are counted and skipped, or, with
``--epoch-means``, replayed with every step of an epoch at the epoch's logged means
(marked ``≈``: an approximation, which hides the batch-to-batch swing; the check that
a run's own settings reproduce it is then only shown, not enforced). Cost: O(steps)
Python per run and value; no model is loaded.

Cells: ``S44`` stopped at step 44, ``stall@58`` a first warning of that kind at step
58 (``collapse``, ``flat``, ``stall``), ``—`` nothing reported. What the replays
showed, and the thresholds they set: ``docs/health.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _monitor_arguments() -> set[str]:
    """The thresholds, and the run facts a replay may be told."""
    from tfaploss.config.health import HealthThresholds

    return {f.name for f in dataclasses.fields(HealthThresholds)} | {"total_images",
                                                                     "batch_size"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", help="folders searched for run folders")
    p.add_argument("--vary", default="cone_chance_ap=0.15,0.2,0.25,0.3,0.35",
                   help="NAME=v1,v2,...: a HealthThresholds field (or total_images, "
                        "batch_size) and the values to replay ('none' for None)")
    p.add_argument("--epoch-means", action="store_true",
                   help="also replay runs without per-step logs from their epoch means")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    name, _, values = args.vary.partition("=")
    allowed = _monitor_arguments()
    if name not in allowed:
        p.error(f"--vary: NAME must be one of {sorted(allowed)}; received {name!r}")
    try:
        args.values = [None if x.strip().lower() == "none" else float(x)
                       for x in values.split(",") if x.strip()]
    except ValueError:
        p.error(f"--vary: values are numbers (or 'none') separated by commas; received "
                f"{values!r}")
    if not args.values:
        p.error(f"--vary: give at least one value, as {name}=0.2,0.3; received "
                f"{args.vary!r}")
    if name in ("min_window_images", "total_images", "batch_size"):
        args.values = [None if v is None else int(v) for v in args.values]
    args.name = name
    missing = [f for f in args.folders if not Path(f).is_dir()]
    if missing:
        p.error(f"not a folder: {missing}")
    return args


def _epoch_mean_columns(rows, steps, batch):
    """Per-step columns of a run logged without them: each of the ``steps`` steps of
    ``batch`` images at its epoch's means (no loss, so the flat check, which a constant
    would fool, stays silent)."""
    columns = []
    for row in rows:
        if row.get("emb_cos") is None:
            return None
        chance = row.get("chance_ap")
        columns.append({"images": [batch] * steps, "emb_cos": [row["emb_cos"]] * steps,
                        "chance_ap": None if chance is None else [chance] * steps})
    return columns


def load_run(run_dir: Path, epoch_means: bool = False):
    """``{"rows", "health", "epochs", "steps", "val", "stopped", "approximate"}`` of a
    finished run folder, or None when its log has no per-step values (and
    ``epoch_means`` is off, or the rows have no means either)."""
    rows = [json.loads(line) for line in
            (run_dir / "epochs.jsonl").read_text(encoding="utf-8").splitlines() if line]
    if not rows:
        return None
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    steps = summary["steps_per_epoch"]
    approximate = any("health_steps" not in row for row in rows)
    if approximate:
        rows = (_epoch_mean_columns(rows, steps, cfg["data"]["batch_size"])
                if epoch_means else None)
        if rows is None:
            return None
    metrics = run_dir / "metrics.json"
    val = (json.loads(metrics.read_text(encoding="utf-8")).get("val_map@r")
           if metrics.is_file() else None)
    return {"rows": rows, "health": dict(cfg["training"]["health"]),
            "epochs": cfg["training"]["epochs"], "steps": steps, "val": val,
            "stopped": summary.get("stopped_early"), "approximate": approximate}


def replay_run(run, name=None, value=None):
    """``(stop step or None, {kind: first step warned})`` of the run's health check
    with ``name=value`` (the run's own settings when ``name`` is None)."""
    from tfaploss.training.health import replay

    kwargs = {k: v for k, v in run["health"].items() if k != "enabled"}
    if name is not None:
        kwargs[name] = value
    monitor = replay(run["rows"], total_epochs=run["epochs"], steps_per_epoch=run["steps"],
                     **kwargs)
    first = {}
    for record in monitor.records:
        if not record["stop"]:
            first.setdefault(record["kind"], record["step"])
    return (None if monitor.stopped is None else monitor.stopped["step"]), first


def _cell(stop, warned) -> str:
    parts = [f"S{stop}"] if stop is not None else []
    parts += [f"{kind}@{step}" for kind, step in sorted(warned.items(), key=lambda x: x[1])]
    return " ".join(parts) or "—"


def _shown(path: Path) -> str:
    cwd = Path.cwd()
    return str(path.relative_to(cwd)) if path.is_relative_to(cwd) else str(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    found = sorted({p.parent for f in args.folders for p in Path(f).rglob("summary.json")
                    if (p.parent / "epochs.jsonl").is_file()})
    table, skipped = [], 0
    for run_dir in found:
        run = load_run(run_dir, args.epoch_means)
        if run is None or not run["health"].get("enabled", True):
            skipped += 1
            continue
        own_stop, own_warned = replay_run(run)
        stopped = run["stopped"]
        table.append({
            "run": _shown(run_dir), "val_map@r": run["val"],
            "steps": run["epochs"] * run["steps"], "approximate": run["approximate"],
            "trained_with": run["health"].get(args.name),
            "stopped_at": None if stopped is None else stopped["step"],
            # the run's own settings replayed: must give what the run did
            "replayed_own": own_stop, "own_warnings": own_warned,
            "replayed": {str(v): dict(zip(("stop", "warned"),
                                          replay_run(run, args.name, v), strict=True))
                         for v in args.values}})
    approx = sum(r["approximate"] for r in table)
    print(f"{len(table)} runs replayed ({approx} from epoch means, marked ≈); {skipped} "
          f"skipped (no health_steps{'' if args.epoch_means else ' (--epoch-means replays them)'}"
          f", or the check was off)")
    if not table:
        return 0
    width = max(14, *(len(_cell(c["stop"], c["warned"])) for r in table
                      for c in r["replayed"].values()))
    head = " ".join(f"{'none' if v is None else f'{v:g}':>{width}}" for v in args.values)
    print(f"{'val MAP@R':>9} {'steps':>5} {'as run':>16} | {args.name} = {head} | run")
    mismatches = 0
    for row in sorted(table, key=lambda r: (r["val_map@r"] is None, r["val_map@r"] or 0)):
        val = "—" if row["val_map@r"] is None else f"{row['val_map@r']:.1f}"
        as_run = f"{'S' + str(row['stopped_at']) if row['stopped_at'] else 'end'}"
        if row["replayed_own"] != row["stopped_at"]:
            mismatches += not row["approximate"]
            as_run += f" ≠S{row['replayed_own']}"
        cells = " ".join(f"{_cell(c['stop'], c['warned']):>{width}}"
                         for c in row["replayed"].values())
        mark = "≈" if row["approximate"] else " "
        print(f"{val:>9} {row['steps']:>5} {as_run:>16} | {' ' * len(args.name)}   "
              f"{cells} |{mark}{row['run']}")
    print("'as run': where the run itself stopped (end: it did not), the peer of each "
          "replayed value; ≠: where its own settings stop it on replay.")
    if mismatches:
        print(f"{mismatches} runs with per-step logs replayed with their own settings do "
              f"not stop where they did (≠): the per-step log does not reproduce the run.")
    if args.out:
        from tfaploss.durable.atomic import atomic_write_json

        atomic_write_json(Path(args.out), table)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
