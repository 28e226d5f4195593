"""Why a loss trains or collapses: per-step gradient and embedding statistics.

For each (loss, BatchNorm mode, learning rate) the small CNN of
``experiments/batch_sweep/batch_sweep.py`` trains from scratch for ``--steps`` single-pass Adam steps
on a split written by a ``pipelines`` job, and every step records:

* ``|g|``: global norm of the parameter gradient;
* ``|dL/de|``: mean norm of the loss gradient per embedding row, and the fraction of
  rows whose gradient is exactly zero (queries that teach nothing);
* ``cos``: mean cosine between different embeddings of the batch (1 = collapsed);
* ``erank``: effective rank of the centred batch embeddings (exp of the entropy of the
  normalised squared singular values; 1 = every embedding on one line);
* the loss.

The BatchNorm modes are ``frozen`` (statistics estimated once at initialisation, then
fixed: what ``freeze_bn: true`` did for a network trained from scratch) and ``batch``
(batch statistics, the from-scratch default).

    python experiments/loss_diagnostics/loss_diagnostics.py --train data/glyphs/train \\
        --losses APLoss,Triplet-semihard --batch 512 --lrs 1e-3,4e-3 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "batch_sweep"))
from batch_sweep import DEFAULT_DATA, LOSSES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", default=str(DEFAULT_DATA / "train"))
    p.add_argument("--losses", default="APLoss,SmoothAP,ROADMAP,Triplet-semihard")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lrs", default="1e-3,4e-3")
    p.add_argument("--bn", default="frozen,batch", help="BatchNorm modes: frozen, batch")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"
                                        / "loss_diagnostics.json"))
    args = p.parse_args(argv)
    args.losses = args.losses.split(",")
    bad = [name for name in args.losses if name not in LOSSES]
    if bad:
        p.error(f"--losses: unknown {bad}; choose from {', '.join(LOSSES)}")
    args.lrs = [float(v) for v in args.lrs.split(",")]
    args.bn = args.bn.split(",")
    if any(mode not in ("frozen", "batch") for mode in args.bn):
        p.error(f"--bn must list 'frozen' and/or 'batch', received {args.bn}")
    if not (Path(args.train) / "manifest.json").is_file():
        p.error(f"--train {args.train!r} holds no manifest.json (run `make data-glyphs`)")
    return args


def run(args, loss_name, bn, lr):
    import keras
    import tensorflow as tf

    from tfaploss.config import config_from_dict
    from tfaploss.run import build as B
    from tfaploss.training.health import cosine_stats

    cls, kwargs = LOSSES[loss_name]
    cfg = config_from_dict({
        "data": {"train": args.train, "batch_size": args.batch, "m": 4,
                 "image_size": args.image_size, "seed": args.seed,
                 "augmentation": {"crop": "random_resized_crop", "scale": [0.6, 1.0],
                                  "flip": False}},
        "model": {"backbone": "small_cnn", "pooling": "gem",
                  "embedding_dim": args.embedding_dim, "weights": None,
                  "freeze_bn": bn == "frozen",
                  "bn_calibration_images": 256 if bn == "frozen" else 0},
        "loss": {"name": cls, **kwargs},
        "training": {"seed": args.seed}}, warn=False)
    keras.backend.clear_session()
    keras.utils.set_random_seed(args.seed)
    model = B.build_model(cfg)
    loss = B.build_loss(cfg)
    optimizer = keras.optimizers.Adam(lr)
    batches = iter(B.build_train_dataset(cfg))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            e = model(x, training=True)
            tape.watch(e)
            value = loss(y, e)
        grads, g_e = tape.gradient(value, [model.trainable_variables, e])
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        rows = tf.norm(g_e, axis=1)
        cos, _ = cosine_stats(e, y)
        s = tf.linalg.svd(e - tf.reduce_mean(e, 0), compute_uv=False)
        p = s ** 2 / tf.maximum(tf.reduce_sum(s ** 2), 1e-30)
        erank = tf.exp(-tf.reduce_sum(p * tf.math.log(p + 1e-30)))
        return {"loss": value, "grad_norm": tf.linalg.global_norm(grads),
                "row_grad": tf.reduce_mean(rows),
                "zero_rows": tf.reduce_mean(tf.cast(rows == 0.0, tf.float32)),
                "cos": cos, "erank": erank}

    history = []
    for _ in range(args.steps):
        x, y = next(batches)
        history.append({k: float(v) for k, v in step(x, y).items()})
    return history


def summary_line(name, bn, lr, h):
    first, last = h[0], h[-1]
    worst = max(r["cos"] for r in h[1:]) if len(h) > 1 else first["cos"]
    return (f"| {name} | {bn} | {lr:g} | {first['loss']:.3f} → {last['loss']:.3f} | "
            f"{first['grad_norm']:.2g} | {first['row_grad']:.2g} | "
            f"{max(r['zero_rows'] for r in h):.2f} | {first['cos']:.3f} → {last['cos']:.3f} "
            f"(max {worst:.3f}) | {first['erank']:.1f} → {min(r['erank'] for r in h):.1f} "
            f"→ {last['erank']:.1f} |")


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    header = ("| loss | BN | lr | loss first → last | |g| step 1 | |dL/de| step 1 | "
              "max share of zero-gradient rows | cos first → last | erank first → min → "
              "last |\n|---|---|---|---|---|---|---|---|---|")
    lines, results = [header], []
    for name in args.losses:
        for bn in args.bn:
            for lr in args.lrs:
                t0 = time.time()
                h = run(args, name, bn, lr)
                results.append({"loss": name, "bn": bn, "lr": lr, "history": h})
                lines.append(summary_line(name, bn, lr, h))
                print(lines[-1], f"({time.time() - t0:.0f} s)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    os.replace(tmp, out)
    print(f"\nB={args.batch}, {args.steps} steps, {args.image_size}² crops, seed "
          f"{args.seed}\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
