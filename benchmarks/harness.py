"""The shared harness of the performance suite: timing, peak memory, each figure beside
its floor or peer, JSON out and one summary table.

Every script of ``benchmarks/`` measures its own subject and prints its own table; what
they share lives here so that their figures read alike:

* :func:`time_calls`: a warm-up call, then ``repeats`` timed calls (min and median);
* :func:`peak_rss_gb` / :func:`rss_gb`: one definition of peak and current memory, of
  this process or of a child;
* :func:`figure`: one headline number beside the floor it cannot beat (or the peer it
  is compared with), measured in the same run, and their ratio;
* :func:`add_arguments` / :func:`write_results`: ``--quick`` and ``--out``, and the
  results file (``{"benchmark", "meta", "figures", ...}``, written to a temporary name
  and renamed, so a killed run never leaves half a file);
* :func:`summary_table`: the figures of one run, or of the whole suite
  (``benchmarks/suite.py``), beside the ratios of an earlier results file.

Example:

```python
import harness  # benchmarks/ is the script's own folder, first on sys.path

timing = harness.time_calls(lambda: step(x), repeats=5)
floor = harness.time_calls(lambda: x @ x.T, repeats=5)
fig = harness.figure("losses", "APLoss B=1024 graph", timing.median, "s",
                     floor=floor.median, floor_name="S = XX^T")
harness.write_results(path, "losses", args, [fig], rows=rows)
print(harness.summary_table([fig]))
```
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Timing:
    """Seconds of the timed calls, and of the warm-up call before them."""

    times: list[float] = field(default_factory=list)
    warmup: float = 0.0

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def as_dict(self) -> dict:
        return {"min_s": self.min, "median_s": self.median, "times_s": self.times,
                "warmup_s": self.warmup}


def time_calls(fn, repeats: int = 5, warmup: int = 1, on_call=None) -> Timing:
    """Calls ``fn`` ``warmup`` times untimed (tracing, allocation), then ``repeats`` times.

    Args:
      fn: a callable of no arguments; it must return only once its work is done (copy
        a device result to the host inside it).
      repeats: timed calls.
      warmup: untimed calls first; their total seconds are kept in ``Timing.warmup``.
      on_call: called with (index, seconds) after each timed call (progress lines).
    """
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    timing = Timing(warmup=time.perf_counter() - start)
    for i in range(repeats):
        start = time.perf_counter()
        fn()
        timing.times.append(time.perf_counter() - start)
        if on_call is not None:
            on_call(i, timing.times[-1])
    return timing


def _status_gb(pid, key: str) -> float:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return 0.0


def peak_rss_gb(pid: int | None = None) -> float:
    """Peak resident memory (GiB) of this process, or of process ``pid`` (0 if gone)."""
    if pid is None:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return _status_gb(pid, "VmHWM:")


def rss_gb(pid: int | None = None) -> float:
    """Current resident memory (GiB) of this process, or of process ``pid`` (0 if gone)."""
    return _status_gb("self" if pid is None else pid, "VmRSS:")


def figure(benchmark: str, name: str, value: float | None, unit: str, *,
           floor: float | None = None, floor_name: str = "", peer: bool = False,
           higher_is_better: bool = False, note: str = "") -> dict:
    """One headline number beside its floor (or peer) and the ratio value / floor.

    Args:
      benchmark: the script's name (``losses``, ``search``...).
      name: what was measured; with ``benchmark`` it names the figure across runs.
      value: the measurement (``None``: not measured, e.g. out of memory).
      unit: ``s``, ``GB``, ``images/s``...
      floor: the reference measured in the same run, in the same unit.
      floor_name: what the reference is.
      peer: the reference is another implementation, not a floor.
      higher_is_better: a rate (the ratio should approach 1 from below) rather than a
        cost (the ratio should approach 1 from above).
      note: a status or a caveat shown in the table.
    """
    ratio = (value / floor if value is not None and floor not in (None, 0) else None)
    return {"benchmark": benchmark, "name": name, "value": value, "unit": unit,
            "floor": floor, "floor_name": floor_name,
            "reference": "peer" if peer else "floor", "ratio": ratio,
            "higher_is_better": higher_is_better, "note": note}


def add_arguments(parser, default_out: str | os.PathLike, out_aliases=(), quick_help=None,
                  tiny_help=None):
    """Adds ``--quick``, ``--tiny`` and ``--out`` (the results file) to a script's parser.

    ``--tiny`` computes the same figures beside the same floors as ``--quick`` on toy
    problems, so that a test can run the whole suite in seconds per script; its
    numbers say nothing about speed. A script applies its tiny settings after (and on
    top of) its quick ones: ``args.quick`` is set too.
    """
    parser.add_argument("--quick", action="store_true",
                        help=quick_help or "a smaller run that keeps every figure (the "
                                           "suite's quick mode)")
    parser.add_argument("--tiny", action="store_true",
                        help=(tiny_help or "toy sizes") + ": the quick mode's figures in "
                        "seconds, for the suite's test (the numbers mean nothing)")
    parser.add_argument("--out", *out_aliases, dest="out", default=str(default_out),
                        help="results JSON (written to a temporary name, then renamed)")


def machine() -> dict:
    return {"host": platform.node(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average_1min": os.getloadavg()[0]}


def write_json(path, payload) -> Path:
    """Writes ``payload`` as JSON to ``path`` through a temporary name and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def write_results(path, benchmark: str, args, figures: list[dict], **extra) -> Path:
    """The results file of one script: its figures, the run's settings, and ``extra``."""
    config = {k: v for k, v in vars(args).items()} if args is not None else {}
    meta = {"benchmark": benchmark, "argv": sys.argv[1:], "quick": config.get("quick", False),
            "tiny": config.get("tiny", False),
            "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "config": config}
    out = write_json(path, {"benchmark": benchmark, "meta": meta, "figures": figures, **extra})
    print(f"wrote {out}")
    return out


def load_figures(path) -> list[dict]:
    """The figures of a results file: one script's, or the suite's."""
    data = json.loads(Path(path).read_text())
    return list(data.get("figures", []))


def _num(value, unit="") -> str:
    if value is None:
        return "-"
    text = f"{value:.3g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return f"{text} {unit}".strip()


def summary_table(figures: list[dict], previous: list[dict] | None = None) -> str:
    """A Markdown table: each figure, its floor or peer, the ratio, and with
    ``previous`` (an earlier run's figures) the ratio that run had."""
    before = {(f["benchmark"], f["name"]): f.get("ratio") for f in previous or []}
    header = ["benchmark", "figure", "value", "floor / peer", "ratio"]
    if previous is not None:
        header.append("previous ratio")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for f in figures:
        reference = "-"
        if f.get("floor") is not None:
            kind = "peer" if f.get("reference") == "peer" else "floor"
            reference = f"{_num(f['floor'], f['unit'])} ({kind}: {f.get('floor_name', '')})"
        value = _num(f.get("value"), f.get("unit", ""))
        if f.get("note"):
            value = f"{value}, {f['note']}" if f.get("value") is not None else f["note"]
        ratio = "-" if f.get("ratio") is None else f"{f['ratio']:.2f}"
        row = [f["benchmark"], f["name"], value, reference, ratio]
        if previous is not None:
            old = before.get((f["benchmark"], f["name"]))
            row.append("-" if old is None else f"{old:.2f}")
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in row) + " |")
    return "\n".join(lines)
