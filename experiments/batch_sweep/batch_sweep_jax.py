"""The batch sweep on the JAX backend, for one GPU: batches up to 16,384, a wider CNN.

``batch_sweep.py`` runs ``tfaploss train`` (TensorFlow) on 2 CPU cores, up to
B=2048. This script asks the same question where a GPU allows much larger batches:
does ranking the whole batch pay off as the batch grows? It needs no TensorFlow at
training time, as on the GPU machines that carry JAX only:

1. Here (TensorFlow installed), the glyph set's three splits are decoded once into one
   compressed array file (``--export``): grayscale, the 64² canvas resized to
   ``--source-size`` (36²; a 32² centre crop of it is what ``batch_sweep.py``
   evaluates on: the shorter side resized to 32 / 0.875), quantised to 16 grey levels
   (the JPEG noise of black-on-white glyphs is what makes the file large: 16 levels
   and xz give 20 MiB instead of 67, small enough to travel to a GPU machine).

       python experiments/batch_sweep/batch_sweep_jax.py --export gpu_data/glyphs36.npz.xz

2. On the GPU (``KERAS_BACKEND=jax`` is set here):

       python experiments/batch_sweep/batch_sweep_jax.py --data gpu_data/glyphs36.npz --out OUT

Protocol (printed with the table):

* backbone ``small_cnn`` with widths (64, 128, 256) (the CPU sweep: 32, 64, 128), GeM,
  a linear head to 128-d, L2-normalised; trained from scratch with live BatchNorm;
* Keras's ``mixed_bfloat16`` policy for the backbone (``--precision``); the embeddings
  and the losses are float32;
* augmentation: random resized crops of 60-100 % of the area, aspect 3/4-4/3,
  bilinear, to 32², on the GPU; evaluation on the 32² centre crop;
* class-balanced batches of ``m`` images per class, ``m = max(4, B / 1024)``: the train
  split has 1,200 classes, so B=16,384 takes 1,024 classes of 16 (B <= 4096: m=4);
* equal updates (``--updates``, default 64) per run, Adam with a cosine decay to 0;
* the learning rate ``base_lr * (B / 128) ** a`` for a in ``--lr-exponents`` (default
  0 and 0.5: the constant and the square-root rule), picked per (loss, batch) on the
  validation classes with seed 0; the other seeds then run at the picked rate;
* MAP@R and R@1 on the unseen test classes (53,600 images), exact search
  (``tfaploss.evaluation.retrieval_metrics``).

Work is ordered so that a run stopped by ``--deadline`` (seconds) leaves a complete
table for the cells it reached: every cell's tuning runs first, batch by batch, then
the remaining seeds. Each finished run is appended to ``OUT/sweep_jax.jsonl``; the
Markdown table and the plot are rewritten from it (``--report-only`` too).

``--repeat`` trains the seed-0 tuning runs once more into ``OUT/sweep_jax_repeat.jsonl``;
the report then sets each repeat beside its first run. GPU training is not bitwise
deterministic, so that gap is the noise floor of the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
for _path in (REPO_ROOT, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from batch_sweep import seed_stats  # the CPU sweep's mean and half-range

LOSSES = {
    "APLoss": ("APLoss", {}),
    "FastAP": ("FastAPLoss", {}),
    "SmoothAP": ("SmoothAPLoss", {}),
    "Triplet-semihard": ("TripletLoss", {"mining": "semihard"}),
    "Contrastive": ("ContrastiveLoss", {}),
}
PAIR_LOSSES = ("Triplet-semihard", "Contrastive")
WIDTHS = (64, 128, 256)
CROP, EMBEDDING_DIM, EVAL_CHUNK = 32, 128, 4096
LEDGER, REPEAT_LEDGER = "sweep_jax.jsonl", "sweep_jax_repeat.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", help="write the glyph splits to this .npz (needs TensorFlow)")
    p.add_argument("--splits", default="data/glyphs",
                   help="folder with train/, val/, test/ of a pipelines job (for --export)")
    p.add_argument("--source-size", type=int, default=36)
    p.add_argument("--data", help="the .npz written by --export")
    p.add_argument("--out", default="experiments/batch_sweep/results/jax")
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--batch-sizes", default="1024,4096,16384")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--updates", type=int, default=64)
    p.add_argument("--base-lr", type=float, default=1e-3)
    p.add_argument("--base-batch", type=int, default=128)
    p.add_argument("--lr-exponents", default="0,0.5")
    p.add_argument("--deadline", type=float, default=0,
                   help="seconds after which no new run starts (0: none)")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--precision", choices=("mixed_bfloat16", "float32"),
                   default="mixed_bfloat16",
                   help="Keras dtype policy of the backbone (the losses run in float32)")
    p.add_argument("--limit", type=int, default=0,
                   help="use the first N images of each split (a CPU smoke test)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--repeat", action="store_true",
                   help="train the seed-0 tuning runs again into OUT/sweep_jax_repeat.jsonl: "
                        "the same (loss, B, lr, seed) twice measures run-to-run noise")
    args = p.parse_args(argv)
    if not args.export and not args.data and not args.report_only:
        p.error("give --export (here) or --data (where the sweep runs)")
    return args


# --------------------------------------------------------------------------- export
def export(args) -> None:
    """Decode the three splits into one xz-compressed .npz of uint8 (N, S, S) images."""
    import hashlib
    import io
    import lzma

    import numpy as np
    import tensorflow as tf

    from tfaploss.data import records

    arrays, fingerprints = {}, {}
    for split in ("train", "val", "test"):
        folder = Path(args.splits) / split
        fingerprints[split] = hashlib.sha256(
            (folder / "manifest.json").read_bytes()).hexdigest()[:16]
        images, labels = [], []
        ds = records.load_split(str(folder), decode=True).map(
            lambda e: (tf.image.resize(tf.image.rgb_to_grayscale(e["image"]),
                                       [args.source_size] * 2, method="area"), e["label"]),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).batch(1024)
        for x, y in ds.as_numpy_iterator():
            grey = np.clip(np.round(x[..., 0]), 0, 255).astype(np.uint8)
            images.append((grey // 16) * 17)
            labels.append(y.astype(np.int32))
        arrays[f"x_{split}"] = np.concatenate(images)
        arrays[f"y_{split}"] = np.concatenate(labels)
        print(f"{split}: {len(arrays[f'y_{split}'])} images, "
              f"{len(np.unique(arrays[f'y_{split}']))} classes", flush=True)
    arrays["fingerprints"] = np.array(json.dumps(fingerprints))
    out = Path(args.export)
    out.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(lzma.compress(buffer.getvalue(), preset=6))
    os.replace(tmp, out)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")


# --------------------------------------------------------------------------- the sweep
def _setup_backend(device: str) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_PLATFORMS"] = "cuda" if device == "gpu" else "cpu"
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")


def _ints(text):
    return [int(v) for v in str(text).split(",") if v.strip()]


def m_for(batch: int) -> int:
    return max(4, batch // 1024)


class Data:
    """The splits on the device: uint8 images, labels, and per-class index lists."""

    def __init__(self, path, limit=0):
        import io
        import lzma

        import jax.numpy as jnp
        import numpy as np

        with np.load(io.BytesIO(lzma.decompress(Path(path).read_bytes()))) as f:
            raw = {k: f[k] for k in f.files}
        self.fingerprints = json.loads(str(raw.pop("fingerprints")))
        for split in ("train", "val", "test"):
            x, y = raw[f"x_{split}"], raw[f"y_{split}"]
            if limit:
                x, y = x[:limit], y[:limit]
            setattr(self, f"x_{split}", jnp.asarray(x))
            setattr(self, f"y_{split}", y)
        self.classes = np.unique(self.y_train)

    def batches(self, batch, m, seed, steps):
        """``steps`` class-balanced index batches: B/m classes, m images of each (the
        sampler of the cached-feature tier, so both draw the same batches)."""
        from tfaploss.data.samplers import m_per_class_rows

        for idx in m_per_class_rows(self.y_train, batch, m, seed).take(steps).as_numpy_iterator():
            yield idx.astype("int32")


def _augment(images_u8, key):
    """Random resized crops (60-100 % of the area, aspect 3/4-4/3) to CROP², bilinear."""
    import jax
    import jax.numpy as jnp

    n, s = images_u8.shape[0], images_u8.shape[1]
    k1, k2, k3, k4 = jax.random.split(key, 4)
    area = jax.random.uniform(k1, (n,), minval=0.6, maxval=1.0) * s * s
    log_ratio = jax.random.uniform(k2, (n,), minval=math.log(3 / 4), maxval=math.log(4 / 3))
    ratio = jnp.exp(log_ratio)
    w = jnp.clip(jnp.sqrt(area * ratio), 1.0, s)
    h = jnp.clip(jnp.sqrt(area / ratio), 1.0, s)
    y0 = jax.random.uniform(k3, (n,)) * (s - h)
    x0 = jax.random.uniform(k4, (n,)) * (s - w)
    grid = (jnp.arange(CROP) + 0.5) / CROP
    ys = y0[:, None] + grid[None] * h[:, None] - 0.5        # (n, CROP) source rows
    xs = x0[:, None] + grid[None] * w[:, None] - 0.5
    images = images_u8.astype(jnp.float32)

    def interp(coords, axis_len):
        c = jnp.clip(coords, 0, axis_len - 1)
        lo = jnp.floor(c).astype(jnp.int32)
        hi = jnp.minimum(lo + 1, axis_len - 1)
        return lo, hi, c - lo

    ylo, yhi, wy = interp(ys, s)
    xlo, xhi, wx = interp(xs, s)
    rows = lambda idx: jnp.take_along_axis(images, idx[:, :, None], axis=1)
    top, bottom = rows(ylo), rows(yhi)                       # (n, CROP, s)
    mixed = top * (1 - wy[..., None]) + bottom * wy[..., None]
    cols = lambda idx: jnp.take_along_axis(mixed, idx[:, None, :], axis=2)
    out = cols(xlo) * (1 - wx[:, None]) + cols(xhi) * wx[:, None]
    return jnp.repeat(out[..., None], 3, axis=-1)   # the models take RGB


def _centre(images_u8):
    s = images_u8.shape[1]
    o = (s - CROP) // 2
    import jax.numpy as jnp

    return jnp.repeat(images_u8[:, o:o + CROP, o:o + CROP, None].astype("float32"), 3, -1)


def build_model(seed):
    import keras

    from tfaploss.models.embedding import build_embedding_model

    keras.utils.set_random_seed(seed)
    return build_embedding_model(
        backbone="small_cnn", input_shape=(CROP, CROP, 3), embedding_dim=EMBEDDING_DIM,
        pooling="gem", weights=None, backbone_kwargs={"widths": WIDTHS})


class Runner:
    """One jitted train step per (loss, batch), shared by every seed and learning rate
    (weights, optimizer state and the learning rate are its arguments)."""

    def __init__(self, data):
        import jax

        self.data = data
        self.template = build_model(0)
        self._steps = {}
        self._embed = jax.jit(self._embed_fn)

    def _embed_fn(self, tv, ntv, x):
        out, _ = self.template.stateless_call(tv, ntv, _centre(x), training=False)
        return out

    def step_fn(self, loss_name, batch):
        key = (loss_name, batch)
        if key in self._steps:
            return self._steps[key]
        import jax
        import keras

        import tfaploss.losses as L

        cls, kwargs = LOSSES[loss_name]
        loss = getattr(L, cls)(**kwargs)
        model = self.template

        # the images are an argument: a closed-over array would become a constant of
        # the compiled program
        def step(tv, ntv, ov, lr_index, lr, images, idx, labels, rng):
            x = _augment(images[idx], rng)

            def objective(tv):
                emb, ntv2 = model.stateless_call(tv, ntv, x, training=True)
                return loss(labels, emb), (ntv2, emb)

            (value, (ntv2, emb)), grads = jax.value_and_grad(objective, has_aux=True)(tv)
            ov = list(ov)
            ov[lr_index] = lr
            tv2, ov2 = self.optimizer.stateless_apply(ov, grads, tv)
            gnorm = keras.ops.sqrt(sum(keras.ops.sum(g * g) for g in grads))
            mean_cos = keras.ops.mean(keras.ops.matmul(emb, keras.ops.transpose(emb)))
            return tv2, ntv2, ov2, value, gnorm, mean_cos

        self._steps[key] = jax.jit(step, static_argnums=(3,), donate_argnums=(0, 1, 2))
        return self._steps[key]

    def train(self, loss_name, batch, lr, seed, updates):
        import jax
        import jax.numpy as jnp
        import keras
        import numpy as np

        model = build_model(seed)
        self.optimizer = keras.optimizers.Adam(learning_rate=lr)
        self.optimizer.build(model.trainable_variables)
        lr_var = self.optimizer._learning_rate
        lr_index = next(i for i, v in enumerate(self.optimizer.variables) if v is lr_var)
        step = self.step_fn(loss_name, batch)
        tv = [v.value for v in model.trainable_variables]
        ntv = [v.value for v in model.non_trainable_variables]
        ov = [v.value for v in self.optimizer.variables]
        rng = jax.random.PRNGKey(seed)
        m = m_for(batch)
        history, t0, status = [], time.perf_counter(), "ok"
        for i, idx in enumerate(self.data.batches(batch, m, seed, updates)):
            lr_t = 0.5 * lr * (1 + math.cos(math.pi * i / updates))
            rng, sub = jax.random.split(rng)
            labels = jnp.asarray(self.data.y_train[idx])
            tv, ntv, ov, value, gnorm, cos = step(
                tv, ntv, ov, lr_index, jnp.float32(lr_t), self.data.x_train, jnp.asarray(idx),
                labels, sub)
            if i % 8 == 0 or i == updates - 1:
                value, gnorm, cos = (float(v) for v in (value, gnorm, cos))
                history.append({"update": i, "loss": value, "grad_norm": gnorm,
                                "mean_cos": cos})
                if not np.isfinite(value):
                    status = "non-finite loss"
                    break
        jax.block_until_ready(tv)
        seconds = time.perf_counter() - t0
        return tv, ntv, history, seconds, status

    def embed(self, tv, ntv, x):
        import jax.numpy as jnp

        parts = []
        for start in range(0, x.shape[0], EVAL_CHUNK):
            chunk = x[start:start + EVAL_CHUNK]
            pad = EVAL_CHUNK - chunk.shape[0]
            if pad:
                chunk = jnp.concatenate([chunk, jnp.zeros((pad,) + chunk.shape[1:], chunk.dtype)])
            parts.append(self._embed(tv, ntv, chunk)[:EVAL_CHUNK - pad])
        return jnp.concatenate(parts)


def retrieval(embeddings, labels):
    """MAP@R and R@1 (%) of each item against all others (itself excluded), exact, by
    ``tfaploss.evaluation.retrieval_metrics``; a query whose class has no other item
    cannot be answered and is left out, as the sweep's tables always did."""
    import numpy as np

    from tfaploss.evaluation.metrics import retrieval_metrics

    embeddings = np.asarray(embeddings, dtype="float32")
    labels = np.asarray(labels)
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    queries = np.flatnonzero(counts[inverse] > 1)
    metrics = retrieval_metrics(embeddings[queries], labels[queries], embeddings, labels,
                                ks=(1,), exclude=queries)
    return 100 * metrics["map@r"], 100 * metrics["recall@1"]


