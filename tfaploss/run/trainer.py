"""Train a run configuration end to end (what ``tfaploss train`` runs).

Run directory layout (``run_dir``; rank 0 alone writes it, every file atomically)::

    config.yaml     the validated config of this run (a resumed run must match it)
    backup/         checkpoints (tfaploss.durable.checkpoints), removed once
                    model.keras and summary.json are in place
    logs/           TensorBoard scalars
    epochs.jsonl    one JSON line per finished epoch (training.callbacks.EpochLogger)
    model.keras     the trained embedding model (images -> L2-normalised embeddings)
    summary.json    config, epochs, steps, timings, final retrieval metrics, and
                    ``stopped_early`` / ``health_events`` of the batch-health check
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from pathlib import Path

import yaml

from tfaploss.config.callbacks import build_callback
from tfaploss.config.fields import ConfigError
from tfaploss.config.load import config_from_dict
from tfaploss.config.schema import Config
from tfaploss.durable import atomic, faults, locks
from tfaploss.durable import run_dir as D
from tfaploss.durable.checkpoints import DamagedRunError, RunBackup
from tfaploss.extras import MissingExtraError
from tfaploss.log import reporting
from tfaploss.run import build as B
from tfaploss.run import preemption, processes
from tfaploss.run import resume as R
from tfaploss.run.devices import DevicePlan, plan_devices
from tfaploss.run.needs import check_config_extras

__all__ = ["DamagedRunError", "embed_split", "evaluate_split", "initial_model", "train"]

LOG = logging.getLogger(__name__)


def _health_monitor(cfg: Config):
    from tfaploss.training.health import TrainingHealthMonitor

    h = cfg.training.health
    if not h.enabled:
        return None
    return TrainingHealthMonitor(h.thresholds(), action="warn",
                                 batch_size=cfg.data.batch_size)


def embed_split(embedding_model, cfg: Config, path: str, max_images: int | None = None,
                verbose: int = 0):
    """Embeddings (N, D) and labels (N,) of every image of a split (at most ``max_images``)."""
    from tfaploss.evaluation.embed import EmptyDatasetError, embed_dataset

    batch = 64 if cfg.test_image_size else 1
    ds = B.build_eval_dataset(cfg, path, batch_size=batch)
    if max_images:
        ds = ds.unbatch().take(max_images).batch(batch)
    try:
        embeddings, labels, _ = embed_dataset(embedding_model, ds, verbose,
                                              predict_step=batch > 1)
    except EmptyDatasetError:
        raise ConfigError(f"the split {path!r} holds no images to evaluate on.") from None
    return embeddings, labels


def evaluate_split(embedding_model, cfg: Config, path: str, max_images: int | None = None,
                   search: dict | None = None):
    """Retrieval metrics of ``cfg.evaluation`` on a split (each image queries the rest),
    by :func:`tfaploss.evaluation.evaluate` with the config's search plan.

    ``search``, when given, receives the report's search part (backend, setting, recall;
    with ``evaluation.backend: auto`` what it chose and why). With
    ``evaluation.target_recall`` the metrics gain ``search_recall``, the tuner's recall@k.
    """
    from tfaploss.evaluation.evaluator import describe_search, evaluate

    embeddings, labels = embed_split(embedding_model, cfg, path, max_images)
    ks = [k for k in cfg.evaluation.ks if k < len(labels)] or [1]
    result = evaluate(embeddings, labels, ks=ks, backend=cfg.evaluation.search_plan,
                      verbose=0)
    report = result.details["search"]
    if search is not None:
        search.update(report)
    metrics = dict(result.metrics)
    if cfg.evaluation.search_plan.target_recall is not None:
        LOG.info("%s", describe_search(report))
        metrics["search_recall"] = float(report["recall"])
    return metrics


def _epoch_rows(path: Path, epochs: int) -> list[dict]:
    """One row per epoch of epochs.jsonl (a re-run epoch's last), read and checked as a
    resume reads them."""
    rows = {row["epoch"]: row for row in D.read_epoch_log(path, epochs)}
    return [rows[k] for k in sorted(rows)]


def _repair_epoch_log(path: Path) -> None:
    """Drop a last line a kill cut short, so the next row starts on its own line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        atomic.atomic_write(path, lambda tmp: Path(tmp).write_bytes(
            data[:data.rfind(b"\n") + 1]))


def _backbone_and_pooling(m) -> str:
    """``resnet50/gem``; a path as ``path (gem)``."""
    name = m.backbone_file or m.backbone
    return f"{name} ({m.pooling})" if "/" in name or "\\" in name else f"{name}/{m.pooling}"


def initial_model(cfg: Config):
    """The embedding model ``train`` starts from (what ``tfaploss evaluate --config``
    evaluates): same seed, weights and BatchNorm calibration."""
    import keras

    keras.utils.set_random_seed(cfg.training.seed)
    return B.build_model(cfg)


def train(cfg: Config, *, run_dir: str | None = None, verbose="auto",
          restart: bool = False, verify_data: str = "sizes",
          skip_damaged: bool = False) -> dict:
    """Train ``cfg``; returns the run summary (also written to ``run_dir/summary.json``).

    Called again with the same config, a killed run resumes from its last checkpoint
    and a finished one is not trained again; ``restart=True`` starts over at epoch 1,
    the previous files moved aside. Raises
    :class:`~tfaploss.training.guards.NonFiniteTrainingError` at the first non-finite
    loss or weight; a run the batch-health check stopped is saved and summarised.

    Checked before anything is written: the extras the config needs
    (:class:`~tfaploss.extras.MissingExtraError`), the run directory
    (:class:`~tfaploss.durable.checkpoints.DamagedRunError`, ConfigError,
    :class:`~tfaploss.durable.locks.LockHeldError`) and the data against their manifest
    (``verify_data``: ``"sizes"``, ``"full"`` or ``"off"``; ``skip_damaged`` leaves
    damaged files out rather than raise
    :class:`~tfaploss.data.integrity.DamagedDataError`). ``verbose``: Keras's progress
    display. Under several processes every rank calls ``train``; ranks other than 0
    return ``{"run_dir", "rank", "updates", "processes"}``.
    """
    with reporting():
        check_config_extras(cfg)
        group = processes.start(cfg.training.distribute)
        run_dir = Path(run_dir or cfg.run_dir)
        if run_dir != Path(cfg.run_dir):
            cfg = config_from_dict(cfg.to_dict(), [f"run_dir={run_dir}"], warn=False)
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"run_dir {str(run_dir)!r} is a file, not a folder: remove it "
                              "or use another run_dir (--set run_dir=...).")
        with contextlib.ExitStack() as held:
            def claim():  # rank 0's: the others never write the run directory
                try:
                    run_dir.mkdir(parents=True, exist_ok=True)
                except OSError as err:
                    raise ConfigError(f"run_dir {str(run_dir)!r} cannot be created "
                                      f"({type(err).__name__}: {err}).") from None
                held.enter_context(locks.exclusive(
                    run_dir, "run directory", log=lambda line: LOG.warning("%s", line)))

            group.main_first(claim, f"creating and locking {run_dir}")
            from tfaploss.data import integrity

            data = integrity.reading(cfg.data.train, cfg.data.test, what="training")
            with data:
                return _train(cfg, run_dir, verbose=verbose, restart=restart,
                              data=(data, verify_data, skip_damaged))


