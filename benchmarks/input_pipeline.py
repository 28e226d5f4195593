"""Is ``tfaploss train`` input-bound? A full training step fed by the real input
pipeline against the same step fed from batches cached in memory.

    python benchmarks/input_pipeline.py                 # ResNet-50, 224x224, B=32
    python benchmarks/input_pipeline.py --quick         # small CNN, 64x64, B=64
    python benchmarks/input_pipeline.py --config configs/fastap_sop_resnet50.yaml

1. Generates ``--num_images`` photo-like JPEGs (``--image_size_on_disk``, smooth colour
   fields plus block noise, so they compress like photos) in ``--num_classes`` class
   folders and writes them with the folder job (``tfaploss.pipelines.folder``: per-image records
   + the by_class layout + manifest), as a user would before training.
2. Builds the run of ``--config`` exactly as ``tfaploss train`` does
   (``tfaploss.run.build``: ``build_train_dataset`` = TFRecords -> class-balanced
   sampler -> fused JPEG decode + RandomResizedCrop -> flip -> batch -> prefetch;
   ``build_model``, ``build_loss``, ``build_optimizer``, ``MultiStageModel.compile``),
   with ``data.train`` pointed at the generated split, random weights and
   ``--set`` overrides.
3. Times ``model.fit`` for ``--steps`` steps (after ``--warmup`` steps), ``--rounds``
   times alternately, on
   * the real pipeline, and
   * ``--cached`` batches taken from that same pipeline beforehand and replayed from
     memory (the floor: the same step with no input work),
   and prints images/s of both and the ratio (target >= 0.9), plus the input
   pipeline alone (no training) as the rate it could feed at most.

Writes ``benchmarks/results/input_pipeline.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness


def generate_jpegs(root: str, num_images: int, num_classes: int, size: tuple[int, int],
                   seed: int = 0) -> None:
    """Photo-like JPEGs (smooth fields + block noise) in one folder per class."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for i in range(num_images):
        k = i % num_classes
        base = rng.uniform(0, 255, size=3).astype(np.float32)
        fx, fy = rng.uniform(0.002, 0.03, size=2)
        field = np.sin(xx * fx + k)[..., None] * 60 + np.cos(yy * fy)[..., None] * 60 + base
        noise = rng.normal(0, 12, (h // 4 + 1, w // 4 + 1, 3)).repeat(4, 0).repeat(4, 1)[:h, :w]
        folder = os.path.join(root, f"class{k:04d}")
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(np.clip(field + noise, 0, 255).astype(np.uint8)).save(
            os.path.join(folder, f"{i:06d}.jpg"), quality=90)


def write_records(images: str, out: str) -> str:
    from tfaploss.pipelines import folder

    folder.run(["--input_dir", images, "--output_dir", out])
    return os.path.join(out, "train")


def add_data_arguments(p, num_images: int, num_classes: int) -> None:
    """The synthetic data's options: how many JPEGs, of how many classes, how large, and
    where to keep them."""
    p.add_argument("--num_images", type=int, default=num_images)
    p.add_argument("--num_classes", type=int, default=num_classes)
    p.add_argument("--image_size_on_disk", default="500x375", help="WxH of the JPEGs")
    p.add_argument("--workdir", default=None, help="keep (and reuse) the generated data here")


def prepare_split(args, work: str) -> str:
    """The training split of ``args``' synthetic JPEGs, as TFRecords written by the
    folder job, under ``work``; what is already there is reused."""
    images, records = os.path.join(work, "images"), os.path.join(work, "records")
    if not os.path.isdir(images):
        w, h = (int(v) for v in args.image_size_on_disk.split("x"))
        print(f"generating {args.num_images} {w}x{h} JPEGs...", flush=True)
        generate_jpegs(images, args.num_images, args.num_classes, (w, h))
    if not os.path.isdir(os.path.join(records, "train")):
        print("writing TFRecords with the folder job...", flush=True)
        write_records(images, records)
    return os.path.join(records, "train")


def build_run(args, split: str):
    """Dataset, compiled model and config, as ``tfaploss.run.trainer.train`` makes them."""
    import keras

    from tfaploss.config import load_config
    from tfaploss.run import build as B
    from tfaploss.training import MultiStageModel

    overrides = [f"data.train={split}", "data.test=null", "model.weights=null",
                 "training.steps_per_epoch=1000", *args.set]
    cfg = load_config(args.config, overrides, warn=False)
    keras.utils.set_random_seed(cfg.training.seed)
    dataset = B.build_train_dataset(cfg)
    model = MultiStageModel(B.build_model(cfg),
                            chunk_size=cfg.multistage_chunk,
                            xbm_size=cfg.training.xbm.size, xbm_weight=cfg.training.xbm.weight)
    model.compile(optimizer=B.build_optimizer(cfg, 1000), loss=B.build_loss(cfg),
                  jit_compile=cfg.training.jit_compile)
    return cfg, dataset, model


def fit_rate(model, dataset, steps: int, warmup: int, batch_size: int) -> float:
    """Images/s of one ``model.fit`` over ``warmup + steps`` steps, timed from the end
    of the ``warmup``-th step (tracing, pipeline start-up) to the end of the last."""
    import keras

    stamps = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.perf_counter())

    model.fit(dataset, steps_per_epoch=warmup + steps, epochs=1, verbose=0,
              callbacks=[Clock()])
    return steps * batch_size / (stamps[-1] - stamps[warmup - 1])


def pipeline_rate(dataset, batches: int, batch_size: int) -> float:
    it = iter(dataset)
    for _ in range(3):
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        x, _ = next(it)
    x.numpy()
    return batches * batch_size / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join("configs", "roadmap_sop_resnet50.yaml"))
    p.add_argument("--set", action="append", default=[],
                   help="config override KEY=VALUE (repeatable)")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cached", type=int, default=4, help="distinct batches replayed")
    p.add_argument("--rounds", type=int, default=2,
                   help="interleaved (cached, pipeline) timings; the best of each is kept")
    add_data_arguments(p, num_images=1200, num_classes=100)
    harness.add_arguments(p, harness.RESULTS_DIR / "input_pipeline.json",
                          quick_help="small CNN at 64x64, B=64, 400 images of 50 classes, "
                                     "one round: a check that runs in minutes",
                          tiny_help="small CNN at 32x32, B=16, 64 images of 64x48 in 8 "
                                    "classes, 3 steps")
    args = p.parse_args(argv)
    if args.quick or args.tiny:
        tiny = args.tiny
        args.quick = True
        args.batch_size, args.steps, args.rounds = (16, 3, 1) if tiny else (64, 20, 1)
        cap_images, cap_classes = (64, 8) if tiny else (400, 50)
        args.num_images = min(args.num_images, cap_images)
        args.num_classes = min(args.num_classes, cap_classes)
        if tiny:
            args.warmup, args.cached, args.image_size_on_disk = 1, 2, "64x48"
        args.set = ["model.backbone=small_cnn", "model.pooling=gem",
                    f"model.embedding_dim={32 if tiny else 64}",
                    f"data.image_size={32 if tiny else 64}", "model.freeze_bn=false", *args.set]
    args.set = ["data.sampler=m_per_class", "data.m=4", f"data.batch_size={args.batch_size}",
                "model.bn_calibration_images=0", *args.set]

    work = args.workdir or tempfile.mkdtemp(prefix="tfaploss_input_")
    try:
        split = prepare_split(args, work)

        import tensorflow as tf

        cfg, dataset, model = build_run(args, split)
        b = cfg.data.batch_size
        print(f"config {args.config}: {cfg.model.backbone}, {cfg.data.image_size}x"
              f"{cfg.data.image_size}, B={b}, loss {cfg.loss.name}; "
              f"{os.cpu_count()} CPUs", flush=True)

        feed = pipeline_rate(dataset, max(10, args.steps), b)
        print(f"  input pipeline alone        {feed:8.1f} images/s", flush=True)
        cached = list(dataset.take(args.cached))
        xs = tf.stack([x for x, _ in cached])
        ys = tf.stack([y for _, y in cached])
        cached_ds = tf.data.Dataset.from_tensor_slices((xs, ys)).repeat().prefetch(2)

        floor = real = 0.0
        for r in range(args.rounds):  # interleaved, best of each: load on a shared
            # machine hits both alike
            c = fit_rate(model, cached_ds, args.steps, args.warmup, b)
            print(f"  round {r + 1}: step on cached batches      {c:8.2f} images/s", flush=True)
            x = fit_rate(model, dataset, args.steps, args.warmup, b)
            print(f"  round {r + 1}: step on the input pipeline  {x:8.2f} images/s", flush=True)
            floor, real = max(floor, c), max(real, x)
        print(f"  best: cached {floor:.2f} images/s (the floor), input pipeline "
              f"{real:.2f} images/s", flush=True)
        ratio = real / floor
        verdict = "met" if ratio >= 0.9 else "NOT met"
        print(f"\nratio real / cached = {ratio:.3f} (target >= 0.9: {verdict})")
        print(f"| model | images | B | input pipeline alone | step, cached | step, pipeline "
              f"| ratio |\n|---|---|---:|---:|---:|---:|---:|\n| {cfg.model.backbone} "
              f"| {cfg.data.image_size}² from {args.image_size_on_disk} JPEGs | {b} "
              f"| {feed:.1f}/s | {floor:.2f}/s | {real:.2f}/s | {ratio:.3f} |")
        figures = [harness.figure(
            "input_pipeline", f"{cfg.model.backbone} {cfg.data.image_size}², B={b}: step "
            "on the input pipeline", real, "images/s", floor=floor,
            floor_name="the same step on cached batches", higher_is_better=True)]
        harness.write_results(args.out, "input_pipeline", args, figures,
                              overrides=args.set, batch_size=b,
                              pipeline_alone_images_per_s=feed, cached_images_per_s=floor,
                              pipeline_images_per_s=real, ratio=ratio)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