def run(args) -> None:
    _setup_backend(args.device)
    import jax
    import keras

    keras.mixed_precision.set_global_policy(args.precision)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ledger = out / (REPEAT_LEDGER if args.repeat else LEDGER)
    done = {(r["loss"], r["batch"], r["lr"], r["seed"]): r for r in read_runs(ledger)}
    data = Data(args.data, args.limit)
    runner = Runner(data)
    print(f"devices: {jax.devices()}; keras {keras.__version__}, jax {jax.__version__}; "
          f"train {len(data.y_train)} images / {len(data.classes)} classes, "
          f"test {len(data.y_test)}", flush=True)
    losses = [s for s in args.losses.split(",") if s]
    batches, seeds = _ints(args.batch_sizes), _ints(args.seeds)
    exponents = [float(a) for a in args.lr_exponents.split(",")]
    t_start = time.perf_counter()

    def one(loss, batch, lr, seed, with_test):
        key = (loss, batch, lr, seed)
        if key in done:
            return done[key]
        if args.deadline and time.perf_counter() - t_start > args.deadline:
            return None
        t0 = time.perf_counter()
        tv, ntv, history, seconds, status = runner.train(loss, batch, lr, seed, args.updates)
        row = {"loss": loss, "batch": batch, "m": m_for(batch), "lr": lr, "seed": seed,
               "precision": args.precision,
               "updates": args.updates, "images": batch * args.updates, "status": status,
               "train_seconds": round(seconds, 2), "history": history,
               "data": data.fingerprints, "device": str(jax.devices()[0]),
               "device_kind": jax.devices()[0].device_kind}
        if status == "ok":
            row["val_map@r"], row["val_r@1"] = retrieval(
                runner.embed(tv, ntv, data.x_val), data.y_val)
            if with_test:
                row["test_map@r"], row["test_r@1"] = retrieval(
                    runner.embed(tv, ntv, data.x_test), data.y_test)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        with open(ledger, "a") as f:
            f.write(json.dumps(row) + "\n")
        done[key] = row
        print(f"{loss:>17s} B={batch:<6d} lr={lr:<8.2g} seed={seed} {status}: val MAP@R "
              f"{row.get('val_map@r', float('nan')):5.1f}, test MAP@R "
              f"{row.get('test_map@r', float('nan')):5.1f}, R@1 "
              f"{row.get('test_r@1', float('nan')):5.1f}; final loss "
              f"{history[-1]['loss']:.4f}, mean cos {history[-1]['mean_cos']:.3f}; "
              f"{seconds:.1f} s train, {row['seconds']:.1f} s all "
              f"(t={time.perf_counter() - t_start:.0f} s)", flush=True)
        return row

    def lr_grid(batch):
        return [round(args.base_lr * (batch / args.base_batch) ** a, 6) for a in exponents]

    # every cell's tuning runs first (seed 0, with test metrics: one of them is kept)
    for batch in batches:
        for loss in losses:
            for lr in lr_grid(batch):
                one(loss, batch, lr, seeds[0], with_test=True)
    for seed in ([] if args.repeat else seeds[1:]):
        for batch in batches:
            for loss in losses:
                picked = pick(done, loss, batch, lr_grid(batch), seeds[0])
                if picked is not None:
                    one(loss, batch, picked, seed, with_test=True)
    write_report(args, read_runs(out / LEDGER))