def _start_over(run_dir: Path, cfg: Config) -> None:
    try:
        R.inspect(run_dir, cfg)
        damage = None
    except DamagedRunError as err:
        damage = err
    except ConfigError:
        damage = None  # another config's run: not damaged
    aside, moved = D.move_aside(run_dir, damaged=damage is not None)
    if aside is None:
        LOG.info("--restart: %s holds no previous run; starting at epoch 1", run_dir)
        return
    LOG.warning("--restart: moved the previous run's files (%s) aside into %s%s; starting "
                "at epoch 1", ", ".join(moved), aside,
                f" (damaged: {damage.path.name} {damage.problem})" if damage else "")


def _train(cfg: Config, run_dir: Path, *, verbose, restart: bool, data) -> dict:
    import keras

    from tfaploss.training import MultiStageModel
    from tfaploss.training.callbacks import (
        EpochCheckpoint,
        EpochLogger,
        FaultPoints,
        RetrievalEvaluation,
        stop_summary,
    )
    from tfaploss.training.guards import StopOnNonFinite, check_finite_weights

    group = processes.current()
    if not restart:  # every rank, before rank 0 changes anything: read only
        processes.check_resume(RunBackup(run_dir / D.BACKUP), group, cfg.data.batch_size)
    # before anything initialises TensorFlow's devices (several CPU devices need that)
    plan = plan_devices(cfg)

    def prepare():  # rank 0's: what a killed run left is cleaned up here
        if restart:
            _start_over(run_dir, cfg)
        RunBackup.remove_trash(run_dir)
        removed = atomic.remove_temp_files(run_dir)
        if removed:
            LOG.info("note: removed unfinished file(s) a killed run left: %s",
                     ", ".join(removed))
        return R.inspect(run_dir, cfg)  # damage, another config: raises, changes nothing

    state = group.main_first(prepare, f"checking the run directory {run_dir}")
    if state is None:  # another rank: reads what rank 0 left
        state = R.inspect(run_dir, cfg)
    done = state.finished
    if done is not None:
        how = (f"stopped by the batch-health check after {done['updates']} updates: "
               f"{done['stopped_early']['reason']}; change the config to train again"
               if done.get("stopped_early") else f"{done['epochs_completed']} epochs")
        LOG.info("%s already holds this finished run (%s): nothing to do. Model: %s. Use "
                 "another run_dir (--set run_dir=...) or --restart to train again.",
                 run_dir, how, run_dir / D.MODEL)
        return done
    B.check_data(cfg)
    processes.check_shards(cfg, group)
    skipped, skipping = _check_records(cfg, *data)
    resuming = state.resuming
    epochs_log = run_dir / D.EPOCH_LOG

    def write_config():
        atomic.atomic_write_text(run_dir / D.CONFIG,
                                 yaml.safe_dump(cfg.to_dict(), sort_keys=False),
                                 fault="config")
        _repair_epoch_log(epochs_log)

    group.main_first(write_config, "writing config.yaml")
    steps = B.steps_per_epoch(cfg)
    backup = processes.GroupBackup(run_dir / D.BACKUP, group, cfg.data.batch_size)
    policy = keras.config.dtype_policy()
    started = time.time()
    devices_scope = contextlib.ExitStack()
    data_scope = contextlib.ExitStack()  # every dataset of the run leaves skipped files out
    data_scope.enter_context(skipping)
    try:
        devices_scope.enter_context(plan.scope())
        if cfg.training.mixed_precision:
            keras.config.set_dtype_policy("mixed_float16")
        loss = B.build_loss(cfg)
        embedding_model = B.attach_proxies(loss, initial_model(cfg))
        chunk = cfg.multistage_chunk
        model = MultiStageModel(embedding_model, chunk_size=chunk,
                                xbm_size=cfg.training.xbm.size,
                                xbm_weight=cfg.training.xbm.weight)
        from tfaploss.training.health import health_metrics
        from tfaploss.training.lone_queries import LoneQueryMonitor, LoneQueryShare

        # a loss with no tracker (ProxyAnchorLoss) has no lone query
        lone = getattr(loss, "lone_queries", None) is not None
        model.compile(optimizer=B.build_optimizer(cfg, steps), loss=loss,
                      metrics=health_metrics() + ([LoneQueryShare()] if lone else []),
                      jit_compile=cfg.training.jit_compile)
        if not model.built:
            model.build((None, *cfg.image_shape, 3))
        start_epoch = backup.restore(model, state.checkpoint) if resuming else 0
        start_step = state.step[0] if state.step[0] < steps else 0  # steps changed: epoch
        if start_step:  # a preempted run's step checkpoint, taken after that epoch
            backup.restore(model, (start_epoch, state.step[1]))
        updates = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        if updates != start_epoch * steps + start_step:
            LOG.warning("warning: the checkpoint of epoch %d holds %d optimizer updates, not "
                        "%d x %d steps per epoch; did the training split change? "
                        "Continuing from it.", start_epoch, updates, start_epoch, steps)
        if plan.backend == "tensorflow":
            # fit runs under the model's strategy; callbacks read variables outside it
            # (inside, reading a sync-on-read variable as an array fails)
            devices_scope.close()

        if group.is_main:
            LOG.info("%s", _describe_run(cfg, steps, chunk, embedding_model, resuming,
                                         start_epoch, plan, group))
        callbacks = [StopOnNonFinite(steps, hint=f"optimizer.lr={cfg.optimizer.lr:g}")]
        if faults.active():  # crash tests only
            callbacks.append(FaultPoints())
        if cfg.data.test and cfg.evaluation.every_n_epochs:
            callbacks.append(RetrievalEvaluation(
                embedding_model=embedding_model,
                # every rank evaluates, so that callbacks reading it agree
                evaluate_fn=lambda m: evaluate_split(group.local_model(m), cfg,
                                                     cfg.data.test,
                                                     cfg.evaluation.max_images),
                every_n_epochs=cfg.evaluation.every_n_epochs))
        monitor = _health_monitor(cfg)  # collapsed embeddings, flat loss: warn, stop
        if monitor is not None:
            callbacks.append(monitor)
        if lone:  # most queries without a positive in their batch: warn once per fit
            callbacks.append(LoneQueryMonitor())
        # The user's, after the evaluation whose logs they may monitor (EarlyStopping).
        callbacks += [build_callback(spec, f"training.callbacks[{i}]")
                      for i, spec in enumerate(cfg.training.callbacks)]
        if group.is_main:  # the writers: rank 0's
            callbacks += [
                EpochLogger(epochs_log, monitor),
                keras.callbacks.TensorBoard(log_dir=str(run_dir / D.LOGS),
                                            write_graph=False),
            ]
        # last: it saves what every other callback has seen (rank 0 writes)
        callbacks.append(EpochCheckpoint(backup))
        if start_epoch < cfg.training.epochs:  # SIGTERM, SIGINT: a step checkpoint, stop
            preemption.fit(model, cfg, steps=steps, start_epoch=start_epoch,
                           start_step=start_step, backup=backup, callbacks=callbacks,
                           verbose=verbose if group.is_main else 0)
        train_seconds = time.time() - started
        stopped = monitor.stopped if monitor is not None else None
        if stopped is not None:
            LOG.info("Training stopped by the batch-health check at step %s of epoch %s: %s",
                     stopped["epoch_step"], stopped["epoch"], stopped["message"])

        model_path = run_dir / D.MODEL
        if B.precise_batch_norm(embedding_model, cfg):
            LOG.info("BatchNorm statistics re-estimated on %d training images "
                     "(model.precise_bn_images)", cfg.model.precise_bn_images)
        check_finite_weights(embedding_model, str(model_path))
        if not group.is_main:  # rank 0 saves, evaluates and summarises
            return {"run_dir": str(run_dir), "rank": group.rank,
                    "updates": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
                    "processes": group.to_dict()}
        with group.alone():
            atomic.atomic_write(model_path, embedding_model.save, fault="model",
                                needed=backup.expected_bytes())  # weights + optimizer
        final, final_search = None, None
        if cfg.data.test and cfg.evaluation.at_end:
            LOG.info("Evaluating on %s ...", cfg.data.test)
            final_search = {}
            try:
                final = evaluate_split(group.local_model(embedding_model), cfg,
                                       cfg.data.test, search=final_search)
            except MissingExtraError as err:
                # the model is saved: the summary is still written, without metrics
                LOG.warning("warning: final evaluation skipped: %s", err)
                final_search = {"skipped": str(err)}
            else:
                LOG.info("  %s", ", ".join(f"{k} {v:.4f}" for k, v in final.items()))
    finally:
        devices_scope.close()
        data_scope.close()
        keras.config.set_dtype_policy(policy)

    epochs = _epoch_rows(epochs_log, cfg.training.epochs)
    updates = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    summary = {
        "run_dir": str(run_dir),
        "config": cfg.to_dict(),
        # A stopped run's last row is the epoch it stopped in, cut short.
        "epochs_completed": len(epochs) if stopped is None else updates // steps,
        "epochs_requested": cfg.training.epochs,
        "steps_per_epoch": steps,
        "updates": updates,
        "stopped_early": None if stopped is None else stop_summary(stopped),
        "health_events": [] if monitor is None else monitor.records,
        "resumed": resuming,
        "resumed_after_epoch": start_epoch,
        "multistage": chunk is not None,
        "chunk_size": chunk,
        "batch_size": cfg.data.batch_size,
        "distribute": plan.to_dict(),
        "processes": group.to_dict(),
        # epochs.jsonl keeps the per-step values; the summary stays one row per epoch.
        "history": [{k: v for k, v in row.items() if k != "health_steps"}
                    for row in epochs],
        "final_loss": epochs[-1].get("loss") if epochs else None,
        "final_metrics": final,
        "final_search": final_search or None,
        "skipped_data": skipped,
        "train_seconds_this_process": round(train_seconds, 2),
        "model": str(model_path),
    }
    atomic.atomic_write_json(run_dir / D.SUMMARY, summary, fault="summary")
    backup.discard()  # only now: model.keras and summary.json are in place
    LOG.info("Done: model %s, summary %s", model_path, run_dir / D.SUMMARY)
    return summary


