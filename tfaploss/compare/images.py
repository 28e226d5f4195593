"""The image tiers: each run trains the whole network through ``tfaploss train``,
from scratch (``model.weights: null``) or fine-tuning the config's ``model.weights``.

The runner sets the loss, the learning rate (cosine decay to 0), the batch, the updates
and the seed, and multi-stages batches above ``chunk_size``; the rest is the config's.
The validation classes are scored after every epoch (the curve) after precise BN
(:class:`tfaploss.compare.curves.PreciseBNCurve`), the test classes once at the end.
What ``tfaploss train`` reports goes to the run's log (``RUN.train.log``), not the console.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

from tfaploss.compare.protocol import SEARCH_SPACES, RunSpec
from tfaploss.durable import run_dir as run_files

LOG = logging.getLogger(__name__)


@contextlib.contextmanager
def run_log(path: Path):
    """The ``tfaploss`` loggers' lines, INFO and up, also written to ``path`` for the
    block (the console's handler, the command's, decides what it shows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("tfaploss")
    level = root.level
    root.addHandler(handler)
    if not root.isEnabledFor(logging.INFO):
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


class ImageRunner:
    """Trains and scores one :class:`~tfaploss.compare.protocol.RunSpec` on images.

    Args:
        cfg: the base :class:`~tfaploss.config.Config` (data, model, augmentation,
            optimizer name; its loss, learning rate and training length are replaced).
        val: the validation split's folder (classes disjoint from the test split's).
        out: folder of the runs (one sub-folder per run).
        epochs: evaluations of the validation classes along a run (at most one per update).
        chunk_size: multi-stage batches above this many images.
        curve_images, eval_images: validation images of the curve; images of the final
            validation and test evaluations (None: all).
    """

    def __init__(self, cfg, val: str, out: str, m: int | None = None, epochs: int = 4,
                 chunk_size: int = 512, curve_images: int | None = 4000,
                 eval_images: int | None = None):
        self.cfg, self.val, self.out = cfg, val, Path(out)
        self.m = m or cfg.data.m
        self.epochs, self.chunk_size = epochs, chunk_size
        self.curve_images, self.eval_images = curve_images, eval_images

    def setup(self) -> dict:
        """What defines this runner's runs beside their spec (the ledger keys on it)."""
        return {"m": self.m, "epochs": self.epochs, "chunk_size": self.chunk_size,
                "curve_images": self.curve_images, "eval_images": self.eval_images,
                "val": str(self.val), "curve": "precise BN"}

    def config(self, spec: RunSpec, run_dir: Path):
        from tfaploss.config.load import config_from_dict

        raw = self.cfg.to_dict()
        settings = spec.settings
        epochs = min(self.epochs, spec.updates)
        raw["run_dir"] = str(run_dir)
        raw["description"] = f"compare: {spec.loss} B={spec.batch} u={spec.updates} s={spec.seed}"
        raw["data"].update(batch_size=spec.batch, m=self.m, seed=spec.seed, test=self.val)
        raw["model"]["proxy_lr_multiplier"] = float(settings.get("proxy_lr_multiplier", 1.0))
        raw["loss"] = {"name": SEARCH_SPACES[spec.loss][0], **spec.loss_kwargs()}
        raw["optimizer"].update(lr=float(settings["lr"]), warmup_epochs=0.0,
                                schedule={"name": "cosine", "end_lr": 0.0})
        raw["training"].update(epochs=epochs, steps_per_epoch=math.ceil(spec.updates / epochs),
                               seed=spec.seed,
                               chunk_size=self.chunk_size if spec.batch > self.chunk_size
                               else None)
        # the curve: PreciseBNCurve instead of train's own evaluation (stale BatchNorm)
        raw["evaluation"].update(every_n_epochs=0, at_end=False, ks=[1], backend="exact",
                                 max_images=self.curve_images)
        raw["training"]["callbacks"] = [*raw["training"].get("callbacks", []), {
            "class": "tfaploss.compare.curves.PreciseBNCurve",
            "kwargs": {"config_file": str(run_dir / run_files.CONFIG), "split": str(self.val),
                       "max_images": self.curve_images}}]
        return config_from_dict(raw, warn=False)

    def __call__(self, spec: RunSpec) -> dict:
        import keras

        from tfaploss.run.trainer import evaluate_split, train
        from tfaploss.training.guards import NonFiniteTrainingError

        run_dir = self.out / "runs" / spec.key("images")
        cfg = self.config(spec, run_dir)
        keras.backend.clear_session()
        started = time.time()
        row = {"status": "ok", "curve": []}
        # a folder a killed run left is started over; a new one needs no --restart
        restart = run_dir.exists()
        try:
            # beside the run folder, which a restart empties
            with run_log(run_dir.with_name(run_dir.name + ".train.log")):
                summary = train(cfg, verbose=0, restart=restart)
        except NonFiniteTrainingError as err:
            row.update(status="non-finite", detail=str(err).splitlines()[0])
            row["seconds"] = round(time.time() - started, 1)
            return row
        stopped = summary.get("stopped_early")
        if stopped:
            row["status"] = f"stopped: {stopped['reason']}"
        steps = cfg.training.steps_per_epoch
        for epoch in summary.get("history", []):
            if "val_map@r" in epoch:
                row["curve"].append([epoch["epoch"] * steps * spec.batch,
                                     100 * epoch["val_map@r"]])
        model = keras.saving.load_model(run_dir / run_files.MODEL)
        val = evaluate_split(model, cfg, self.val, self.eval_images)
        row.update({"val_map@r": 100 * val["map@r"], "val_r@1": 100 * val["recall@1"]})
        if spec.test:
            test = evaluate_split(model, cfg, self.cfg.data.test, self.eval_images)
            row.update({"test_map@r": 100 * test["map@r"], "test_r@1": 100 * test["recall@1"]})
        row["seconds"] = round(time.time() - started, 1)
        return row
