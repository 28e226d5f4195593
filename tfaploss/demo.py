"""``tfaploss demo``: the whole library end to end on scikit-learn's digits, offline.

scikit-learn ships 1,797 real scans of handwritten digits (8x8 pixels, 10 classes), so
the demo needs no download. It walks the production path:

1. write the scans as PNG files in a class-per-folder tree (what users' data looks like);
2. run the ``folder`` Beam job: PNGs -> sharded TFRecords + manifests (digits 0-5 train,
   6-9 test: the test classes are never seen in training, as in the retrieval benchmarks);
3. embed the unseen digits with the untrained small CNN and measure Recall@1, MAP@R and
   mAP (exact search: ``evaluation.backend: auto`` without a target recall);
4. train it with ``APLoss`` through ``tfaploss train``'s code path, batches larger than the
   chunk size so multi-stage backpropagation runs, with checkpoints and TensorBoard logs;
5. measure again, write the metrics JSON and a retrieval-examples figure;
6. export a TF Serving SavedModel with a ``retrieve`` signature over the test split,
   reload it with plain TensorFlow, embed one PNG through ``serving_default`` and
   retrieve its nearest digits through ``retrieve``;
7. print a summary table and where everything is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

from tfaploss import extras
from tfaploss.config import config_from_dict

TRAIN_DIGITS = (0, 1, 2, 3, 4, 5)
TEST_DIGITS = (6, 7, 8, 9)

# The recipe (configs/demo_digits.yaml is the same, with data paths under demo_output/).
DEMO_CONFIG = {
    "description": "tfaploss demo: APLoss + multi-stage backprop on scikit-learn digits",
    "run_dir": "demo_output/run",
    "data": {
        "train": "demo_output/tfrecords/train",
        "test": "demo_output/tfrecords/test",
        "sampler": "m_per_class",
        "batch_size": 96,          # 6 classes x 16 images ...
        "m": 16,
        "image_size": 16,          # the 8x8 scans upsampled; cheap on a CPU
        "augmentation": {"crop": "random_resized_crop", "scale": [0.6, 1.0]},
        "seed": 0,
    },
    "model": {"backbone": "small_cnn", "pooling": "gem", "embedding_dim": 32,
              "weights": None, "freeze_bn": True, "head_lr_multiplier": 1.0,
              # Random init has no BatchNorm statistics to freeze: estimate them first.
              "bn_calibration_images": 192},
    "loss": {"name": "APLoss", "num_bins": 20},
    "optimizer": {"name": "adam", "lr": 1e-3, "weight_decay": 0.0,
                  "schedule": {"name": "cosine", "end_lr": 1e-4}},
    "training": {"epochs": 5, "steps_per_epoch": 30,
                 "chunk_size": 32,  # ... embedded 32 at a time: 3 chunks per batch
                 "mixed_precision": False, "jit_compile": False, "seed": 0},
    "evaluation": {"every_n_epochs": 0, "at_end": False, "ks": [1, 10],
                   "backend": "auto"},
}
QUICK_STEPS = 20
RETRIEVE_K = 5  # the nearest digits the exported retrieve signature returns


def _say(step: int, total: int, text: str) -> None:
    print(f"\n[{step}/{total}] {text}", flush=True)


def write_digit_pngs(root: Path) -> int:
    """The scikit-learn digits as ``root/<digit>/<index>.png`` (8x8 grayscale)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.clip(digits.images * (255.0 / 16.0), 0, 255).astype("uint8")
    for digit in range(10):
        (root / str(digit)).mkdir(parents=True, exist_ok=True)
    for i, (image, label) in enumerate(zip(images, digits.target)):
        Image.fromarray(image, mode="L").save(root / str(int(label)) / f"{i:04d}.png")
    return len(images)


def run_folder_job(png_root: Path, out: Path) -> dict:
    """The ``folder`` Beam job, in-process on the local DirectRunner."""
    from tfaploss.pipelines import folder

    argv = ["--input_dir", str(png_root), "--output_dir", str(out),
            "--test_classes", ",".join(str(d) for d in TEST_DIGITS),
            "--jpeg_quality", "100", "--by_class", "train", "--class_chunk_size", "64",
            # One in-process worker: on a small machine the multi-process runner's
            # start-up costs more than these 1,797 tiny images.
            "--direct_running_mode", "in_memory", "--direct_num_workers", "1"]
    return folder.run(argv)


def _metrics_row(metrics: dict) -> dict:
    return {k: metrics[k] for k in ("recall@1", "map@r", "map") if k in metrics}