def _check_records(cfg: Config, reading, level: str, skip: bool):
    """Check the data against their manifests; with ``skip``, the damaged training
    files and the context that leaves them out."""
    from tfaploss.data import integrity

    layout = "images" if cfg.data.sampler is None else "by_class"
    skipped = integrity.startup_check(cfg.data.train, cfg.data.test, layout=layout,
                                      level=level, skip=skip)
    if not skipped:
        return None, contextlib.nullcontext()
    split = integrity.split_dir_of(cfg.data.train)
    files = [os.path.normpath(os.path.join(split, s["file"])) for s in skipped["shards"]]
    reading.ignore |= set(files)
    kept = skipped.pop("class_records", None)  # {label: images}: not for summary.json
    if kept is not None:
        B.check_classes_left(cfg, kept, skipped)
    return skipped, integrity.skipping(files, kept)


def _describe_run(cfg: Config, steps: int, chunk, model, resuming: bool, start_epoch: int,
                  plan: DevicePlan, group: processes.ProcessGroup) -> str:
    params = sum(math.prod(v.shape) for v in model.trainable_weights)
    stage = (f"multi-stage, chunks of {chunk}" if chunk else "single pass")
    kwargs = ", ".join(f"{k}={v!r}" for k, v in cfg.loss.kwargs.items())
    lines = [
        f"tfaploss train: {cfg.description or cfg.run_dir}",
        (f"  data     {cfg.data.train} ({cfg.data.sampler}, batch {cfg.data.batch_size}, "
         f"m={cfg.data.m}, {cfg.data.image_size}px)"),
        (f"  model    {_backbone_and_pooling(cfg.model)} -> "
         f"{cfg.model.embedding_dim}-d, {params:,} trainable parameters"),
        f"  loss     {cfg.loss.name}({kwargs})",
        f"  devices  {plan.describe()}",
        *([(f"  ranks    {group.describe()}, {cfg.data.batch_size // group.world_size} "
            "images of every global batch each")] if group.distributed else []),
        (f"  train    {cfg.training.epochs} epochs x {steps} steps, {stage}, "
         f"{cfg.optimizer.name} lr {cfg.optimizer.lr:g} ({cfg.optimizer.schedule.name})"),
        f"  run_dir  {cfg.run_dir}" + (
            f"  (resuming from its last checkpoint: epoch {start_epoch} done)"
            if start_epoch else "  (no complete checkpoint: starting at epoch 1)"
            if resuming else ""),
    ]
    return "\n".join(lines)
