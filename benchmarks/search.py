"""Search at scale: exact search against the bare product, ScaNN against faiss, and
``retrieval_metrics`` against the search it is made of.

    python benchmarks/search.py            # 300k, 1M x 128 + 100k x 512 metrics (40 min, 2 busy cores)
    python benchmarks/search.py --quick    # 50k x 64, a minute or two
    python benchmarks/search.py --sizes 300000x128 --datasets clustered --no_faiss
    python benchmarks/search.py --sizes 300000x128 --datasets clustered --exact_only

Every figure is printed beside the floor it cannot beat, measured in the same run:

1. **Exact search** (``ExactSearcher``, k = ``--k``, 1,000 queries): queries/s against
   the bare float32 product ``queries @ database.T`` with nothing selected (the best of
   one call and of the same product in tiles written into a reused buffer), timed
   in turn with the search (best of ``--repeats`` each), in wall time and in CPU
   seconds (robust to a busy machine). Target: >= 0.8 of the floor. Contenders:
   float32 alone (``prefilter="none"``: any CPU), the bfloat16 prefilter with each
   product that can run here (PyTorch, TensorFlow; CPUs with AMX or AVX512-BF16), and
   the default, which picks one; beside them the bare bfloat16 products, the
   prefilter's own floor. Each searcher's first call is timed too, in a fresh process
   (the real one-off costs: the product's import, the bfloat16 copy of the
   database), beside float32 alone's first call (``--first_call_tf``: also in a
   process that has imported TensorFlow, as a training run has); each warm figure
   also carries its multiple of float32 alone's (``vs_float32_alone``).
2. **Approximate search** at k = ``--ann_k`` (10), every searcher tuned to each target
   recall@10 of ``--target_recall`` (0.9, 0.95, 0.99) on 1,000 *tuning* queries and
   then measured on the 1,000 *test* queries, which no tuner saw (both drawn from the
   database's distribution, apart from it). One acceptance rule for all: the fastest
   setting whose tuning recall has its 95 % Wilson lower bound at or above the target.
   ScaNN and our faiss backend (``FaissSearcher``: IVF-Flat, IVF-PQ, HNSW) by
   ``tfaploss.evaluation.tuner``, each run once for the highest target
   (``max_seconds=--tune_seconds``); a lower target takes the fastest of its trials
   that meets it (the trials go cheapest first, so they hold those settings); the
   tuning time is the build time; faiss-cpu's own IVF-Flat, IVF-PQ (4-bit fast-scan,
   d/2 sub-quantizers, exact re-ranking: ScaNN's AH + reorder in faiss) and HNSW32 by
   a sweep of their search
   parameters (``nprobe``, ``k_factor``, ``efSearch``), which is what faiss's
   ``ParameterSpace`` explores. ScaNN's defaults are listed too. Each row gives q/s,
   the multiple of exact search at the same k, the recall on the test queries (a
   recall below the target is flagged) and the build time. Goal: the tuned ScaNN at
   or ahead of the best faiss index at equal recall on clustered and spread data.
3. **retrieval_metrics** (exact backend, self-retrieval, ``--metrics_size``): wall time
   against one exact top-k search of the same queries and against the bare product.

Data sets (both unit-norm float32; queries are drawn from the same distribution as the
database, separately from it):

* ``clustered``: :func:`clustered` -- 2,000 centres drawn uniformly on the sphere; a
  point is ``normalize(centre + spread * g / sqrt(D))`` with ``g ~ N(0, I_D)`` and a
  centre chosen uniformly, ``spread = --cluster_spread`` (1.0: a point's cosine to
  its centre is about 0.7, to another point of its cluster about 0.5, to an unrelated
  point about 0 +- 1/sqrt(D)).
* ``spread``: the same with ``spread = --wide_spread`` (2.0: cosine to the centre about
  0.45), where the defaults of a partitioning index lose recall;
* ``random``: uniform on the sphere -- the **worst case** for a partitioning index (no
  structure: the true neighbours scatter over many leaves); kept for honesty, real
  embeddings are clustered.

Writes the rows and the figures to ``benchmarks/results/search.json``. Queries/s use every core this
process may use; on a shared machine compare the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness

from tfaploss.evaluation import bfloat16_prefilter
from tfaploss.evaluation.exact_search import ExactSearcher
from tfaploss.evaluation.faiss_search import FaissSearcher, FaissSetting
from tfaploss.evaluation.scann_search import ScannSearcher, ScannSetting
from tfaploss.process_settings import available_cores as available_threads

CLUSTERS = 2000


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def random_unit(rng, n, d, chunk=100_000):
    """Uniform on the unit sphere (worst case for partitioning)."""
    out = np.empty((n, d), np.float32)
    for i in range(0, n, chunk):
        out[i:i + chunk] = _unit(rng.standard_normal((min(chunk, n - i), d), dtype=np.float32))
    return out


def clustered(rng, n, d, centres, spread, chunk=100_000):
    """``normalize(centres[c] + spread * g / sqrt(d))``, ``c`` uniform, ``g ~ N(0, I)``."""
    out = np.empty((n, d), np.float32)
    for i in range(0, n, chunk):
        m = min(chunk, n - i)
        c = rng.integers(0, len(centres), m)
        g = rng.standard_normal((m, d), dtype=np.float32) * np.float32(spread / np.sqrt(d))
        out[i:i + m] = _unit(centres[c] + g)
    return out


def make_data(kind, n, d, num_queries, args, rng):
    """(database, test queries, tuning queries), all of one distribution."""
    if kind == "random":
        return tuple(random_unit(rng, m, d) for m in (n, num_queries, num_queries))
    if kind not in ("clustered", "spread"):
        raise SystemExit(f"--datasets: unknown kind {kind!r}; choose clustered, spread, "
                         "random")
    centres = random_unit(rng, CLUSTERS, d)
    spread = args.cluster_spread if kind == "clustered" else args.wide_spread
    return tuple(clustered(rng, m, d, centres, spread) for m in (n, num_queries, num_queries))


def best_time(fn, repeats):
    return harness.time_calls(fn, repeats, warmup=0).min


def product_variants(queries, db):
    """The bare product queries @ db.T, as callables: one call (when its output fits in
    1.5 GB) and row tiles written into a reused buffer (BLAS threads)."""
    variants = []
    if len(queries) * len(db) * 4 <= 1.5e9:
        variants.append(lambda: queries @ db.T)
    for rows in (8192, 65536):
        buf = np.empty((len(queries), rows), np.float32)

        def tiles(rows=rows, buf=buf):
            for d0 in range(0, len(db), rows):
                block = db[d0:d0 + rows]
                out = buf.reshape(-1)[:len(queries) * len(block)].reshape(len(queries), -1)
                np.matmul(queries, block.T, out=out)

        variants.append(tiles)
    return variants


def product_floor(queries, db, repeats):
    """Seconds of the bare product: the best of :func:`product_variants`."""
    return min(best_time(fn, repeats) for fn in product_variants(queries, db))


def recall(found, reference):
    k = reference.shape[1]
    return float(np.mean([len(set(a[:k]) & set(b)) / k for a, b in zip(found, reference)]))


def timed_search(search, queries, k, repeats):
    search(queries[:8], k)  # warm-up (thread pools, tracing)
    out = {}

    def run():
        out["idx"] = search(queries, k)[0]

    seconds = best_time(run, repeats)
    return out["idx"], seconds


class Table:
    def __init__(self):
        self.rows = []
        self.figures = []

    def add(self, section, data, what, value, unit, floor=None, floor_what="", **extra):
        row = {"section": section, "data": data, "what": what, "value": round(value, 3),
               "unit": unit, **extra}
        if floor is not None:
            row.update(floor=round(floor, 3), floor_what=floor_what,
                       ratio=round(value / floor, 3))
            self.figures.append(harness.figure(
                "search", f"{data}: {what}", value, unit, floor=floor, floor_name=floor_what,
                peer=section == "ann",
                higher_is_better=unit in ("q/s", "q/CPU-s", "first-call q/s")))
        self.rows.append(row)
        tail = (f"   floor {floor:10.1f} ({floor_what})  ratio {value / floor:6.2f}"
                if floor is not None else "")
        more = "  " + "  ".join(f"{k} {v}" for k, v in extra.items()) if extra else ""
        print(f"  {what:<44} {value:10.1f} {unit}{tail}{more}", flush=True)


def bfloat16_product(queries, db, product):
    """The bare bfloat16 product of the prefilter (its own floor) as callables: all
    queries against each database block, and the prefilter's query blocks in turn
    ([] where that product cannot run)."""
    if bfloat16_prefilter.choose_product(product)[0] is None:
        return []
    prepared = bfloat16_prefilter.PreparedDatabase(db, product)
    bits = bfloat16_prefilter.round_to_bfloat16(queries)
    whole = prepared.product.from_bits(bits)
    step = bfloat16_prefilter.QUERY_BLOCK
    tiles = [prepared.product.from_bits(bits[q0:q0 + step])
             for q0 in range(0, len(queries), step)]
    return [lambda: [prepared.product.matmul(whole, block) for block in prepared.blocks],
            lambda: [prepared.product.matmul(q, block) for q in tiles
                     for block in prepared.blocks]]


def exact_contenders(db):
    """(name, searcher) of exact search: float32 alone and, where the CPU can, each
    bfloat16 prefilter; the default last (its name is completed once it has run)."""
    out = [(FLOAT32_ALONE, ExactSearcher(db, prefilter="none"))]
    for product in ("torch", "tensorflow"):
        if bfloat16_prefilter.choose_product(product)[0] is not None:
            out.append((f"exact, bfloat16 prefilter ({product})",
                        ExactSearcher(db, prefilter=f"bfloat16-{product}")))
    out.append(("exact default", ExactSearcher(db)))
    return out


FLOAT32_ALONE = "exact float32 alone"

# The first call of a user's script: a fresh interpreter that has imported tfaploss
# (and, with --first_call_tf, TensorFlow, as a training run has) times one search.
_FIRST_CALL = """
import json, sys, time
import numpy as np
if sys.argv[5] == "tensorflow":
    import tensorflow
