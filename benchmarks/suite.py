"""The performance suite: every benchmark of ``benchmarks/``, one summary table.

Runs each script below in its own process (``--quick`` for the quick mode), collects
the figures of its results file, prints one table (each figure beside its floor or peer
and the ratio; with ``--previous`` also the ratio of an earlier suite run) and writes
them all to one results file. A script that needs a GPU is skipped, and said so, where
``nvidia-smi`` lists none; a script that fails is reported and the others still run.

    python benchmarks/suite.py --quick                    # a few minutes on 2 cores
    python benchmarks/suite.py                            # hours: the README's figures
    python benchmarks/suite.py --quick --previous benchmarks/results/suite-quick.json
    python benchmarks/suite.py --only losses,search       # some of them

(``make bench`` / ``make bench QUICK=1`` / ``make bench-quick``; ``PREVIOUS=file``.)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent


# name -> (arguments of the full run, of the quick run, needs a GPU). The full runs are
# the README's; a quick run keeps every figure on a smaller problem.
SUITE = {
    "losses": (["--compare"], ["--quick", "--compare"], False),
    "multistage": ([], ["--quick"], False),
    "search": ([], ["--quick", "--datasets", "clustered", "--target_recall", "0.9",
                    "--tune_seconds", "30"], False),
    "embed": ([], ["--quick"], False),
    "input_pipeline": ([], ["--quick"], False),
    "sharded_input": ([], ["--quick"], False),
    "pipeline": ([], ["--quick"], False),
    "data_parallel": ({"gpu": ["--device", "gpu"], "cpu": ["--device", "cpu"]},
                      {"gpu": ["--device", "gpu", "--quick"],
                       "cpu": ["--device", "cpu", "--quick"]}, False),
    "gpu_losses": (["--device", "gpu"], ["--device", "gpu", "--quick"], True),
}


def gpu_present() -> bool:
    """Whether ``nvidia-smi`` lists a GPU (the suite's GPU scripts run Keras on JAX/CUDA)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "GPU" in done.stdout


def run_one(name: str, extra: list[str], out: Path, timeout: float) -> dict:
    """Runs one script into ``out``; returns its status, wall time and figures."""
    command = [sys.executable, str(HERE / f"{name}.py"), *extra, "--out", str(out)]
    print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, timeout=timeout, check=False)
        status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timeout ({timeout:g} s)"
    seconds = time.perf_counter() - start
    figures = harness.load_figures(out) if status == "ok" and out.exists() else []
    if status == "ok" and not figures:
        status = "ok, no figures"
    return {"script": name, "status": status, "seconds": seconds, "figures": figures}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="every script's quick mode (a few minutes on 2 cores)")
    parser.add_argument("--only", default="", help="comma-separated script names")
    parser.add_argument("--previous", type=Path,
                        help="an earlier suite results file: its ratios beside this run's")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per script (default: 900 quick, 6 h full)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the suite's results file (default: "
                             "benchmarks/results/suite[-quick]-<UTC time>.json)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(SUITE)
    unknown = sorted(set(names) - set(SUITE))
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; the suite has {list(SUITE)}")
    previous = harness.load_figures(args.previous) if args.previous else None
    timeout = args.timeout or (900.0 if args.quick else 6 * 3600.0)
    gpu = gpu_present()
    print(f"performance suite ({'quick' if args.quick else 'full'}): {', '.join(names)}; "
          f"GPU: {'yes' if gpu else 'none'}", flush=True)

    runs, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tfaploss_bench_") as tmp:
        for name in names:
            full, quick, needs_gpu = SUITE[name]
            extra = quick if args.quick else full
            if isinstance(extra, dict):
                extra = extra["gpu" if gpu else "cpu"]
            if needs_gpu and not gpu:
                print(f"\n=== {name}: skipped (no GPU)", flush=True)
                runs.append({"script": name, "status": "skipped: no GPU", "seconds": 0.0,
                             "figures": []})
                continue
            runs.append(run_one(name, extra, Path(tmp) / f"{name}.json", timeout))
    wall = time.perf_counter() - start

    figures = [f for run in runs for f in run["figures"]]
    print("\n## Performance suite" + (" (quick)" if args.quick else ""))
    print()
    print(harness.summary_table(figures, previous))
    print()
    print("| script | status | wall |\n|---|---|---|")
    for run in runs:
        print(f"| {run['script']} | {run['status']} | {run['seconds']:.0f} s |")
    print(f"\nsuite wall time: {wall:.0f} s")

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or harness.RESULTS_DIR / (f"suite{'-quick' if args.quick else ''}-"
                                             f"{stamp}.json")
    harness.write_results(out, "suite", args, figures, wall_s=wall,
                          scripts=[{k: v for k, v in run.items() if k != "figures"}
                                   for run in runs])
    return 0 if all(r["status"].startswith(("ok", "skipped")) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
