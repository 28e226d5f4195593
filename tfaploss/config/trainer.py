"""Train a run configuration end to end (what ``tfaploss train`` runs).

Run directory layout (``run_dir``)::

    config.yaml     the validated config of this run (a resumed run must match it)
    backup/         keras.callbacks.BackupAndRestore state, saved every epoch; removed
                    when training finishes. A killed run started again with the same
                    command resumes at the first unfinished epoch.
    logs/           TensorBoard scalars (tensorboard --logdir RUN_DIR/logs)
    epochs.jsonl    one JSON line per finished epoch: loss, learning rate, batch health
                    (emb_cos, emb_cos_std, chance_ap: tfaploss.training.health), evaluation
    model.keras     the trained embedding model (images -> L2-normalised embeddings)
    summary.json    config, epochs, steps, timings, final retrieval metrics
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import yaml

from tfaploss.config import build as B
from tfaploss.config.schema import Config, ConfigError, config_from_dict

# Fault injection for the resume test: the process exits (as if killed) right after
# the given epoch (1-based) has been checkpointed.
EXIT_AFTER_EPOCH_ENV = "TFAPLOSS_EXIT_AFTER_EPOCH"


def _epoch_callbacks():
    import keras

    class RetrievalEvaluation(keras.callbacks.Callback):
        """Evaluate retrieval on a test split every ``every`` epochs; adds ``val_*`` logs."""

        def __init__(self, embedding_model, evaluate_fn, every):
            super().__init__()
            self.embedding_model = embedding_model
            self.evaluate_fn = evaluate_fn
            self.every = every

        def on_epoch_end(self, epoch, logs=None):
            if self.every and (epoch + 1) % self.every == 0 and logs is not None:
                metrics = self.evaluate_fn(self.embedding_model)
                # Shown by the progress bar, logged to TensorBoard and epochs.jsonl.
                logs.update({f"val_{k}": v for k, v in metrics.items()})

    class EpochLog(keras.callbacks.Callback):
        """Append each finished epoch's logs (and learning rate) to a JSON-lines file."""

        def __init__(self, path):
            super().__init__()
            self.path = Path(path)

        def on_epoch_end(self, epoch, logs=None):
            row = {"epoch": epoch + 1}
            opt = self.model.optimizer
            try:
                row["learning_rate"] = float(keras.ops.convert_to_numpy(opt.learning_rate))
            except Exception:  # a wrapped optimizer without a scalar learning rate
                pass
            row.update({k: float(v) for k, v in (logs or {}).items()
                        if isinstance(v, (int, float)) or hasattr(v, "__float__")})
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    class ExitAfterEpoch(keras.callbacks.Callback):
        def __init__(self, epoch):
            super().__init__()
            self.epoch = epoch

        def on_epoch_end(self, epoch, logs=None):
            if epoch + 1 == self.epoch:
                print(f"{EXIT_AFTER_EPOCH_ENV}={self.epoch}: exiting after epoch "
                      f"{self.epoch} as asked (simulated crash)", flush=True)
                sys.stdout.flush()
                os._exit(75)

    return RetrievalEvaluation, EpochLog, ExitAfterEpoch


def embed_split(embedding_model, cfg: Config, path: str, max_images: int | None = None,
                verbose: int = 0):
    """Embeddings (N, D) and labels (N,) of every image of a split (at most ``max_images``)."""
    import numpy as np

    batch = 64 if cfg.test_image_size else 1
    ds = B.build_eval_dataset(cfg, path, batch_size=batch)
    if max_images:
        ds = ds.unbatch().take(max_images).batch(batch)
    embeddings, labels = [], []
    for images, y, _ in ds:
        embeddings.append(np.asarray(embedding_model(images, training=False), np.float32))
        labels.append(y.numpy())
    if not embeddings:
        raise ConfigError(f"the split {path!r} holds no images to evaluate on.")
    return np.concatenate(embeddings), np.concatenate(labels)


def evaluate_split(embedding_model, cfg: Config, path: str, max_images: int | None = None):
    """Retrieval metrics of ``cfg.evaluation`` on a split (each image queries the rest)."""
    from tfaploss.evaluation import retrieval_metrics

    embeddings, labels = embed_split(embedding_model, cfg, path, max_images)
    n = len(labels)
    ks = [k for k in cfg.evaluation.ks if k < n] or [1]
    return retrieval_metrics(embeddings, labels, ks=ks, backend=cfg.evaluation.backend)


def _check_run_dir(run_dir: Path, cfg: Config) -> bool:
    """Write config.yaml; refuse to resume a run made with a different config."""
    snapshot = run_dir / "config.yaml"
    current = cfg.to_dict()
    resuming = (run_dir / "backup").exists()
    if snapshot.exists():
        with open(snapshot, encoding="utf-8") as f:
            previous = yaml.safe_load(f)
        if resuming and previous != current:
            changed = sorted(_diff_keys(previous, current))
            raise ConfigError(
                f"run_dir {str(run_dir)!r} holds an unfinished run made with a different "
                f"config (differs in: {', '.join(changed)}). Resume it with the same "
                "config, or use a new run_dir (--set run_dir=...).")
    with open(snapshot, "w", encoding="utf-8") as f:
        yaml.safe_dump(current, f, sort_keys=False)
    return resuming


