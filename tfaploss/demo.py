"""The work of ``tfaploss demo``, one function per step; :mod:`tfaploss.cli.demo` runs
them in order and tells what each found.

scikit-learn's 1,797 handwritten digits (no download) go the production path: PNG files
in class folders, the ``folder`` Beam job (digits 0-5 train, 6-9 test: unseen classes),
``tfaploss train``'s code path with multi-stage backpropagation, exact search, and a
TF Serving SavedModel whose ``retrieve`` signature searches the test split.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def measure(model, cfg) -> dict:
    """Retrieval metrics of ``model`` on the unseen test digits."""
    from tfaploss.evaluation import retrieval_metrics
    from tfaploss.run.trainer import embed_split

    embeddings, labels = embed_split(model, cfg, cfg.data.test)
    return retrieval_metrics(embeddings, labels, ks=cfg.evaluation.ks,
                             backend=cfg.evaluation.search_plan)


def measure_untrained(cfg) -> dict:
    """:func:`measure` of the model ``tfaploss train`` starts from."""
    import keras

    from tfaploss.run import build as B

    keras.utils.set_random_seed(cfg.training.seed)  # the same initial weights train() gets
    return measure(B.build_model(cfg), cfg)


def train_demo(cfg) -> dict:
    """``tfaploss train``'s run of ``cfg``; its summary."""
    from tfaploss.run.trainer import train

    summary = train(cfg, verbose=2)
    if not summary["multistage"]:
        raise RuntimeError("the demo's batches should have run through MultiStageModel")
    return summary


def measure_trained(cfg, model_path: str, output_dir: Path, label_names):
    """The trained model loaded, measured, and evaluated into ``output_dir`` (metrics
    JSON and figures); returns the model, its metrics and the figures' paths."""
    import keras

    from tfaploss.evaluation import evaluate
    from tfaploss.run import build as B

    model = keras.saving.load_model(model_path, compile=False)
    after = measure(model, cfg)
    result = evaluate(model, B.build_eval_dataset(cfg, cfg.data.test),
                      protocol="retrieval", ks=cfg.evaluation.ks,
                      backend=cfg.evaluation.search_plan,
                      output_dir=str(output_dir), label_names=label_names, verbose=0)
    return model, after, result.figures


def export_and_query(model, cfg, out: Path, png_root: Path, label_names: dict) -> dict:
    """Export a SavedModel whose ``retrieve`` signature searches the test split, reload
    it with plain TensorFlow, embed one test PNG and retrieve its nearest digits.
    Returns the folder, the PNG (``query``: under ``png_root``; ``query_npy``: for
    ``saved_model_cli --inputs``), the served embedding's ``dim``, ``norm`` and cosine
    with the Keras model's (``agreement``), and what ``retrieve`` found."""
    import numpy as np
    import tensorflow as tf

    from tfaploss.data import center_crop
    from tfaploss.export import export_saved_model

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
    found = served.signatures["retrieve"](image_bytes=tf.constant([png_bytes]),
                                          k=tf.constant(RETRIEVE_K))
    retrieved = [{"key": key.decode(), "score": float(score), "label": int(label),
                  "digit": label_names.get(str(int(label)), "?")}
                 for key, score, label in zip(found["keys"].numpy()[0],
                                              found["scores"].numpy()[0],
                                              found["labels"].numpy()[0])]
    query_npy = out / "query.npy"
    np.save(query_npy, np.array([png_bytes], dtype=object))
    return {"export_dir": export_dir, "png": png, "query": str(png.relative_to(png_root)),
            "dim": embedding.shape[0], "norm": float(np.linalg.norm(embedding)),
            "agreement": float(np.dot(embedding, keras_embedding)),
            "retrieved": retrieved, "query_npy": query_npy}