from tfaploss.evaluation.exact_search import ExactSearcher
db, queries = np.load(sys.argv[1]), np.load(sys.argv[2])
searcher = ExactSearcher(db, prefilter=sys.argv[3])
t0 = time.perf_counter()
resolved = searcher.resolved_prefilter(len(queries))  # what the search will take
searcher.search(queries, int(sys.argv[4]))
print(json.dumps({"seconds": time.perf_counter() - t0, "resolved": resolved}))
"""


def first_calls(db, queries, settings, k, imported=("",), repeats=1):
    """{(prefilter setting, pre-imported module): (seconds, resolved product)} of the
    first search in a fresh process: the real one-off costs (the product's import, the
    bfloat16 copy of the database, thread pools). The best of ``repeats`` processes
    each, run in turn (setting after setting, then again)."""
    import subprocess
    import tempfile

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"{name}.npy") for name in ("db", "queries")]
        for path, array in zip(paths, (db, queries)):
            np.save(path, array)
        for _, module, setting in itertools.product(range(max(repeats, 1)), imported,
                                                    settings):
            done = subprocess.run(
                [sys.executable, "-c", _FIRST_CALL, *paths, setting, str(k), module],
                cwd=repo, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"the first-call process ({setting}) failed:\n"
                                 f"{done.stderr[-3000:]}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            best = out.get((setting, module), (np.inf, None))
            if got["seconds"] < best[0]:
                out[setting, module] = got["seconds"], got["resolved"]
    return out


def bench_exact(table, label, db, queries, args):
    """Exact search against the bare float32 product, interleaved (product variants,
    each searcher, product variants, ...; the best of ``--repeats`` each), in wall time
    and in CPU seconds of this process: on a busy machine the CPU seconds measure the
    work without the time lost waiting for a core. Each searcher runs once before the
    timing (thread pools; the prefilter's bfloat16 copy of the database, timed apart).

    Beside each searcher's warm figure, its first call in a fresh process
    (:func:`first_calls`) against float32 alone's first call, and the warm figure
    against float32 alone's warm one."""
    contenders = exact_contenders(db)
    settings = [searcher.prefilter for _, searcher in contenders]
    first = first_calls(db, queries, settings, args.k,
                        ("", "tensorflow") if args.first_call_tf else ("",), args.repeats)
    named = []
    for name, searcher in contenders:
        t0 = time.perf_counter()
        searcher.search(queries, args.k)
        seconds = time.perf_counter() - t0
        resolved = searcher.resolved_prefilter(len(queries))
        if searcher.prefilter == "auto":  # what its warm searches take, in this process
            name = f"{name} ({'bfloat16 ' + resolved if resolved else 'float32'})"
        if resolved is not None:
            table.add("exact", label, f"{name}: its first search here (bfloat16 copy made)",
                      seconds, "s")
        named.append((name, searcher))
    contenders = named
    variants = product_variants(queries, db)
    wall = {"floor": np.inf, **{name: np.inf for name, _ in contenders}}
    cpu = dict(wall)
    runs = [("floor", v) for v in variants] + [
        (name, lambda s=searcher: s.search(queries, args.k)) for name, searcher in contenders]
    for product in ("torch", "tensorflow"):
        name = f"bare bfloat16 product ({product})"
        for fn in bfloat16_product(queries, db, product):
            runs.append((name, fn))
            wall[name] = cpu[name] = np.inf
    for _ in range(max(args.repeats, 1)):
        for name, fn in runs:
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    floor_qps = len(queries) / wall["floor"]
    searchers = dict(contenders)
    for name, seconds in wall.items():
        if name == "floor":
            continue
        what = f"{name}, k={args.k}" if name in searchers else name
        if name in searchers:
            for module in ("", "tensorflow") if args.first_call_tf else ("",):
                t_first, resolved = first[searchers[name].prefilter, module]
                where = " (tensorflow imported)" if module else ""
                table.add("exact", label, f"{what}: first call in a fresh process{where}",
                          len(queries) / t_first, "first-call q/s",
                          len(queries) / first["none", module][0],
                          f"float32 alone, first call{where}",
                          took=resolved or "float32", seconds=round(t_first, 3))
        extra = ({"vs_float32_alone": round(wall[FLOAT32_ALONE] / seconds, 3)}
                 if name in searchers else {})
        table.add("exact", label, what, len(queries) / seconds, "q/s",
                  floor_qps, "bare float32 product q @ db.T", **extra)
        if name in searchers:
            table.add("exact", label, f"{what}, per CPU second", len(queries) / cpu[name],
                      "q/CPU-s", len(queries) / cpu["floor"], "bare product per CPU second")
    if args.with_tf:
        tf_exact = ExactSearcher(db, engine="tensorflow")
        _, t_tf = timed_search(tf_exact.search, queries, args.k, 1)
        table.add("exact", label, f"exact tensorflow (before), k={args.k}",
                  len(queries) / t_tf, "q/s", floor_qps, "bare product q @ db.T")
    return contenders[-1][1], floor_qps


def bench_ann(table, label, db, queries, tune_queries, exact, args):
    """Approximate search at k = ``--ann_k`` on ``queries`` (never seen by any tuner).

    Each searcher is tuned on ``tune_queries`` (same distribution, drawn apart) to each
    target of ``--target_recall`` with one rule: the fastest setting whose recall@k on
    the tuning queries has its 95 % Wilson lower bound at or above the target (the rule
    of ``tfaploss.evaluation.tuner``). Then it is timed and its recall measured on the
    fresh ``queries``; a fresh recall below the target is flagged.
    """
    k = args.ann_k
    reference, t_exact = timed_search(exact.search, queries, k, args.repeats)
    exact_qps = len(queries) / t_exact
    table.add("ann", label, f"exact numpy, k={k} (the reference)", exact_qps, "q/s")

    t0 = time.perf_counter()
    ah = ScannSearcher(db, mode="ah", num_neighbors=k)
    build = time.perf_counter() - t0
    idx, t = timed_search(ah.search, queries, k, args.repeats)
    p = ah.params
    table.add("ann", label, "scann defaults (tree + AH + reorder)", len(queries) / t, "q/s",
              exact_qps, "exact q/s", recall=round(recall(idx, reference), 4),
              build_s=round(build, 1),
              setting=f"{p.get('num_leaves_to_search')}/{p.get('num_leaves')} leaves, "
                      f"reorder {p['reorder_num_neighbors']}")
    del ah
    targets = [float(v) for v in args.target_recall.split(",") if v.strip()]
    if targets:
        bench_tuned(table, label, db, queries, tune_queries, reference, exact_qps, targets,
                    args)
    if args.no_faiss or not targets:
        return
    try:
        import faiss
    except ImportError:
        print("  faiss-cpu not installed (pip install -e '.[bench]'): skipped", flush=True)
        return
    faiss.omp_set_num_threads(available_threads())
    bench_tuned(table, label, db, queries, tune_queries, reference, exact_qps, targets, args,
                backend="faiss")
    tune_truth = exact.search(tune_queries, k)[0]
    for name, build_index, grid in faiss_peers(faiss, db):
        t0 = time.perf_counter()
        index, set_param = build_index()
        build = time.perf_counter() - t0
        curve = operating_curve(index, set_param, grid, tune_queries, tune_truth, k, args,
                                stop_at=max(targets))
        for target in targets:
            meeting = [c for c in curve if c["lower"] >= target]
            if not meeting:
                best = max(curve, key=lambda c: c["recall"])
                table.add("ann", label, f"{name} for recall {target:g} (never reached)",
                          0.0, "q/s", exact_qps, "exact q/s",
                          tuning_recall=round(best["recall"], 4), build_s=round(build, 1),
                          setting=f"best {best['param']}", target=target)
                continue
            point = min(meeting, key=lambda c: c["seconds"])
            set_param(point["param"])
            idx, t = timed_search(ids_first(index), queries, k, args.repeats)
            got = recall(idx, reference)
            flag = "" if got >= target else " (fresh recall below target)"
            table.add("ann", label, f"{name} tuned to recall {target:g}{flag}",
                      len(queries) / t, "q/s", exact_qps, "exact q/s", recall=round(got, 4),
                      build_s=round(build, 1), setting=point["param"], target=target)
        del index


def ids_first(index):
    """A faiss index's search as the searchers' (ids, scores)."""
    def search(q, k):
        scores, ids = index.search(q, k)
        return ids, scores
    return search


def faiss_peers(faiss, db):
    """(name, build() -> (index, set_param), parameter grid), fastest-first grids.

    IVF lists: 4 sqrt(N) (faiss's guideline 4-16 sqrt(N)); IVF-PQ is the 4-bit fast-scan
    PQ with d/2 sub-quantizers, the same code size as ScaNN's AH at 2 dimensions per
    block, with an exact float32 re-ranking (``RFlat``, ``k_factor``); HNSW with 32 links
    and faiss's default efConstruction (a larger one costs minutes at 1M on 2 cores).
    """
    n, d = db.shape
    nlist = int(4 * np.sqrt(n))
    train = db[np.random.default_rng(1).choice(n, min(n, 50 * nlist), replace=False)]
    # up to about half of the lists (as far as the tuner's leaves go: 1/2 of them)
    nprobes = sorted({min(p, nlist) for p in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128,
                                              192, 256, 384, 512, 768, 1024, 1536, 2048)
                      if p <= nlist // 2 or p == 1})

    def ivf_flat():
        index = faiss.index_factory(d, f"IVF{nlist},Flat", faiss.METRIC_INNER_PRODUCT)
        index.train(train)
        index.add(db)

        def set_param(nprobe):
            index.nprobe = nprobe
        return index, set_param

    def ivf_pq():
        index = faiss.index_factory(d, f"IVF{nlist},PQ{d // 2}x4fs,RFlat",
                                    faiss.METRIC_INNER_PRODUCT)
        index.train(train)
        index.add(db)
        ivf = faiss.extract_index_ivf(index)

        def set_param(param):
            nprobe, k_factor = param
            ivf.nprobe = nprobe
            index.k_factor = k_factor
        return index, set_param

    def hnsw():
        index = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        index.add(db)

        def set_param(ef):
            index.hnsw.efSearch = ef
        return index, set_param

    return [(f"faiss IVF{nlist},Flat", ivf_flat, nprobes),
            (f"faiss IVF{nlist},PQ{d // 2}x4fs,RFlat", ivf_pq,
             [(p, f) for f in (2, 4, 10, 25) for p in nprobes]),
            ("faiss HNSW32", hnsw, [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
                                    1024, 1536, 2048])]


def operating_curve(index, set_param, grid, tune_queries, truth, k, args, stop_at):
    """Recall (with its Wilson lower bound) and time of each grid point on the tuning
    queries. A grid is ordered by growing cost along each run of one parameter; a run
    stops once its lower bound reaches ``stop_at`` (more cost cannot be needed)."""
    from tfaploss.evaluation.tuner import recall_per_query, wilson_interval

    curve, done_runs = [], set()
    for param in grid:
        run = param[1:] if isinstance(param, tuple) else ()
        if run in done_runs:
            continue
        set_param(param)
        index.search(tune_queries[:8], k)
        seconds = best_time(lambda: index.search(tune_queries, k), args.repeats)
        per_query = recall_per_query(index.search(tune_queries, k)[1], truth)
        mean = float(per_query.mean())
        lower = wilson_interval(mean, len(per_query))[0]
        curve.append({"param": param, "recall": mean, "lower": lower, "seconds": seconds})
        if lower >= stop_at:
            done_runs.add(run)
            if not run:
                break
    return curve


def bench_metrics(table, args, rng):
    from tfaploss.evaluation import retrieval_metrics

    n, d = (int(v) for v in args.metrics_size.lower().split("x"))
    labels = np.repeat(np.arange(n // 10 + 1), 10)[:n]  # classes of 10 (SOP-like)
    centres = random_unit(rng, len(np.unique(labels)), d)
    x = _unit(centres[labels] + rng.standard_normal((n, d), dtype=np.float32)
              * np.float32(args.cluster_spread / np.sqrt(d)))
    label = f"{n}x{d} self, classes of 10"
    print(f"\n== retrieval_metrics: {label} ==", flush=True)
    floor_s = product_floor(x[:2000], x, 1) * n / 2000
    exact = ExactSearcher(x)
    t0 = time.perf_counter()
    exact.search(x, args.k, exclude=np.arange(n))
    t_search = time.perf_counter() - t0
    table.add("metrics", label, f"exact search k={args.k}, all {n} queries (s)", t_search, "s",
              floor_s, "bare product (s)")
    t0 = time.perf_counter()
    m = retrieval_metrics(x, labels, ks=(1, 10, 100), searcher=exact)
    t_metrics = time.perf_counter() - t0
    table.add("metrics", label, "retrieval_metrics full ranking (s)", t_metrics, "s", t_search,
              f"exact search k={args.k} (s)", map=round(m["map"], 4))


def bench_tuned(table, label, db, queries, tune_queries, reference, exact_qps, targets,
                args, backend="scann"):
    """ScaNN (or our faiss backend) tuned by ``tfaploss.evaluation.tuner`` on the tuning
    queries, measured on the fresh ``queries``: one tuning run for the highest target
    (what ``build_searcher(db, backend, target_recall=max(targets))`` runs), whose
    trials (cheapest first) hold the settings of the lower ones: for each target, the
    fastest setting tried whose recall's lower bound reaches it (the tuner's own rule)."""
    from tfaploss.evaluation.search_plan import SearchPlan
    from tfaploss.evaluation.tuner import tune_searcher

    def rebuild(params):
        if backend == "faiss":
            return FaissSearcher(db, **FaissSetting(**params).searcher_params())
        return ScannSearcher(db, mode="ah", num_neighbors=args.ann_k,
                             **ScannSetting(**params).searcher_params())

    t0 = time.perf_counter()
    _, info = tune_searcher(db, SearchPlan(backend, max(targets), k=args.ann_k),
                            tune_queries, max_seconds=args.tune_seconds)
    tuning = time.perf_counter() - t0
    for target in targets:
        met = [e for e in info["tried"] if e["recall_ci"][0] >= target and e["speedup"] > 1]
        if not met:
            table.add("ann", label, f"{backend} tuned to recall {target:g}: exact (fell back)",
                      exact_qps, "q/s", exact_qps, "exact q/s", recall=1.0,
                      build_s=round(tuning, 1),
                      setting=f"{info['settings_tried']} tried, {info['stopped']}",
                      target=target)
            continue
        entry = max(met, key=lambda e: e["speedup"])
        searcher = rebuild(entry["params"])
        idx, t = timed_search(searcher.search, queries, args.ann_k, args.repeats)
        got = recall(idx, reference)
        flag = "" if got >= target else " (fresh recall below target)"
        table.add("ann", label, f"{backend} tuned to recall {target:g}{flag}", len(queries) / t,
                  "q/s", exact_qps, "exact q/s", recall=round(got, 4),
                  build_s=round(tuning, 1),
                  setting=f"{entry['setting']} ({info['settings_tried']} tried)",
                  target=target)
        del searcher


def _peer(what):
    for prefix, name in (("scann tuned", "ScaNN tuned"), ("faiss tuned", "faiss tuned"),
                         ("faiss HNSW", "faiss HNSW32")):
        if what.startswith(prefix):
            return name
    if what.startswith("faiss IVF"):
        return "faiss IVF-PQ" if ",PQ" in what else "faiss IVF-Flat"
    return None


def ann_table(rows) -> str:
    """The README's approximate-search table: per data set and target recall@10, each
    searcher's q/s on the fresh queries (× exact search), its recall there and build
    time; in bold the fastest searcher that reached the target faster than exact search.
    "faiss tuned" is this library's faiss backend, tuned as ScaNN is; the other faiss
    columns are faiss's own indexes swept on the tuning queries."""
    peers = ["ScaNN tuned", "faiss tuned", "faiss IVF-Flat", "faiss IVF-PQ", "faiss HNSW32"]
    lines = ["| data | target | exact q/s | " + " | ".join(peers) + " |",
             "|---|---|---|" + "---|" * len(peers)]
    for label in dict.fromkeys(r["data"] for r in rows if r["section"] == "ann"):
        mine = [r for r in rows if r["data"] == label and r["section"] == "ann"]
        exact = next(r["value"] for r in mine if r["what"].startswith("exact"))
        defaults = next((r for r in mine if r["what"].startswith("scann defaults")), None)
        for target in sorted({r["target"] for r in mine if "target" in r}):
            cells, best = {}, None
            for r in mine:
                name = _peer(r["what"])
                if name is None or r.get("target") != target:
                    continue
                if "never reached" in r["what"]:
                    cells[name] = f"not reached (best {r['tuning_recall']:.3f})"
                    continue
                fell_back = "fell back" in r["what"]
                cells[name] = (f"{r['value']:,.0f} ({r['ratio']:.1f}×), "
                               f"{'exact' if fell_back else format(r['recall'], '.3f')}, "
                               f"{r['build_s']:.0f} s")
                if not fell_back and r["recall"] >= target and r["ratio"] > 1 and (
                        best is None or r["value"] > best[1]):
                    best = (name, r["value"])
            if best:
                cells[best[0]] = f"**{cells[best[0]]}**"
            lines.append(f"| {label} | {target:g} | {exact:,.0f} | "
                         + " | ".join(cells.get(p, "—") for p in peers) + " |")
        if defaults:
            lines.append(f"| {label} | ScaNN defaults | | {defaults['value']:,.0f} "
                         f"({defaults['ratio']:.1f}×), recall {defaults['recall']:.3f}, "
                         f"{defaults['build_s']:.0f} s |" + " |" * (len(peers) - 1))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="300000x128,1000000x128", help="NxD database sizes")
    p.add_argument("--datasets", default="clustered,spread,random")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=100, help="k of the exact-search figures")
    p.add_argument("--ann_k", type=int, default=10, help="k of the approximate figures")
    p.add_argument("--cluster_spread", type=float, default=1.0)
    p.add_argument("--wide_spread", type=float, default=2.0,
                   help="the spread of the 'spread' data set")
    p.add_argument("--metrics_size", default="100000x512")
    p.add_argument("--no_metrics", action="store_true")
    p.add_argument("--no_faiss", action="store_true")
    p.add_argument("--exact_only", action="store_true",
                   help="only the exact-search figures (no approximate search, no metrics)")
    p.add_argument("--target_recall", default="0.9,0.95,0.99",
                   help="comma-separated recall@ann_k targets every searcher is tuned to "
                        "('' : ScaNN defaults only; tuning time counts as ScaNN's build)")
    p.add_argument("--tune_seconds", type=float, default=300.0,
                   help="the ScaNN tuner's time bound (max_seconds; its default is 120 s)")
    p.add_argument("--first_call_tf", action="store_true",
                   help="also time each exact searcher's first call in a fresh process "
                        "that has imported TensorFlow (as a training run has)")
    p.add_argument("--with_tf", action="store_true",
                   help="also time the TensorFlow engine (the former CPU default)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs; the best is kept")
    p.add_argument("--seed", type=int, default=0)
    harness.add_arguments(p, harness.RESULTS_DIR / "search.json",
                          quick_help="50k x 64, 300 queries, 20k x 64 metrics",
                          tiny_help="clustered 4,000 x 16, 200 queries, 2,000 x 16 metrics, "
                                    "target 0.9, 3 s of tuning")
    p.add_argument("--table_from", metavar="JSON",
                   help="print the README's approximate-search table of an earlier run "
                        "(its --out file) and stop")
    args = p.parse_args(argv)
    if args.table_from:
        with open(args.table_from, encoding="utf-8") as f:
            print(ann_table(json.load(f)["rows"]))
        return
    if args.tiny:
        args.quick, args.sizes, args.queries, args.metrics_size = True, "4000x16", 200, "2000x16"
        args.datasets, args.target_recall, args.tune_seconds = "clustered", "0.9", 3.0
    elif args.quick:
        args.sizes, args.queries, args.metrics_size = "50000x64", 300, "20000x64"
    rng = np.random.default_rng(args.seed)
    table = Table()
    print(f"threads: {available_threads()}", flush=True)
    for size in args.sizes.split(","):
        n, d = (int(v) for v in size.lower().split("x"))
        for kind in args.datasets.split(","):
            label = f"{kind} {n}x{d}"
            print(f"\n== {label}, {args.queries} queries ==", flush=True)
            db, queries, tune_queries = make_data(kind, n, d, args.queries, args, rng)
            exact, _ = bench_exact(table, label, db, queries, args)
            if not args.exact_only:
                bench_ann(table, label, db, queries, tune_queries, exact, args)
            del exact, db, queries, tune_queries
    if not (args.no_metrics or args.exact_only):
        bench_metrics(table, args, rng)

    print("\n| section | data | what | value | floor / reference | ratio | notes |")
    print("|---|---|---|---:|---:|---:|---|")
    for r in table.rows:
        notes = ", ".join(f"{k} {r[k]}" for k in ("target", "recall", "tuning_recall",
                                                   "build_s", "setting", "map") if k in r)
        floor = f"{r['floor']:.1f} ({r['floor_what']})" if "floor" in r else ""
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else ""
        print(f"| {r['section']} | {r['data']} | {r['what']} | {r['value']:.1f} {r['unit']} | "
              f"{floor} | {ratio} | {notes} |")
    print(f"\n{ann_table(table.rows)}\n")
    harness.write_results(args.out, "search", args, table.figures, rows=table.rows,
                          threads=available_threads())


if __name__ == "__main__":
    main()