def _diff_keys(a, b, prefix=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in set(a) | set(b):
            yield from _diff_keys(a.get(key), b.get(key), f"{prefix}{key}.")
    elif a != b:
        yield prefix.rstrip(".")


def _backup_epoch(run_dir: Path) -> int:
    """The epoch BackupAndRestore will resume at (0 for a fresh run)."""
    meta = run_dir / "backup" / "training_metadata.json"
    try:
        with open(meta, encoding="utf-8") as f:
            return int(json.load(f).get("epoch", 0))
    except (OSError, ValueError):
        return 0


def _read_epochs(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows[row["epoch"]] = row  # a re-run epoch replaces the crashed attempt's
    return [rows[k] for k in sorted(rows)]


def train(cfg: Config, *, run_dir: str | None = None, verbose="auto") -> dict:
    """Train ``cfg``; returns the run summary (also written to ``run_dir/summary.json``)."""
    import keras

    from tfaploss.training import MultiStageModel

    run_dir = Path(run_dir or cfg.run_dir)
    if run_dir != Path(cfg.run_dir):
        cfg = config_from_dict(cfg.to_dict(), [f"run_dir={run_dir}"], warn=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    B.check_data(cfg)
    resuming = _check_run_dir(run_dir, cfg)
    steps = B.steps_per_epoch(cfg)
    policy = keras.config.dtype_policy()
    started = time.time()
    try:
        keras.utils.set_random_seed(cfg.training.seed)
        if cfg.training.mixed_precision:
            keras.config.set_dtype_policy("mixed_float16")
        dataset = B.build_train_dataset(cfg, seed_offset=_backup_epoch(run_dir))
        embedding_model = B.build_model(cfg)
        loss = B.build_loss(cfg)
        chunk = cfg.training.chunk_size if cfg.uses_multistage else None
        model = MultiStageModel(embedding_model, chunk_size=chunk,
                                xbm_size=cfg.training.xbm.size,
                                xbm_weight=cfg.training.xbm.weight)
        from tfaploss.training.health import TrainingHealthMonitor, health_metrics

        model.compile(optimizer=B.build_optimizer(cfg, steps), loss=loss,
                      metrics=health_metrics(), jit_compile=cfg.training.jit_compile)
        if not model.built:
            model.build((None, *cfg.image_shape, 3))

        print(_describe_run(cfg, steps, chunk, embedding_model, resuming), flush=True)
        RetrievalEvaluation, EpochLog, ExitAfterEpoch = _epoch_callbacks()
        callbacks = []
        if cfg.data.test and cfg.evaluation.every_n_epochs:
            callbacks.append(RetrievalEvaluation(
                embedding_model,
                lambda m: evaluate_split(m, cfg, cfg.data.test, cfg.evaluation.max_images),
                cfg.evaluation.every_n_epochs))
        callbacks.append(TrainingHealthMonitor())  # warns: collapsed embeddings, flat loss
        callbacks += [
            EpochLog(run_dir / "epochs.jsonl"),
            keras.callbacks.TensorBoard(log_dir=str(run_dir / "logs"), write_graph=False),
            keras.callbacks.BackupAndRestore(str(run_dir / "backup"), save_freq="epoch"),
        ]
        if os.environ.get(EXIT_AFTER_EPOCH_ENV):
            callbacks.append(ExitAfterEpoch(int(os.environ[EXIT_AFTER_EPOCH_ENV])))
        model.fit(dataset, epochs=cfg.training.epochs, steps_per_epoch=steps,
                  callbacks=callbacks, verbose=verbose, shuffle=False)
        train_seconds = time.time() - started

        model_path = run_dir / "model.keras"
        embedding_model.save(model_path)
        final = None
        if cfg.data.test and cfg.evaluation.at_end:
            print(f"Evaluating on {cfg.data.test} ...", flush=True)
            final = evaluate_split(embedding_model, cfg, cfg.data.test)
            print("  " + ", ".join(f"{k} {v:.4f}" for k, v in final.items()), flush=True)
    finally:
        keras.config.set_dtype_policy(policy)

    epochs = _read_epochs(run_dir / "epochs.jsonl")
    summary = {
        "run_dir": str(run_dir),
        "config": cfg.to_dict(),
        "epochs_completed": len(epochs),
        "epochs_requested": cfg.training.epochs,
        "steps_per_epoch": steps,
        "updates": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "resumed": resuming,
        "multistage": chunk is not None,
        "chunk_size": chunk,
        "batch_size": cfg.data.batch_size,
        "history": epochs,
        "final_loss": epochs[-1].get("loss") if epochs else None,
        "final_metrics": final,
        "train_seconds_this_process": round(train_seconds, 2),
        "model": str(model_path),
    }
    with open(run_dir / "summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(f"Done: model {model_path}, summary {run_dir / 'summary.json'}", flush=True)
    return summary


def _describe_run(cfg: Config, steps: int, chunk, model, resuming: bool) -> str:
    params = sum(math.prod(v.shape) for v in model.trainable_weights)
    stage = (f"multi-stage, chunks of {chunk}" if chunk else "single pass")
    kwargs = ", ".join(f"{k}={v!r}" for k, v in cfg.loss.kwargs.items())
    lines = [
        f"tfaploss train: {cfg.description or cfg.run_dir}",
        f"  data     {cfg.data.train} ({cfg.data.sampler}, batch {cfg.data.batch_size}, "
        f"m={cfg.data.m}, {cfg.data.image_size}px)",
        f"  model    {cfg.model.backbone}/{cfg.model.pooling} -> {cfg.model.embedding_dim}-d, "
        f"{params:,} trainable parameters",
        f"  loss     {cfg.loss.name}({kwargs})",
        f"  train    {cfg.training.epochs} epochs x {steps} steps, {stage}, "
        f"{cfg.optimizer.name} lr {cfg.optimizer.lr:g} ({cfg.optimizer.schedule.name})",
        f"  run_dir  {cfg.run_dir}" + ("  (resuming from its last checkpoint)" if resuming else ""),
    ]
    return "\n".join(lines)
