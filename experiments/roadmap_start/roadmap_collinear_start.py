"""Does ROADMAP survive a near-collinear start?

A small CNN trained from scratch (``small_cnn`` + GeM, frozen BatchNorm calibrated on
training images, as ``configs/demo_digits.yaml``) starts with every embedding in a
narrow cone: ReLU features are non-negative, so the pooled vectors, and the linear head
of them, all point the same way. This script trains it on scikit-learn's digits (0-5,
8x8 scans upsampled to 16x16; batches of 6 classes x 16) with several losses and
prints, for each, the batch health before and after (mean off-diagonal cosine) and
test retrieval R@1 on the unseen digits 6-9.

The floors printed beside the figures, measured in the same run: the untrained model's
R@1 (what collapse must not fall below) and chance R@1 (1 / classes-ish: the fraction
of a query's same-class neighbours among the test set).

    python experiments/roadmap_start/roadmap_collinear_start.py --steps 150
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np


def digits(size=16):
    from sklearn.datasets import load_digits

    d = load_digits()
    images = d.images.astype("float32") * (255.0 / 16.0)
    images = np.repeat(np.repeat(images, size // 8, axis=1), size // 8, axis=2)
    images = np.repeat(images[..., None], 3, axis=-1)
    return images, d.target.astype("int32")


def batches(images, labels, classes, m, rng):
    by_class = {c: np.flatnonzero(labels == c) for c in classes}
    while True:
        idx = np.concatenate([rng.choice(by_class[c], m, replace=False) for c in classes])
        yield images[idx], labels[idx]


def recall_at_1(model, images, labels):
    e = np.asarray(model(images, training=False))
    s = e @ e.T
    np.fill_diagonal(s, -np.inf)
    return float(np.mean(labels[np.argmax(s, axis=1)] == labels))


def mean_cos(model, images):
    from tfaploss.training.health import batch_health

    e = model(images, training=False)
    h = batch_health(e, np.zeros(len(images), "int32"))
    return float(h["cos_mean"]), float(h["cos_std"])


def build(seed, train_images, collinear=0.0):
    from tfaploss import models
    from tfaploss.run.build import calibrate_batch_norm

    keras.utils.set_random_seed(seed)
    model = models.build_embedding_model("small_cnn", pooling="gem", embedding_dim=32,
                                         weights=None, input_shape=(16, 16, 3),
                                         freeze_bn=True)
    calibrate_batch_norm(model, train_images[:192])
    if collinear:
        # A common offset along one direction: every embedding starts in a narrow cone,
        # as a from-scratch CNN does (mean cosine 0.997).
        head = model.get_layer("head")
        features = keras.Model(model.input, head.input)(train_images[:256])
        spread = float(np.std(np.asarray(features) @ np.asarray(head.kernel)))
        bias = np.zeros(head.bias.shape, "float32")
        bias[0] = collinear * spread
        head.bias.assign(bias)
    return model


def run(name, loss, steps, lr, seed, data, collinear=0.0):
    (xtr, ytr), (xte, yte) = data
    model = build(seed, xtr, collinear)
    opt = keras.optimizers.Adam(lr)
    rng = np.random.default_rng(seed)
    stream = batches(xtr, ytr, range(6), 16, rng)
    probe = xtr[:96]
    start_cos, _ = mean_cos(model, probe)
    start_r1 = recall_at_1(model, xte, yte)
    import tensorflow as tf

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return value

    losses = []
    for _ in range(steps):
        x, y = next(stream)
        losses.append(float(step(x, y)))
    end_cos, end_std = mean_cos(model, probe)
    r1 = recall_at_1(model, xte, yte)
    # Pooled features (the head's input): their spread across images, relative to their
    # size. ~0 means the backbone outputs the same vector for every image (dead ReLUs),
    # so every embedding is the head's bias: an exact collapse with zero gradient.
    head = model.get_layer("head")
    feats = np.asarray(keras.Model(model.input, head.input)(probe))
    spread = float(np.mean(feats.std(axis=0)) / (np.mean(np.abs(feats)) + 1e-12))
    print(f"{name:34s} cos {start_cos:.4f} -> {end_cos:.4f} (std {end_std:.4f})  "
          f"loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}  "
          f"R@1 {start_r1:.3f} (untrained floor) -> {r1:.3f}  feature spread {spread:.3g}",
          flush=True)
    return {"name": name, "start_cos": start_cos, "end_cos": end_cos, "r1": r1,
            "untrained": start_r1}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default=None, help="comma-separated variant names")
    p.add_argument("--collinear", type=float, default=0.0,
                   help="start in a narrow cone: head bias of this many feature spreads")
    args = p.parse_args()
    from tfaploss.losses import CalibrationLoss, ROADMAPLoss, SupAPLoss

    images, labels = digits()
    train, test = labels < 6, labels >= 6
    data = ((images[train], labels[train]), (images[test], labels[test]))
    _, counts = np.unique(labels[test], return_counts=True)
    chance = float(np.sum(counts * (counts - 1)) / (len(labels[test]) * (len(labels[test]) - 1)))
    print(f"chance R@1 (random neighbour) {chance:.3f}; {args.steps} steps, Adam lr "
          f"{args.lr:g}, collinear offset {args.collinear:g}")
    variants = {
        "SupAPLoss": SupAPLoss(),
        "ROADMAPLoss (default lambda 0.5)": ROADMAPLoss(),
        "CalibrationLoss": CalibrationLoss(),
        "ROADMAPLoss lambda 0.1": ROADMAPLoss(lambda_=0.1),
        "ROADMAPLoss per_query calib.": ROADMAPLoss(averaging="per_query"),
        "ROADMAPLoss neg_margin 0.9": ROADMAPLoss(neg_margin=0.9, pos_margin=0.95),
    }
    only = set(args.only.split(",")) if args.only else None
    t0 = time.time()
    for name, loss in variants.items():
        if only and name not in only:
            continue
        run(name, loss, args.steps, args.lr, args.seed, data, args.collinear)
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
