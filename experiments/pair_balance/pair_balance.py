"""Where a trained model's pairs sit: positive against negative distances on one batch.

Explains a pair loss that trains to a small loss yet retrieves at chance. For each
model that ``experiments/batch_sweep/batch_sweep.py`` trained (a run folder of its cache), one
class-balanced training batch (``--batch`` images, m=4, the sweep's crops) is
embedded in inference mode, L2-normalised, and the script prints:

* ``pos d²`` and ``neg d²``: the mean squared distance of positive and negative pairs
  (on the unit sphere, 2 is the distance of unrelated directions);
* ``neg < margin``: the share of negative pairs closer than ``--margin``, the only
  ones contrastive's negative term acts on;
* ``pos weight``: the share of ordered pairs that are positive, (m-1)/(B-1): the weight
  TF Addons' all-pairs mean gives the pull of positives;
* ``L pos``, ``L neg``: the two parts of that all-pairs contrastive loss;
* ``batch mAP``: mean AP of each image ranking the rest of the batch (training
  classes; 1 = every positive ranked first).

Rows are printed for every model given, so the peer (a triplet model trained with the
same budget) is measured beside the model being explained in the same run:

    python experiments/pair_balance/pair_balance.py \\
        experiments/batch_sweep/results/livebn_s32_d64/Contrastive/b2048/u96/lr0.001/seed0 \\
        experiments/batch_sweep/results/livebn_s32_d64/Triplet-semihard/b2048/u96/lr0.001/seed0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "batch_sweep"))
from batch_sweep import DEFAULT_DATA


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders holding a model.keras")
    p.add_argument("--train", default=str(DEFAULT_DATA / "train"))
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--margin", type=float, default=1.0)
    p.add_argument("--chunk", type=int, default=512, help="images embedded at a time")
    p.add_argument("--seed", type=int, default=5, help="which training batch")
    args = p.parse_args(argv)
    missing = [r for r in args.runs if not (Path(r) / "model.keras").is_file()]
    if missing:
        p.error(f"no model.keras in {missing}")
    if not (Path(args.train) / "manifest.json").is_file():
        p.error(f"--train {args.train!r} holds no manifest.json (run `make data-glyphs`)")
    return args


def pair_stats(embeddings, labels, margin):
    """The figures of the module docstring for one batch of embeddings (NumPy)."""
    import numpy as np

    from tfaploss.evaluation.retrieval import retrieval_metrics

    e = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    d2 = np.maximum(2.0 - 2.0 * e @ e.T, 0.0)
    n = len(labels)
    off = ~np.eye(n, dtype=bool)
    pos = (labels[:, None] == labels[None, :]) & off
    neg = off & ~pos
    hinge = np.maximum(margin - np.sqrt(d2), 0.0) ** 2
    return {"pos d²": d2[pos].mean(), "neg d²": d2[neg].mean(),
            "neg < margin": (d2[neg] < margin ** 2).mean(),
            "pos weight": pos.sum() / off.sum(),
            "L pos": d2[pos].sum() / off.sum(), "L neg": hinge[neg].sum() / off.sum(),
            "batch mAP": retrieval_metrics(e, labels, ks=(1,))["map"]}


def main(argv=None):
    args = parse_args(argv)
    import keras
    import numpy as np

    from tfaploss.config import config_from_dict
    from tfaploss.run import build as B

    cfg = config_from_dict({
        "data": {"train": args.train, "batch_size": args.batch, "m": 4,
                 "image_size": args.image_size, "seed": args.seed,
                 "augmentation": {"crop": "random_resized_crop", "scale": [0.6, 1.0],
                                  "flip": False}},
        "model": {"backbone": "small_cnn", "pooling": "gem", "weights": None},
        "loss": {"name": "ContrastiveLoss"}}, warn=False)
    images, labels = next(iter(B.build_train_dataset(cfg)))[:2]
    labels = np.asarray(labels)
    rows = []
    for run in args.runs:
        model = keras.models.load_model(Path(run) / "model.keras", compile=False)
        embeddings = np.concatenate([
            np.asarray(model(images[i:i + args.chunk], training=False))
            for i in range(0, len(labels), args.chunk)])
        rows.append((run, pair_stats(embeddings, labels, args.margin)))
    keys = list(rows[0][1])
    print(f"One training batch of {len(labels)} (m=4), margin {args.margin}:\n")
    print("| run | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for run, stats in rows:
        name = "/".join(Path(run).parts[-5:])
        print(f"| {name} | " + " | ".join(f"{stats[k]:.4g}" for k in keys) + " |")


if __name__ == "__main__":
    main()
