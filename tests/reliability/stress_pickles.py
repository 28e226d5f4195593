"""Stress: the restricted ground-truth reader against crafted 1 MiB hostile pickles.

For each input of :func:`tests.reliability.hostile_pickles.one_megabyte_cases` (opcode floods of
each container opcode, memo floods and memo-reference blow-ups, deep nesting), plus the
array shape and dtype attacks, runs :func:`tfaploss.pipelines.safe_pickle.safe_loads` and
prints one row: the input's size, the bound that refused it, the worst wall time over
``--repeats`` runs, and the peak memory that Python and numpy allocated (tracemalloc,
measured in a separate run, since tracing slows the reader). A full-size realistic
``gnd_rparis6k.pkl`` (protocols 2 and 5) is loaded too, for contrast. The last lines
give the worst time and the worst peak memory over the hostile inputs.

    python tests/reliability/stress_pickles.py [--repeats 3]

also writes ``benchmarks/results/hostile_pickles.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.reliability import hostile_pickles as H
from tfaploss.pipelines.safe_pickle import UnsafePickleError, safe_loads


def _run(data: bytes) -> str:
    try:
        safe_loads(data)
    except UnsafePickleError as err:
        # the bound that refused it: the message's clause after "at byte N: "
        text = str(err)
        return "refused: " + text.split(": ", 2)[-1].split(". Ground-truth")[0][:60]
    except Exception as err:  # noqa: BLE001 -- a crash is a bug: show it, do not hide it
        return f"CRASH {type(err).__name__}: {err}"[:70]
    return "loaded"


def _measure(data: bytes, repeats: int) -> tuple[str, float, int]:
    worst = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        outcome = _run(data)
        worst = max(worst, time.perf_counter() - started)
    tracemalloc.start()
    try:
        _run(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return outcome, worst, peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per input")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" /
                                              "hostile_pickles.json"),
                        help="also write the rows here ('' for none)")
    args = parser.parse_args(argv)

    hostile = {name: data for name, (data, _) in H.one_megabyte_cases().items()}
    hostile.update({f"shape {k}": v for k, v in H.shape_cases().items()})
    hostile.update({f"dtype {k}": v for k, v in H.dtype_cases().items()})
    genuine = {f"realistic rparis6k p{p}": pickle.dumps(H.realistic_gnd(), protocol=p)
               for p in (2, 5)}

    rows = []
    print(f"{'input':40s} {'bytes':>9s} {'worst s':>8s} {'peak MB':>8s}  outcome")
    for kind, cases in (("hostile", hostile), ("genuine", genuine)):
        for name, data in cases.items():
            outcome, worst, peak = _measure(data, args.repeats)
            rows.append({"input": name, "kind": kind, "bytes": len(data), "worst_s": worst,
                         "peak_bytes": peak, "outcome": outcome})
            print(f"{name[:40]:40s} {len(data):9d} {worst:8.3f} {peak / 1e6:8.1f}  {outcome}")

    bad = [r for r in rows if r["kind"] == "hostile" and not r["outcome"].startswith("refused")]
    hostile_rows = [r for r in rows if r["kind"] == "hostile"]
    slowest = max(hostile_rows, key=lambda r: r["worst_s"])
    hungriest = max(hostile_rows, key=lambda r: r["peak_bytes"])
    print(f"\n{len(hostile_rows)} hostile inputs ({sum(r['bytes'] >= 350_000 for r in hostile_rows)}"
          f" of 0.35-1 MiB), refused: {len(hostile_rows) - len(bad)}, crashes or loads: "
          f"{len(bad)}")
    print(f"worst time: {slowest['worst_s']:.3f} s ({slowest['input']})")
    print(f"worst peak memory: {hungriest['peak_bytes'] / 1e6:.1f} MB ({hungriest['input']})")
    print(f"machine: {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"rows": rows, "python": platform.python_version(),
             "machine": platform.machine(), "cpus": os.cpu_count()}, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
