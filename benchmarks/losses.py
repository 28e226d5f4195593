"""Time and peak memory of every loss in ``tfaploss.losses``, forward + backward.

Measured the way the originals were measured for the anchors in the README: the loss
alone, gradient w.r.t. the embeddings, D=512 float32, labels = classes of 4 images,
median of ``--repeats`` (>= 5) runs after a warm-up, one fresh process per cell (a
child forked after the TensorFlow import and before any op ran, so the import is paid
once) and the peak resident memory of that process. Each cell runs under ``tf.function``, and
again with ``jit_compile=True`` (XLA).

    python benchmarks/losses.py                      # all losses, B in 256 1024 4096
    python benchmarks/losses.py --losses APLoss --sizes 256 --modes graph
    python benchmarks/losses.py --compare            # beside pytorch-metric-learning
    python benchmarks/losses.py --quick --compare    # 3 losses at B=1024, graph mode

``--compare`` runs pytorch-metric-learning's FastAPLoss, SmoothAPLoss, PNPLoss,
MultiSimilarityLoss, SupConLoss and ProxyAnchorLoss (torch on CPU, the optional
``bench`` extra; Proxy-Anchor with one fixed proxy per class of the batch, B/4) on the
same inputs, each cell in a fresh process,
and prints tfaploss's time over theirs per cell. Their Smooth-AP and PNP build B x B x B
tensors: a cell whose estimate exceeds ``--pml-memory-cap-gb`` is reported, not run.

Prints a table beside the anchors and writes JSON to ``benchmarks/results/``; its figures
are each cell's time and peak memory beside the floor's at the same B and mode, and with
``--compare`` beside pytorch-metric-learning's (the peer).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys

import harness

FLOOR = "scores_only"  # S = X X^T alone, the floor of every loss

# Figures of the original implementations (performance-anchors.md): seconds and GB.
ANCHORS = {
    FLOOR: ("S = XX^T alone", ["0.002 s", "0.022 s", "0.39 s, 0.35 GB"]),
    "APLoss": ("histogram AP (Revaud, dense quantiser)",
               ["0.026 s", "0.88 s, 0.87 GB", "20.3 s, 8.7 GB"]),
    "SmoothAPLoss": ("Smooth-AP (ROADMAP repo)", ["0.63 s, 0.8 GB", "OOM (>16 GB)", "OOM"]),
    "SupAPLoss": ("SupAP (ROADMAP repo)", ["2.23 s, 1.2 GB", "OOM", "OOM"]),
    "PNPLoss": ("PNP-Dq (PML 2.9)", ["0.69 s, 0.93 GB", "OOM", "OOM"]),
    "FastAPLoss": ("FastAP (PML 2.9)", ["0.011 s", "0.30 s", "5.6 s, 3.4 GB"]),
    "BlackBoxAPLoss": ("BlackBox AP (ROADMAP repo)", ["0.012 s", "0.21 s", "5.0 s, 1.1 GB"]),
}
SIZES = (256, 1024, 4096)
# --quick: one histogram, one sorting-free and one sigmoid-rank loss, one size, graph mode
QUICK_LOSSES = ("APLoss", "FastAPLoss", "SmoothAPLoss")
QUICK_SIZES, QUICK_MODES = (1024,), ("graph",)
# --tiny: one loss with a pytorch-metric-learning peer, at a size that runs in a blink
TINY_LOSSES, TINY_SIZES = ("FastAPLoss",), (64,)

# tfaploss loss -> pytorch-metric-learning's loss of the same definition, its arguments,
# and how many float32 B x B x B tensors it holds at once (0: none; ~B^2 memory).
PML_PEERS = {
    "FastAPLoss": ("FastAPLoss", {"num_bins": 10}, 0),
    "SmoothAPLoss": ("SmoothAPLoss", {"temperature": 0.01}, 6),
    "PNPLoss": ("PNPLoss", {"b": 2, "alpha": 4, "anneal": 0.01, "variant": "Dq"}, 4),
    "MultiSimilarityLoss": ("MultiSimilarityLoss", {"alpha": 2, "beta": 50, "base": 0.5}, 0),
    "SupConLoss": ("SupConLoss", {"temperature": 0.1}, 0),
    "ProxyAnchorLoss": ("ProxyAnchorLoss", {"margin": 0.1, "alpha": 32}, 0),
}
# Proxy losses: one proxy per class of the batch (B/4), fixed (seeded) values.
PROXY_LOSSES = ("ProxyAnchorLoss",)


def _proxies(batch, dim):
    import numpy as np

    return np.random.default_rng(1).standard_normal((batch // 4, dim)).astype("float32")


def _inputs(batch, dim):
    """The same embeddings and labels (classes of 4, contiguous) for every library."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, dim)).astype("float32")
    return x, np.repeat(np.arange(batch // 4), 4).astype("int64")


def run_pml_cell(loss_name, batch, repeats, dim=512):
    """One pytorch-metric-learning measurement in this (fresh) process."""
    import numpy as np
    import torch
    from pytorch_metric_learning import losses as pml_losses

    rss_start = harness.rss_gb()
    x_np, y_np = _inputs(batch, dim)
    labels = torch.from_numpy(y_np)
    if loss_name == FLOOR:  # torch's own floor: S = X X^T, forward and backward
        peer = "floor"

        def loss_fn(x, _):
            return (x @ x.T).sum()
    else:
        peer, kwargs, _ = PML_PEERS[loss_name]
        if loss_name in PROXY_LOSSES:
            kwargs = dict(kwargs, num_classes=batch // 4, embedding_size=dim)
        loss_fn = getattr(pml_losses, peer)(**kwargs)
        if loss_name in PROXY_LOSSES:
            loss_fn.proxies.data = torch.from_numpy(_proxies(batch, dim))

    def step():
        x = torch.from_numpy(x_np).requires_grad_(True)
        value = loss_fn(x, labels)
        value.backward()
        return float(value), x.grad

    last = {}
    timing = harness.time_calls(lambda: last.update(out=step()), repeats)
    value, grad = last["out"]
    return {
        "loss": f"pml:{peer}", "batch": batch, "mode": "torch-cpu", "dim": dim,
        **timing.as_dict(),
        "peak_rss_gb": harness.peak_rss_gb(), "rss_at_start_gb": rss_start, "value": value,
        "grad_finite": bool(np.isfinite(grad.numpy()).all()), "status": "ok",
        "torch_threads": torch.get_num_threads(),
    }


def missing_peer_packages() -> list[str]:
    """The peers' packages (PyTorch, pytorch-metric-learning) that are not installed."""
    import importlib.util

    return [name for name, module in (("torch", "torch"),
                                      ("pytorch-metric-learning", "pytorch_metric_learning"))
            if importlib.util.find_spec(module) is None]


def _spawn_pml(loss_name, batch, repeats, timeout, memory_cap_gb):
    """Run one pytorch-metric-learning cell in a fresh interpreter (no TF loaded)."""
    import subprocess

    peer, _, cubes = PML_PEERS.get(loss_name, ("floor", None, 0))
    need_gb = cubes * 4 * batch**3 / 2**30
    base = {"loss": f"pml:{peer}", "batch": batch, "mode": "torch-cpu"}
    missing = missing_peer_packages()
    if missing:
        return {**base, "status": f"not run: {' and '.join(missing)} not installed "
                                  "(pip install 'tfaploss[bench]')"}
    if need_gb > memory_cap_gb:
        return {**base, "status": f"not run: needs ~{need_gb:.0f} GB (B^3 tensors)"}
    cmd = [sys.executable, os.path.abspath(__file__), "--pml-cell", loss_name, str(batch),
           "--repeats", str(repeats)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {**base, "status": f"timeout>{timeout}s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode in (-9, 137):  # the kernel's OOM killer
        return {**base, "status": f"out of memory (killed; its B^3 tensors need ~{need_gb:.0f} GB)"}
    if done.returncode != 0 or not lines:
        return {**base, "status": f"failed (exit {done.returncode})",
                "error": done.stderr[-500:]}
    return json.loads(lines[-1])


def _loss_names():
    from tfaploss import losses
    from tfaploss.losses.base import RetrievalLoss

    names = []
    for name in losses.__all__:
        obj = getattr(losses, name)
        if isinstance(obj, type) and issubclass(obj, RetrievalLoss) and obj is not RetrievalLoss:
            names.append(name)
    return names


def run_cell(loss_name, batch, mode, repeats, dim=512):
    """One measurement, in this (fresh) process. Returns a dict."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    rss_start = harness.rss_gb()
    x_np, y_np = _inputs(batch, dim)
    x = tf.constant(x_np)
    labels = tf.constant(y_np.astype("int32"))
    if loss_name == FLOOR:
        def loss_fn(y, e):
            return tf.reduce_sum(tf.matmul(e, e, transpose_b=True))
    else:
        from tfaploss import losses

        if loss_name in PROXY_LOSSES:
            loss_fn = getattr(losses, loss_name)(batch // 4)
            loss_fn.proxies_layer.set_proxies(_proxies(batch, dim))
        else:
            loss_fn = getattr(losses, loss_name)()

    @tf.function(jit_compile=(mode == "xla"))
    def step(y, e):
        with tf.GradientTape() as tape:
            tape.watch(e)
            value = loss_fn(y, e)
        return value, tape.gradient(value, e)

    last = {}

    def call():
        value, grad = step(labels, x)
        last.update(value=value, grad=grad.numpy())  # the host copy ends the step

    timing = harness.time_calls(call, repeats)
    value, grad = last["value"], last["grad"]
    return {
        "loss": loss_name, "batch": batch, "mode": mode, "dim": dim,
        **timing.as_dict(),
        "peak_rss_gb": harness.peak_rss_gb(), "rss_at_start_gb": rss_start,
        "value": float(value),
        "grad_finite": bool(np.isfinite(grad).all()), "status": "ok",
    }


def _child(conn, loss_name, batch, mode, repeats):
    try:
        conn.send(run_cell(loss_name, batch, mode, repeats))
    except Exception as exc:  # noqa: BLE001 - report any failure, do not hang the parent
        status = "out of memory" if "OOM" in repr(exc) or isinstance(exc, MemoryError) else (
            "failed")
        conn.send({"loss": loss_name, "batch": batch, "mode": mode, "status": status,
                   "error": repr(exc)[-500:]})
    finally:
        conn.close()


def _spawn(loss_name, batch, mode, repeats, timeout):
    """Run one cell in a fresh child process and return its result.

    The parent has imported TensorFlow but run no op, so a forked child starts from
    the state of a fresh process (no graphs, no thread pools, no buffers) without
    paying the import again; its peak RSS is that of the cell alone plus the import.
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child_conn, loss_name, batch, mode, repeats))
    proc.start()
    child_conn.close()
    if parent_conn.poll(timeout):
        try:
            result = parent_conn.recv()
        except EOFError:
            result = None
    else:
        result = {"loss": loss_name, "batch": batch, "mode": mode,
                  "status": f"timeout>{timeout}s"}
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if result is None:
        status = "out of memory" if proc.exitcode in (-9, 137) else f"failed (exit {proc.exitcode})"
        result = {"loss": loss_name, "batch": batch, "mode": mode, "status": status}
    return result


def _fmt(cell):
    if cell is None:
        return "-"
    if cell["status"] != "ok":
        return cell["status"]
    return f"{cell['median_s']:.3g} s, {cell['peak_rss_gb']:.2f} GB"


def print_table(results, sizes, modes):
    by_key = {(r["loss"], r["batch"], r["mode"]): r for r in results}
    names = list(dict.fromkeys(r["loss"] for r in results if not r["loss"].startswith("pml:")))
    header = ["loss", "mode"] + [f"B={b}" for b in sizes] + ["original (anchors), " + "; ".join(
        f"B={b}" for b in sizes)]
    rows = []
    for name in names:
        anchor = ANCHORS.get(name)
        anchor_text = f"{anchor[0]}: " + "; ".join(anchor[1]) if anchor else "-"
        for i, mode in enumerate(modes):
            rows.append([name if i == 0 else "", mode]
                        + [_fmt(by_key.get((name, b, mode))) for b in sizes]
                        + [anchor_text if i == 0 else ""])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def print_comparison(results, sizes, modes):
    """tfaploss beside pytorch-metric-learning, same inputs, with the floor of each run."""
    by_key = {(r["loss"], r["batch"], r["mode"]): r for r in results}
    print("| loss | B | floor S=XX^T (TF graph) | tfaploss "
          + " | tfaploss ".join(modes) + " | floor S=XX^T (torch) | pytorch-metric-learning "
          "(torch CPU) | " + " | ".join(f"ratio {m} (tfaploss / PML)" for m in modes) + " |")
    print("|" + "---|" * (5 + 2 * len(modes)))
    for name, (peer, _, _) in PML_PEERS.items():
        for batch in sizes:
            peer_cell = by_key.get((f"pml:{peer}", batch, "torch-cpu"))
            if peer_cell is None:
                continue
            ours = [by_key.get((name, batch, m)) for m in modes]
            ratios = []
            for cell in ours:
                if cell and cell["status"] == "ok" and peer_cell["status"] == "ok":
                    ratios.append(f"{cell['median_s'] / peer_cell['median_s']:.3g}")
                else:
                    ratios.append("-")
            torch_floor = by_key.get(("pml:floor", batch, "torch-cpu"))
            print(f"| {name} | {batch} | {_fmt(by_key.get((FLOOR, batch, modes[0])))} | "
                  + " | ".join(_fmt(c) for c in ours)
                  + f" | {_fmt(torch_floor)} | {_fmt(peer_cell)} | "
                  + " | ".join(ratios) + " |")


def figures(results, sizes, modes):
    """Each cell's time and peak memory beside the floor's (same B and mode), and with
    ``--compare`` each graph-mode time beside pytorch-metric-learning's."""
    by_key = {(r["loss"], r["batch"], r["mode"]): r for r in results}
    out = []
    for r in results:
        if r["loss"] == FLOOR or r["loss"].startswith("pml:"):
            continue
        name = f"{r['loss']} B={r['batch']} {r['mode']}"
        floor = by_key.get((FLOOR, r["batch"], r["mode"]), {})
        ok, floor_ok = r["status"] == "ok", floor.get("status") == "ok"
        out.append(harness.figure(
            "losses", f"{name} time", r["median_s"] if ok else None, "s",
            floor=floor["median_s"] if floor_ok else None,
            floor_name="S = XX^T and its gradient", note="" if ok else r["status"]))
        if ok:
            out.append(harness.figure(
                "losses", f"{name} peak RSS", r["peak_rss_gb"], "GB",
                floor=floor["peak_rss_gb"] if floor_ok else None, floor_name="the floor's"))
        peer = by_key.get((f"pml:{PML_PEERS[r['loss']][0]}", r["batch"], "torch-cpu")
                          ) if r["loss"] in PML_PEERS else None
        if ok and peer is not None and r["mode"] == modes[0]:
            peer_ok = peer["status"] == "ok"
            out.append(harness.figure(
                "losses", f"{name} time vs PML", r["median_s"], "s",
                floor=peer["median_s"] if peer_ok else None, peer=True,
                floor_name="pytorch-metric-learning, torch CPU",
                note="" if peer_ok else f"peer {peer['status']}"))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--losses", nargs="*", help="loss class names (default: all exported)")
    parser.add_argument("--sizes", nargs="*", type=int, default=list(SIZES))
    parser.add_argument("--modes", nargs="*", default=["graph", "xla"], choices=["graph", "xla"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cell-timeout", type=int, default=300,
                        help="seconds allowed for one cell (process start, warm-up, runs)")
    harness.add_arguments(parser, "", quick_help="APLoss, FastAPLoss and SmoothAPLoss at "
                          "B=1024, graph mode (unless --losses/--sizes/--modes say otherwise)",
                          tiny_help="FastAPLoss at B=64, graph mode")
    parser.add_argument("--cell", nargs=3, metavar=("LOSS", "BATCH", "MODE"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--compare", action="store_true",
                        help="also run pytorch-metric-learning's FastAP, Smooth-AP and PNP "
                             "(torch CPU) and print the ratio per cell")
    parser.add_argument("--pml-memory-cap-gb", type=float, default=16.0,
                        help="do not start a peer cell whose B^3 tensors need more")
    parser.add_argument("--pml-cell", nargs=2, metavar=("LOSS", "BATCH"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.quick = True
        args.losses = args.losses or list(TINY_LOSSES)
        args.sizes = args.sizes if args.sizes != list(SIZES) else list(TINY_SIZES)
    if args.quick:
        args.losses = args.losses or list(QUICK_LOSSES)
        args.sizes = args.sizes if args.sizes != list(SIZES) else list(QUICK_SIZES)
        args.modes = args.modes if args.modes != ["graph", "xla"] else list(QUICK_MODES)
    if args.repeats < 5:
        parser.error(f"--repeats must be >= 5 (a median of at least 5); received {args.repeats}")

    if args.cell:
        name, batch, mode = args.cell
        print(json.dumps(run_cell(name, int(batch), mode, args.repeats)), flush=True)
        return 0
    if args.pml_cell:
        name, batch = args.pml_cell
        print(json.dumps(run_pml_cell(name, int(batch), args.repeats)), flush=True)
        return 0

    names = [FLOOR] + (args.losses or (list(PML_PEERS) if args.compare else _loss_names()))
    results = []
    total = len(names) * len(args.sizes) * len(args.modes)
    done = 0
    for name in names:
        for batch in args.sizes:
            for mode in args.modes:
                done += 1
                print(f"[{done}/{total}] {name} B={batch} {mode} ...", end=" ", flush=True)
                cell = _spawn(name, batch, mode, args.repeats, args.cell_timeout)
                results.append(cell)
                print(_fmt(cell), flush=True)
    if args.compare:
        for name in names:
            if name not in PML_PEERS and name != FLOOR:
                continue
            for batch in args.sizes:
                peer = PML_PEERS[name][0] if name in PML_PEERS else "floor S=XX^T (torch)"
                print(f"[peer] pytorch-metric-learning {peer} B={batch} ...",
                      end=" ", flush=True)
                cell = _spawn_pml(name, batch, args.repeats, args.cell_timeout,
                                  args.pml_memory_cap_gb)
                results.append(cell)
                print(_fmt(cell), flush=True)
    print()
    print_table(results, args.sizes, args.modes)
    if args.compare:
        print()
        print_comparison(results, args.sizes, args.modes)

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or harness.RESULTS_DIR / f"losses-{stamp}.json"
    cells = figures(results, args.sizes, args.modes)
    print()
    print(harness.summary_table(cells))
    harness.write_results(out, "losses", args, cells, results=results, protocol={
        "dim": 512, "labels": "classes of 4 images",
        "measure": "forward+backward w.r.t. embeddings; median after warm-up; "
                   "peak RSS of a fresh process per cell"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