def read_runs(path):
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def pick(done, loss, batch, lrs, seed0):
    tried = [done.get((loss, batch, lr, seed0)) for lr in lrs]
    tried = [r for r in tried if r is not None]
    if len(tried) < len(lrs):
        return None
    return max(tried, key=lambda r: r.get("val_map@r", -1.0))["lr"]


# --------------------------------------------------------------------------- report
def cells(rows, args):
    """{(loss, batch): (picked lr, [test rows at that lr], tried)}."""
    exponents = [float(a) for a in args.lr_exponents.split(",")]
    by = {}
    for r in rows:
        by.setdefault((r["loss"], r["batch"]), []).append(r)
    table = {}
    for (loss, batch), group in by.items():
        lrs = [round(args.base_lr * (batch / args.base_batch) ** a, 6) for a in exponents]
        seed0 = min(r["seed"] for r in group)
        index = {(r["lr"], r["seed"]): r for r in group}
        tried = [index[(lr, seed0)] for lr in lrs if (lr, seed0) in index]
        if not tried:
            continue
        # a cell whose tuning a deadline cut short is shown, marked (markdown: †)
        best = max(tried, key=lambda r: r.get("val_map@r", -1.0))["lr"]
        runs = [r for r in group if r["lr"] == best and "test_map@r" in r]
        table[(loss, batch)] = (best, runs, tried)
    return table


