"""What the ranks' stop agreement costs per step under ``tfaploss train`` across processes.

    python benchmarks/stop_agreement.py            # 2 local processes, torch and JAX
    python benchmarks/stop_agreement.py --quick    # fewer calls

Every step of a run across processes ends with one agreement
(:class:`tfaploss.run.processes.StopAgreement`: did any rank get SIGTERM, did any
rank's callbacks stop training), an all-reduce of two integers
(:meth:`~tfaploss.run.processes.ProcessGroup.any_rank`). For each backend this starts 2
processes on 127.0.0.1 the way ``tfaploss train`` does (:func:`tfaploss.run.processes.start`:
torchrun's environment with gloo; JAX's coordinator), and times in each, after a
barrier, ``--calls`` agreements beside the peer that every step already pays: the same
group's reduction of small_cnn's gradient (288,489 float32; on PyTorch
``MultiStageModel``'s all-reduce, on JAX an all-gather of as many values through the
same primitive as the agreement). The slower rank's median is kept.

Writes ``benchmarks/results/stop_agreement.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

NAME = "stop_agreement"
RANKS = 2
GRADIENT = 288_489  # small_cnn's trainable parameters (tfaploss train's summary)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(backend: str, rank: int, port: int, calls: int, out: str) -> None:
    """One rank: join the group as tfaploss train does, time both collectives."""
    import numpy as np

    from tfaploss.run import processes

    if backend == "torch":
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        group = processes.start(None)
        import torch

        from tfaploss.ops import distribute_torch

        torch.set_num_threads(1)
        gradient = torch.ones(GRADIENT)

        def peer():
            distribute_torch.average_gradients([gradient])
    else:
        group = processes.start(None, coordinator=f"127.0.0.1:{port}",
                                num_processes=RANKS, process_id=rank)
        from jax.experimental import multihost_utils

        gradient = np.ones(GRADIENT, np.float32)

        def peer():
            np.asarray(multihost_utils.process_allgather(gradient))

    assert group.world_size == RANKS
    group.barrier()
    agreement = harness.time_calls(lambda: group.any_rank(0, 0), repeats=calls, warmup=5)
    group.barrier()
    reduction = harness.time_calls(peer, repeats=max(5, calls // 10), warmup=2)
    Path(out).write_text(json.dumps({"agreement": agreement.as_dict(),
                                     "peer": reduction.as_dict()}))


def _measure(backend: str, calls: int) -> dict:
    """Both ranks' timings (the slower rank's median of each)."""
    port = _free_port()
    env = {**os.environ, "KERAS_BACKEND": backend, "CUDA_VISIBLE_DEVICES": "",
           "TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as folder:
        outs = [Path(folder) / f"rank{r}.json" for r in range(RANKS)]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", backend, str(r),
                                   str(port), str(calls), str(outs[r])], env=env)
                 for r in range(RANKS)]
        for proc in procs:
            proc.wait(timeout=600)
        if any(proc.returncode for proc in procs):
            raise RuntimeError(f"{backend}: a rank failed (exit codes "
                               f"{[p.returncode for p in procs]})")
        ranks = [json.loads(out.read_text()) for out in outs]
    return {key: max(r[key]["median_s"] for r in ranks) for key in ("agreement", "peer")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_arguments(parser, harness.RESULTS_DIR / f"{NAME}.json")
    parser.add_argument("--calls", type=int, default=500, help="agreements timed per rank")
    parser.add_argument("--backends", default="torch,jax")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        backend, rank, port, calls, out = args.worker
        _worker(backend, int(rank), int(port), int(calls), out)
        return 0
    calls = 20 if args.tiny else 100 if args.quick else args.calls
    figures = []
    for backend in args.backends.split(","):
        medians = _measure(backend, calls)
        peer = ("MultiStageModel's gradient all-reduce" if backend == "torch"
                else "an all-gather of as many floats")
        figures.append(harness.figure(
            NAME, f"agreement per step, {RANKS} CPU processes, {backend}",
            medians["agreement"] * 1e3, "ms", floor=medians["peer"] * 1e3,
            floor_name=f"{peer} (small_cnn, {GRADIENT:,} float32)", peer=True))
        print(f"{backend}: agreement {medians['agreement'] * 1e3:.3f} ms per step, beside "
              f"{peer} {medians['peer'] * 1e3:.3f} ms (median of the slower rank, "
              f"{calls} calls)")
    print(harness.summary_table(figures))
    harness.write_results(args.out, NAME, args, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
