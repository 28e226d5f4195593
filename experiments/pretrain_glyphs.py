"""Pretrain a backbone in-domain, as an ImageNet file stands in for the papers' regime.

Nothing can download ImageNet weights here, so the fair comparison's pretrained tiers
(docs/batch_sweep.md) start from a small_cnn trained by softmax classification on CJK
characters that are in none of the retrieval set's train, val or test classes: the
glyph job renders every covered character (``--max_classes 0``) into a second folder,
and this script drops the retrieval set's characters by name (its manifests' label
maps) before training. The backbone's weights are saved as a Keras weights file that
``model.weights`` loads exactly as a user's ImageNet file (``tfaploss.models.build_backbone``).

    python -m tfaploss.pipelines.glyphs --input_dir data/fonts/extracted \\
        --output_dir data/glyphs_pretrain --max_classes 0 --test_fraction 0.02 \\
        --val_fraction 0 --seed 1
    nice python experiments/pretrain_glyphs.py --data data/glyphs_pretrain/train \\
        --exclude data/glyphs --out data/pretrained/small_cnn_glyphs.weights.h5

Prints the classes kept, then per epoch the loss, the training and held-out top-1
accuracy and the time; writes the weights file and a JSON record beside it. Last, the
frozen backbone's pooled features are scored on the retrieval set's validation classes
and on the study's 500 test classes (the draw ``tfaploss compare --test-classes 500``
scores), so that the weak regime's backbone can be fixed (60-80 test MAP@R) before any
loss is run; the record holds both numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load(path, exclude_root, image_size, max_classes=0, seed=0):
    import numpy as np

    from tfaploss.data import make_eval_dataset, read_manifest

    excluded = set()
    for split in ("train", "val", "test"):
        manifest = read_manifest(str(Path(exclude_root) / split)) or {}
        excluded.update(manifest.get("label_map", {}).values())
    names = read_manifest(path)["label_map"]
    keep = {int(k): v for k, v in names.items() if v not in excluded}
    if max_classes:  # the weak regime: a seeded draw of the kept characters
        drawn = np.random.default_rng(seed).permutation(sorted(keep))[:max_classes]
        keep = {int(k): keep[int(k)] for k in drawn}
    images, labels = [], []
    for x, y, _ in make_eval_dataset(path, image_size=image_size, batch_size=512):
        y = y.numpy()
        rows = np.isin(y, list(keep))
        images.append(x.numpy()[rows].astype("uint8"))
        labels.append(y[rows])
    images, labels = np.concatenate(images), np.concatenate(labels)
    classes, labels = np.unique(labels, return_inverse=True)
    return images, labels.astype("int32"), [keep[int(c)] for c in classes], len(excluded)


def frozen_scores(weights, retrieval_root, image_size, test_classes):
    """Validation and test MAP@R (%) of the L2-normalised pooled features of the backbone
    saved in ``weights``, on the classes ``tfaploss compare --features`` scores: every
    validation class, and its seeded draw of ``test_classes`` test classes.

    The backbone is rebuilt from the file as ``compare`` builds it (GeM at its default
    exponent, BatchNorm in inference mode): the file holds the backbone only, so the
    exponent GeM learned during pretraining is not what a comparison sees."""
    from tfaploss.compare.features import TEST_CLASS_SEED, class_subset, score
    from tfaploss.data import make_eval_dataset
    from tfaploss.evaluation.embed import embed_dataset
    from tfaploss.models import build_embedding_model

    embed = build_embedding_model("small_cnn", "gem", embedding_dim=None, head="identity",
                                  weights=str(weights), input_shape=(image_size, image_size, 3),
                                  freeze_bn=True)
    out = {}
    for split, classes in (("val", None), ("test", test_classes)):
        ds = make_eval_dataset(str(Path(retrieval_root) / split), image_size=image_size,
                               batch_size=512)
        features, labels, _ = embed_dataset(embed, ds, verbose=0, predict_step=True)
        features, labels = class_subset(features, labels, classes, seed=TEST_CLASS_SEED)
        out[f"{split}_map@r"], out[f"{split}_r@1"], _ = score(lambda b: b, features, labels)
    return out


def rescore(args):
    """Rewrite the record's frozen scores from the weights file, without retraining."""
    from tfaploss.durable.atomic import atomic_write_json

    out = Path(args.out)
    record_path = out.with_suffix(".json")
    record = json.loads(record_path.read_text())
    record["test_classes"] = args.test_classes
    record["frozen"] = frozen_scores(out, args.exclude, record["image_size"], args.test_classes)
    atomic_write_json(record_path, record)
    print(f"rescored {out}: val MAP@R {record['frozen']['val_map@r']:.2f}, test MAP@R "
          f"{record['frozen']['test_map@r']:.2f}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="the pretraining split (train)")
    p.add_argument("--exclude", required=True,
                   help="the retrieval set's root (train/val/test): its characters are dropped")
    p.add_argument("--out", required=True, help="the backbone weights file (.weights.h5)")
    p.add_argument("--image_size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--test_classes", type=int, default=500,
                   help="test classes the frozen features are scored on (the draw of "
                        "tfaploss compare --test-classes)")
    p.add_argument("--max_classes", type=int, default=0,
                   help="pretrain on a seeded draw of this many characters (0: all); "
                        "the study's weak backbone uses few, so that its frozen features "
                        "leave room for a loss to win")
    p.add_argument("--rescore", action="store_true",
                   help="only rescore the frozen features of the existing --out file")
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.rescore:
        return rescore(args)
    if not args.data:
        p.error("--data is required unless --rescore")
    import keras
    import numpy as np
    import tensorflow as tf

    from tfaploss.durable.atomic import atomic_write_json
    from tfaploss.models import build_embedding_model

    started = time.time()
    images, labels, names, excluded = load(args.data, args.exclude, args.image_size,
                                             args.max_classes, args.seed)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(labels))
    held = order[: len(order) // 20]
    train = order[len(order) // 20:]
    print(f"{len(names)} classes kept ({excluded} retrieval-set characters excluded), "
          f"{len(train)} training and {len(held)} held-out images "
          f"({time.time() - started:.0f} s to load)", flush=True)

    keras.utils.set_random_seed(args.seed)
    size = args.image_size
    base = build_embedding_model("small_cnn", "gem", embedding_dim=None, head="identity",
                                 input_shape=(size, size, 3), freeze_bn=False)
    pooled = base.get_layer("gem").output
    logits = keras.layers.Dense(len(names), name="classifier")(pooled)
    model = keras.Model(base.input, logits)
    steps = args.epochs * (len(train) // args.batch)
    schedule = keras.optimizers.schedules.CosineDecay(args.lr, steps)
    model.compile(optimizer=keras.optimizers.Adam(schedule),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    def augment(x, y):  # a few pixels of shift, as the retrieval runs' crops
        x = tf.image.resize_with_crop_or_pad(x, size + 6, size + 6)
        x = tf.image.random_crop(x, (tf.shape(x)[0], size, size, 3))
        return x, y

    data = (tf.data.Dataset.from_tensor_slices((images[train], labels[train]))
            .shuffle(len(train), seed=args.seed).batch(args.batch, drop_remainder=True)
            .map(lambda x, y: augment(tf.cast(x, "float32"), y)).prefetch(2))
    history = model.fit(data, epochs=args.epochs, verbose=2,
                        validation_data=(images[held].astype("float32"), labels[held]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(".tmp-" + out.name)
    base.get_layer("small_cnn").save_weights(tmp)
    os.replace(tmp, out)
    record = {"classes": len(names), "max_classes": args.max_classes, "excluded": excluded, "train_images": len(train),
              "held_out_images": len(held), "epochs": args.epochs, "batch": args.batch,
              "lr": args.lr, "image_size": size, "seconds": round(time.time() - started),
              "history": {k: [float(v) for v in vs] for k, vs in history.history.items()}}
    record["test_classes"] = args.test_classes
    record["frozen"] = frozen_scores(out, args.exclude, size, args.test_classes)
    atomic_write_json(out.with_suffix(".json"), record)
    print(f"wrote {out} ({time.time() - started:.0f} s): held-out top-1 "
          f"{record['history']['val_accuracy'][-1]:.3f}; frozen features: val MAP@R "
          f"{record['frozen']['val_map@r']:.1f}, test MAP@R "
          f"{record['frozen']['test_map@r']:.1f} ({args.test_classes} test classes)",
          flush=True)


if __name__ == "__main__":
    main()