def markdown(args, rows) -> str:
    table = cells(rows, args)
    rates = args.lr_exponents.split(",")
    losses = [s for s in args.losses.split(",") if s and any(k[0] == s for k in table)]
    batches = sorted({k[1] for k in table})
    device = rows[0].get("device", "?") if rows else "?"
    lines = [f"Keras on JAX, {device}; backbone small_cnn widths {WIDTHS} from scratch, "
             f"{CROP}² crops, {EMBEDDING_DIM}-d; {args.updates} updates per run (equal "
             f"updates); m = max(4, B/1024); lr = {args.base_lr:g}·(B/{args.base_batch})^a, "
             f"a ∈ {{{args.lr_exponents}}} picked on val with seed 0. Test MAP@R (R@1), "
             "mean ± half-range over seeds (n), as in batch_sweep.py. Peers in the same table: "
             + ", ".join(p for p in PAIR_LOSSES if p in losses) + ".", ""]
    lines.append("| loss | " + " | ".join(f"B={b}" for b in batches) + " |")
    lines.append("|---" * (len(batches) + 1) + "|")
    for loss in losses:
        cells_text = []
        for b in batches:
            entry = table.get((loss, b))
            if not entry or not entry[1]:
                cells_text.append("—")
                continue
            lr, runs, _ = entry
            mean, spread, n = seed_stats(runs, "test_map@r")
            r1 = seed_stats(runs, "test_r@1")[0]
            text = f"{mean:.1f}" + (f" ± {spread:.1f}" if n > 1 else "")
            short = "†" if len(entry[2]) < len(rates) else ""
            cells_text.append(f"{text} ({r1:.1f}) n={len(runs)}, lr {lr:g}{short}")
        lines.append(f"| {loss} | " + " | ".join(cells_text) + " |")
    if any(len(tried) < len(rates) for _, _, tried in table.values()):
        lines += ["", "†: tuned on fewer rates than the grid (a deadline stopped the run)."]
    lines += ["", "Validation MAP@R of every learning rate tried (seed 0):", "",
              "| loss | B | " + " | ".join(f"a={a}" for a in rates)
              + " | train s (fastest run) |", "|---|---|" + "---|" * (len(rates) + 1)]
    for (loss, b), (_, _, tried) in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        vals = " | ".join([f"{r.get('val_map@r', float('nan')):.1f} (lr {r['lr']:g})"
                           for r in tried] + ["—"] * (len(rates) - len(tried)))
        # the first run of a (loss, batch) in a process also pays XLA's compile and,
        # on a GPU, its convolution autotuning at the new batch (up to ~140 s here)
        secs = min(r["train_seconds"] for r in tried)
        lines.append(f"| {loss} | {b} | {vals} | {secs:.1f} |")
    return "\n".join(lines) + "\n"


