"""Search backends at scale: build time, queries/s and recall@k against exact search.

    python benchmarks/search.py                       # 1M x 128 and 200k x 512
    python benchmarks/search.py --sizes 100000x64 --queries 200   # quick look

Database and queries are random unit vectors (float32), the hardest case for a
partitioning index: without cluster structure the true neighbours spread over many
leaves, so recall at a given speed is lower than on real embeddings. For each size:

* ``exact``: chunked TF matmul + top-k (GPU when TensorFlow sees one); its results
  are the reference for recall.
* ``scann``: ScaNN float32 brute force.
* ``scann_ah``: ScaNN tree + AH + reorder with the parameters chosen from the
  database size (``scann_ah_params``), then the same index searching more leaves
  (``--ah_leaves_factors``), which needs no rebuild.

Queries/s is measured over all queries in one batched call (after one warm-up call
on a few queries), with the threads available to this process. Prints a table and
writes JSON to ``benchmarks/results/search.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfaploss.evaluation.searchers import ExactSearcher, ScannSearcher


def unit_vectors(rng, n, d, chunk=100_000):
    out = np.empty((n, d), np.float32)
    for i in range(0, n, chunk):
        x = rng.standard_normal((min(chunk, n - i), d), dtype=np.float32)
        out[i:i + len(x)] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def recall_at_k(found, reference):
    k = reference.shape[1]
    return float(np.mean([len(set(a[:k]) & set(b)) / k for a, b in zip(found, reference)]))


def timed_search(searcher, queries, k, repeats):
    searcher.search(queries[:8], k)  # warm-up (tracing, thread pools)
    best, idx = np.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        idx, _ = searcher.search(queries, k)
        best = min(best, time.perf_counter() - t0)
    return idx, best


def bench_size(n, d, args, rng):
    print(f"\n== database {n:,} x {d}, {args.queries} queries, k={args.k} ==", flush=True)
    db = unit_vectors(rng, n, d)
    queries = unit_vectors(rng, args.queries, d)
    rows = []

    def record(name, build_s, search_s, idx, reference, extra=None):
        row = {"database": f"{n}x{d}", "backend": name, "build_s": round(build_s, 2),
               "queries_per_s": round(args.queries / search_s, 1),
               "search_s": round(search_s, 3),
               f"recall@{args.k}": round(recall_at_k(idx, reference), 4), **(extra or {})}
        rows.append(row)
        print(f"  {name:<34} build {build_s:8.2f} s   {row['queries_per_s']:10.1f} q/s   "
              f"recall@{args.k} {row[f'recall@{args.k}']:.4f}", flush=True)

    import tensorflow as tf

    device = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    t0 = time.perf_counter()
    exact = ExactSearcher(db)
    exact.search(queries[:1], args.k)  # places the database (on the GPU when there is one)
    build = time.perf_counter() - t0
    reference, search_s = timed_search(exact, queries, args.k, args.repeats)
    record(f"exact (TF, {device})", build, search_s, reference, reference)
    del exact

    if "scann" in args.backends:
        t0 = time.perf_counter()
        bf = ScannSearcher(db, mode="brute_force", num_neighbors=args.k)
        build = time.perf_counter() - t0
        idx, search_s = timed_search(bf, queries, args.k, args.repeats)
        record("scann brute force", build, search_s, idx, reference)
        del bf

    if "scann_ah" in args.backends:
        t0 = time.perf_counter()
        ah = ScannSearcher(db, mode="ah", num_neighbors=args.k)
        build = time.perf_counter() - t0
        params = dict(ah.params)
        base_leaves = params.get("num_leaves_to_search")
        factors = [1.0] + ([f for f in args.ah_leaves_factors if f != 1.0] if base_leaves else [])
        for f in factors:
            if base_leaves:
                leaves = int(min(params["num_leaves"], round(base_leaves * f)))
                ah.set_search_params(num_leaves_to_search=leaves)
                name = f"scann AH ({leaves}/{params['num_leaves']} leaves)"
            else:
                name = "scann AH (no tree)"
            idx, search_s = timed_search(ah, queries, args.k, args.repeats)
            record(name, build if f == 1.0 else 0.0, search_s, idx, reference,
                   {"params": dict(ah.params)})
        del ah
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1000000x128,200000x512",
                   help="comma-separated NxD database sizes")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--repeats", type=int, default=1, help="timed searches (best is kept)")
    p.add_argument("--backends", default="exact,scann,scann_ah")
    p.add_argument("--ah_leaves_factors", type=float, nargs="*", default=[3.0, 10.0],
                   help="also search this many times the default number of leaves")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "search.json"))
    args = p.parse_args(argv)
    args.backends = args.backends.split(",")
    rng = np.random.default_rng(args.seed)
    rows = []
    for size in args.sizes.split(","):
        n, d = (int(v) for v in size.lower().split("x"))
        rows += bench_size(n, d, args, rng)

    header = f"| database | backend | build (s) | queries/s | recall@{args.k} |"
    print("\n" + header + "\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['database']} | {r['backend']} | {r['build_s']:.2f} | "
              f"{r['queries_per_s']:.1f} | {r[f'recall@{args.k}']:.4f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"rows": rows, "queries": args.queries, "k": args.k,
                   "cpu_count": os.cpu_count(), "machine": platform.machine(),
                   "python": platform.python_version()}, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
