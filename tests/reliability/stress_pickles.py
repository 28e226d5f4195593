"""Stress: the sandboxed ground-truth reader against crafted 1 MiB hostile pickles.

For each input of :func:`tests.reliability.hostile_pickles.one_megabyte_cases` (opcode
floods of each container opcode, memo floods and memo-reference blow-ups, deep nesting),
plus the array shape and dtype attacks, reads it the way the revisited job reads a file
the user named (:func:`tfaploss.pipelines.revisited.read_pickled_ground_truth`: the
allow-list unpickler in a child process, then the structure check) and prints one row:
the input's size, the CPU seconds of the child and of this process, the wall time, and
what refused it. A full-size realistic ``gnd_rparis6k.pkl`` (protocols 2 and 5) is read
too, for contrast (its row is the floor: a child's start). The last lines give the worst
time, and the largest resident set of any child beside the limit it runs under.

    python tests/reliability/stress_pickles.py
"""

from __future__ import annotations

import pickle
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.reliability import hostile_pickles as H
from tfaploss.pipelines import pickle_sandbox
from tfaploss.pipelines.revisited import read_pickled_ground_truth


def _cpu() -> float:
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                          resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> int:
    hostile = {name: data for name, (data, _) in H.one_megabyte_cases().items()}
    hostile.update({f"shape {k}": v for k, v in H.shape_cases().items()})
    hostile.update({f"dtype {k}": v for k, v in H.dtype_cases().items()})
    genuine = {f"realistic rparis6k p{p}": pickle.dumps(H.realistic_gnd(), protocol=p)
               for p in (2, 5)}
    rows, path = [], Path(tempfile.mkdtemp()) / "gnd_input.pkl"
    print(f"{'input':40s} {'bytes':>9s} {'CPU s':>6s} {'wall s':>6s}  outcome")
    for kind, cases in (("hostile", hostile), ("genuine", genuine)):
        for name, data in cases.items():
            path.write_bytes(data)
            cpu, wall = _cpu(), time.perf_counter()
            try:
                read_pickled_ground_truth(str(path), None, named=True)
                outcome = "loaded"
            except ValueError as err:
                outcome = "refused: " + str(err).split(": ", 1)[1].replace(
                    "refusing this pickle: ", "")[:60]
            cpu, wall = _cpu() - cpu, time.perf_counter() - wall
            rows.append((kind, name, cpu, outcome))
            print(f"{name[:40]:40s} {len(data):9d} {cpu:6.2f} {wall:6.2f}  {outcome}")
    bad = [r for r in rows if r[0] == "hostile" and not r[3].startswith("refused")]
    slowest = max((r for r in rows if r[0] == "hostile"), key=lambda r: r[2])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(f"\n{len(hostile)} hostile inputs, refused: {len(hostile) - len(bad)}, loaded: "
          f"{len(bad)}")
    print(f"worst CPU time: {slowest[2]:.2f} s ({slowest[1]}); a genuine file: "
          f"{min(r[2] for r in rows if r[0] == 'genuine'):.2f} s")
    print(f"largest child: {peak / 2**20:.0f} MiB resident, under a limit of "
          f"{pickle_sandbox.MEMORY_BYTES >> 20} MiB of address space")
    print(f"machine: {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