_MARKER = ".tfaploss-demo"


def _prepare_output_dir(out: Path) -> None:
    """Empty ``out`` for a new run, but only if an earlier demo made it (or it is empty).

    The folder is replaced on every run, so a mistyped ``--out`` pointing at the user's
    own files must not be wiped: anything without the demo's marker file is refused.
    """
    if out.exists():
        if not out.is_dir():
            raise SystemExit(f"tfaploss demo: --out {out} exists and is not a folder")
        if any(out.iterdir()) and not (out / _MARKER).exists():
            raise SystemExit(
                f"tfaploss demo: --out {out} is not empty and was not written by the demo; "
                "refusing to replace it. Pick a new or empty folder.")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / _MARKER).write_text("written by `tfaploss demo`; the demo replaces this folder\n")


TOTAL_STEPS = 7


@contextmanager
def _timed(timings: dict, key: str):
    """Add the seconds the ``with`` block takes to ``timings[key]``."""
    t = time.time()
    yield
    timings[key] = time.time() - t


def _metrics_line(metrics: dict) -> str:
    return "  " + ", ".join(f"{k} {v:.3f}" for k, v in _metrics_row(metrics).items())


def build_demo_config(records: Path, run_dir: Path, quick: bool = False,
                      steps: int | None = None):
    """:data:`DEMO_CONFIG` on the demo's TFRecords, shortened by ``quick`` or ``steps``."""
    raw = json.loads(json.dumps(DEMO_CONFIG))
    raw["data"]["train"] = str(records / "train")
    raw["data"]["test"] = str(records / "test")
    raw["run_dir"] = str(run_dir)
    if steps is None and quick:
        steps = QUICK_STEPS
    if steps is not None:
        if steps < 1:
            raise ValueError(f"--steps must be >= 1; received {steps}")
        epochs = min(raw["training"]["epochs"], steps)
        raw["training"]["epochs"] = epochs
        raw["training"]["steps_per_epoch"] = max(1, steps // epochs)
    return config_from_dict(raw)


def _measure(model, cfg) -> dict:
    """Retrieval metrics of ``model`` on the unseen test digits."""
    from tfaploss.evaluation import retrieval_metrics
    from tfaploss.run.trainer import embed_split

    embeddings, labels = embed_split(model, cfg, cfg.data.test)
    return retrieval_metrics(embeddings, labels, ks=cfg.evaluation.ks,
                             backend=cfg.evaluation.search_plan)


def _step_write_pngs(out: Path, timings: dict) -> Path:
    _say(1, TOTAL_STEPS, "Writing scikit-learn's 1,797 digit scans as PNG files, one "
                         "folder per digit")
    png_root = out / "digits_png"
    with _timed(timings, "write_pngs"):
        n = write_digit_pngs(png_root)
    print(f"  {n} PNGs in {png_root}/<digit>/")
    return png_root


def _step_beam_job(png_root: Path, records: Path, timings: dict) -> dict:
    _say(2, TOTAL_STEPS, "Beam `folder` job: PNG tree -> TFRecords (train: digits 0-5, "
                         "test: 6-9)")
    with _timed(timings, "beam_job"):
        manifests = run_folder_job(png_root, records)
    for split, manifest in sorted(manifests.items()):
        print(f"  {split}: {manifest['num_images']} images, {manifest['num_classes']} "
              f"classes, {manifest['num_failures']} failures -> {records / split}")
    return manifests


def _step_evaluate_untrained(cfg, timings: dict) -> dict:
    import keras

    from tfaploss.run import build as B

    _say(3, TOTAL_STEPS, "Untrained small CNN on the unseen digits 6-9 (exact search)")
    with _timed(timings, "evaluate_before"):
        keras.utils.set_random_seed(cfg.training.seed)  # the same initial weights train() gets
        before = _measure(B.build_model(cfg), cfg)
    print(_metrics_line(before))
    return before


def _step_train(cfg, timings: dict) -> dict:
    from tfaploss.run.trainer import train

    chunks = -(-cfg.data.batch_size // cfg.training.chunk_size)
    _say(4, TOTAL_STEPS, f"Training with {cfg.loss.name} on digits 0-5: batches of "
                         f"{cfg.data.batch_size} ({cfg.data.batch_size // cfg.data.m} "
                         f"digits x {cfg.data.m}), multi-stage backprop in {chunks} "
                         f"chunks of {cfg.training.chunk_size}")
    with _timed(timings, "train"):
        summary = train(cfg, verbose=2)
    if not summary["multistage"]:
        raise RuntimeError("the demo's batches should have run through MultiStageModel")
    history = summary["history"]
    print(f"  loss {history[0]['loss']:.4f} (epoch 1) -> {history[-1]['loss']:.4f} "
          f"(epoch {len(history)}), {summary['updates']} updates")
    return summary


def _step_evaluate_trained(cfg, summary: dict, out: Path, label_names,
                           timings: dict):
    """Load the trained model, measure it, and write the metrics JSON and figures."""
    import keras

    from tfaploss.evaluation import evaluate
    from tfaploss.run import build as B

    _say(5, TOTAL_STEPS, "Trained model on the unseen digits 6-9; metrics JSON and a figure")
    with _timed(timings, "evaluate_after"):
        model = keras.saving.load_model(summary["model"], compile=False)
        after = _measure(model, cfg)
        print(_metrics_line(after))
        result = evaluate(model, B.build_eval_dataset(cfg, cfg.data.test),
                          protocol="retrieval", ks=cfg.evaluation.ks,
                          backend=cfg.evaluation.search_plan,
                          output_dir=str(out / "evaluation"),
                          label_names=label_names, verbose=0)
    for path in result.figures:
        print(f"  figure: {path}")
    return model, after


def _step_export(model, cfg, out: Path, png_root: Path, label_names: dict,
                 timings: dict) -> dict:
    """Export a SavedModel whose ``retrieve`` signature searches the test split, reload
    it with plain TensorFlow, embed one test PNG and retrieve its nearest digits;
    returns the export folder, the served embedding's cosine with the Keras model's and
    what ``retrieve`` found."""
    import numpy as np
    import tensorflow as tf

    from tfaploss.data import center_crop
    from tfaploss.export import export_saved_model

    _say(6, TOTAL_STEPS, "Export for TF Serving with a retrieve signature over the test "
                         "split; reload with plain TensorFlow, query one PNG")
    with _timed(timings, "export"):
        export_dir = export_saved_model(model, out / "saved_model", image_size=cfg.image_shape,
                                        index=cfg.data.test, k=RETRIEVE_K)
        served = tf.saved_model.load(export_dir)
        png = min((png_root / str(TEST_DIGITS[0])).glob("*.png"))
        png_bytes = png.read_bytes()
        embedding = served.signatures["serving_default"](
            image_bytes=tf.constant([png_bytes]))["embedding"].numpy()[0]
        # The same image through the Keras model, preprocessed like the test split.
        pixels = center_crop(tf.constant(png_bytes), cfg.data.image_size)[None]
        keras_embedding = np.asarray(model(pixels, training=False))[0]
        agreement = float(np.dot(embedding, keras_embedding))
        found = served.signatures["retrieve"](image_bytes=tf.constant([png_bytes]),
                                              k=tf.constant(RETRIEVE_K))
        retrieved = [{"key": key.decode(), "score": float(score), "label": int(label),
                      "digit": label_names.get(str(int(label)), "?")}
                     for key, score, label in zip(found["keys"].numpy()[0],
                                                  found["scores"].numpy()[0],
                                                  found["labels"].numpy()[0])]
        query = out / "query.npy"  # the PNG as saved_model_cli --inputs reads it
        np.save(query, np.array([png_bytes], dtype=object))
    print(f"  SavedModel: {export_dir}")
    print(f"  serving_default({png.relative_to(out)}) -> {embedding.shape[0]}-d embedding, "
          f"norm {np.linalg.norm(embedding):.4f}, cosine with the Keras model "
          f"{agreement:.6f}")
    print(f"  retrieve({png.relative_to(out)}) -> its {RETRIEVE_K} nearest test digits "
          "(key, digit, score):")
    for hit in retrieved:
        print(f"    {hit['key']:<12} {hit['digit']}  {hit['score']:.4f}")
    print(f"  the same from TensorFlow's own tool:\n    saved_model_cli run --dir "
          f"{export_dir} --tag_set serve --signature_def retrieve --inputs "
          f"image_bytes={query}")
    if agreement < 0.999:
        raise RuntimeError(f"the served embedding disagrees with the Keras model "
                           f"(cosine {agreement:.6f})")
    return {"export_dir": export_dir, "agreement": agreement, "retrieved": retrieved,
            "query": str(png.relative_to(png_root))}


def _print_summary(out: Path, before: dict, after: dict, elapsed: float) -> None:
    _say(7, TOTAL_STEPS, "Summary: retrieval on digits 6-9, never seen in training")
    print(f"  {'metric':<10} {'untrained':>10} {'trained':>10}")
    for key in ("recall@1", "map@r", "map"):
        print(f"  {key:<10} {before[key]:>10.3f} {after[key]:>10.3f}")
    print(f"\nDone in {elapsed:.0f} s. Everything is in {out.resolve()}:")
    for name, what in [
        ("digits_png/", "the PNG tree the Beam job read"),
        ("tfrecords/", "TFRecords + manifest.json per split"),
        ("run/", "model.keras, summary.json, epochs.jsonl, TensorBoard logs/"),
        ("evaluation/", "metrics.json and the retrieval-examples figure"),
        ("saved_model/", "the TF Serving SavedModel, retrieve over the test digits"),
        ("query.npy", "one test digit, for saved_model_cli run --inputs"),
        ("demo_summary.json", "the numbers above"),
    ]:
        print(f"  {name:<18} {what}")
    if after["recall@1"] <= before["recall@1"]:
        print("warning: Recall@1 did not improve; try more steps (--steps)", file=sys.stderr)


def run_demo(out: str = "demo_output", quick: bool = False, steps: int | None = None) -> int:
    """Run the demo into ``out``; returns 0 on success (any failure raises)."""
    # Before the first step: the digits come from scikit-learn, the records from Beam.
    extras.require("demo", "tfaploss demo (scikit-learn's digits)")
    extras.require("beam", "tfaploss demo (its Beam folder job)", ("apache_beam",))
    started = time.time()
    out = Path(out)
    _prepare_output_dir(out)
    timings = {}
    print("tfaploss demo: retrieval of handwritten digits never seen in training")
    print(f"outputs go to {out.resolve()}")

    png_root = _step_write_pngs(out, timings)
    records = out / "tfrecords"
    manifests = _step_beam_job(png_root, records, timings)
    cfg = build_demo_config(records, out / "run", quick=quick, steps=steps)
    before = _step_evaluate_untrained(cfg, timings)
    summary = _step_train(cfg, timings)
    model, after = _step_evaluate_trained(cfg, summary, out,
                                          manifests["test"]["label_map"], timings)
    served = _step_export(model, cfg, out, png_root, manifests["test"]["label_map"],
                          timings)

    elapsed = time.time() - started
    history = summary["history"]
    report = {
        "before": before, "after": after, "loss_first_epoch": history[0]["loss"],
        "loss_last_epoch": history[-1]["loss"], "updates": summary["updates"],
        "batch_size": cfg.data.batch_size, "chunk_size": cfg.training.chunk_size,
        "train_classes": list(TRAIN_DIGITS), "test_classes": list(TEST_DIGITS),
        "saved_model": served["export_dir"], "served_cosine_vs_keras": served["agreement"],
        "retrieve_query": served["query"], "retrieved": served["retrieved"],
        "timings_seconds": {k: round(v, 2) for k, v in timings.items()},
        "total_seconds": round(elapsed, 1),
    }
    with open(out / "demo_summary.json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    _print_summary(out, before, after, elapsed)
    return 0


DEMO_DESCRIPTION = textwrap.dedent("""\
    The whole library on real data that ships with scikit-learn (1,797
    scanned 8x8 digits), offline, in about 2 minutes on a laptop CPU:

      1. write the digits as PNG files, one folder per class
      2. run the Beam `folder` job: PNGs -> TFRecords (train: 0-5, test: 6-9)
      3. evaluate a random small CNN on the unseen digits 6-9 (exact search)
      4. train it with APLoss and multi-stage backpropagation on digits 0-5
      5. evaluate again: Recall@1, MAP@R, mAP; figures and JSON
      6. export a SavedModel with a retrieve signature over the test
         digits; reload it with plain TensorFlow, embed a PNG and
         retrieve its nearest digits
      7. print a summary table

    Everything lands in one folder (--out, default ./demo_output).""")


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, shared by ``tfaploss demo`` and ``python -m tfaploss.demo``."""
    parser.add_argument("--out", default="demo_output", metavar="DIR",
                        help="output folder (default: ./demo_output); replaced if it exists")
    parser.add_argument("--quick", action="store_true",
                        help="reduced run for CI (fewer training steps)")
    parser.add_argument("--steps", type=int, default=None,
                        help="total training steps (overrides the default and --quick)")


def main(argv=None) -> int:  # python -m tfaploss.demo
    parser = argparse.ArgumentParser(
        prog="python -m tfaploss.demo", description=DEMO_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_demo_arguments(parser)
    args = parser.parse_args(argv)
    return run_demo(out=args.out, quick=args.quick, steps=args.steps)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
