"""One rank of the multi-process ``tfaploss train`` tests (tests/distribute/test_train_*.py).

    python tests/distribute/train_ranks.py PLAN.json OUT_DIR [JAX flags of tfaploss train]

Runs the ``tfaploss train`` commands of PLAN.json one after the other in this process
(each process pays the imports once, whatever the number of runs), through
``tfaploss.cli.main`` as the command line would. PLAN.json is a list of
``{"args": [...], "faults": {"<rank>": "<TFAPLOSS_FAULT item>"}}``: ``args`` follow
``tfaploss``; the fault points armed in this rank for that run only
(:mod:`tfaploss.durable.faults`, e.g. ``sigterm:1:1``). The rank is torchrun's
``RANK``, else the value of ``--process-id``. The JAX flags (``--coordinator ...``)
are added to every ``train`` command.

Writes ``OUT_DIR/pid-rank<r>-attempt<k>`` (this process's PID, ``k``: torchrun's
restart count) at start, and ``OUT_DIR/rank<r>.json`` at the end: per run, its exit
status and the step and epoch checkpoint indexes that rank 0 left in the run's
backup folder (``null`` when none).
"""

import json
import os
import sys
from pathlib import Path


def _index(run_dir: Path, name: str):
    path = run_dir / "backup" / name
    return json.loads(path.read_text())["latest"] if path.is_file() else None


def main() -> int:
    plan_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    extra = sys.argv[3:]
    rank = os.environ.get("RANK")
    if rank is None:
        rank = extra[extra.index("--process-id") + 1] if "--process-id" in extra else "0"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    (out / f"pid-rank{rank}-attempt{attempt}").write_text(str(os.getpid()))

    from tfaploss.cli import main as tfaploss
    from tfaploss.durable import faults

    results = []
    for run in json.loads(plan_path.read_text()):
        args = list(run["args"])
        if "train" in args:
            args += extra
        with faults.armed(run.get("faults", {}).get(rank)):
            status = tfaploss(args)
        run_dir = Path(args[args.index("--run-dir") + 1])
        results.append({"status": status, "step": _index(run_dir, "step.json"),
                        "epoch": _index(run_dir, "checkpoint.json")})
    target = out / f"rank{rank}.json"
    target.with_suffix(".tmp").write_text(json.dumps(results))
    target.with_suffix(".tmp").replace(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