def repeat_markdown(rows, repeats) -> str:
    """The same (loss, B, lr, seed) trained twice: how far apart the two runs land.

    GPU kernels are not bitwise deterministic (XLA's atomics, the convolution
    algorithm that autotuning picks on each machine), so a seed fixes the data order and
    the initialisation but not the run. The gap between two such runs is a floor under
    any difference between cells that the table can resolve.
    """
    first = {(r["loss"], r["batch"], r["lr"], r["seed"]): r for r in rows}
    pairs = [(first[k], r) for r in repeats
             if (k := (r["loss"], r["batch"], r["lr"], r["seed"])) in first
             and "val_map@r" in first[k] and "val_map@r" in r]
    if not pairs:
        return ""
    gaps = sorted(abs(a["val_map@r"] - b["val_map@r"]) for a, b in pairs)
    kinds = sorted({r.get("device_kind", r.get("device", "?")) for r in repeats})
    lines = ["", (f"Run-to-run repeat ({REPEAT_LEDGER}, on {', '.join(kinds)}): the seed-0 "
             f"tuning runs trained again. Validation (test) MAP@R, first run → repeat; "
             f"|Δ val| median {statistics.median(gaps):.1f}, max {gaps[-1]:.1f} over "
             f"{len(pairs)} runs."), "",
             "| loss | B | lr | first | repeat | Δ val |", "|---|---|---|---|---|---|"]
    for a, b in pairs:
        lines.append(f"| {a['loss']} | {a['batch']} | {a['lr']:g} | {a['val_map@r']:.1f} "
                     f"({a.get('test_map@r', float('nan')):.1f}) | {b['val_map@r']:.1f} "
                     f"({b.get('test_map@r', float('nan')):.1f}) | "
                     f"{b['val_map@r'] - a['val_map@r']:+.1f} |")
    return "\n".join(lines) + "\n"


def plot(args, rows, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    table = cells(rows, args)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for loss in [s for s in args.losses.split(",") if s]:
        pts = sorted((b, seed_stats(runs, "test_map@r")[:2])
                     for (name, b), (_, runs, _) in table.items() if name == loss and runs)
        if not pts:
            continue
        xs = [b for b, _ in pts]
        means = [mean for _, (mean, _) in pts]
        errs = [spread for _, (_, spread) in pts]
        ax.errorbar(xs, means, yerr=errs, marker="o", capsize=3, label=loss,
                    linestyle="--" if loss in PAIR_LOSSES else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("test MAP@R (%)")
    ax.set_title(f"Glyphs, JAX on GPU, {args.updates} updates per run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    return True


def write_report(args, rows) -> None:
    out = Path(args.out)
    text = markdown(args, rows) + repeat_markdown(rows, read_runs(out / REPEAT_LEDGER))
    tmp = out / "sweep_jax.md.tmp"
    tmp.write_text(text)
    os.replace(tmp, out / "sweep_jax.md")
    plot(args, rows, out / "sweep_jax.png")
    print(text, flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.export:
        export(args)
        return
    if args.report_only:
        write_report(args, read_runs(Path(args.out) / LEDGER))
        return
    run(args)


if __name__ == "__main__":
    main()
