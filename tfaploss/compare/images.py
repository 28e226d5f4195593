"""The image tiers: each run trains the whole network through ``tfaploss train``.

From scratch (``model.weights: null``) or fine-tuning a pretrained backbone (the
config's ``model.weights``, e.g. a user's ImageNet file, BatchNorm as the config says),
with the config's data, model, augmentation and optimizer; the runner sets the loss, the
learning rate (cosine decay to 0), the batch, the number of updates and the seed, and
multi-stages batches larger than ``chunk_size``. The validation classes are evaluated
after every epoch (the convergence curve) on at most ``curve_images`` images, the test
classes once at the end for the evaluation seeds.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from tfaploss.compare.protocol import SEARCH_SPACES, RunSpec

LOG = logging.getLogger(__name__)


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

    def __init__(self, cfg, val: str, out: str, epochs: int = 4, chunk_size: int = 512,
                 curve_images: int | None = 4000, eval_images: int | None = None):
        self.cfg, self.val, self.out = cfg, val, Path(out)
        self.epochs, self.chunk_size = epochs, chunk_size
        self.curve_images, self.eval_images = curve_images, eval_images

    def config(self, spec: RunSpec, run_dir: Path):
        from tfaploss.config.load import config_from_dict

        raw = self.cfg.to_dict()
        cls, _, _ = SEARCH_SPACES[spec.loss]
        settings = spec.settings
        epochs = min(self.epochs, spec.updates)
        raw["run_dir"] = str(run_dir)
        raw["description"] = f"compare: {spec.loss} B={spec.batch} u={spec.updates} s={spec.seed}"
        raw["data"].update(batch_size=spec.batch, seed=spec.seed, test=self.val)
        raw["model"]["proxy_lr_multiplier"] = float(settings.get("proxy_lr_multiplier", 1.0))
        raw["loss"] = {"name": cls, **spec.loss_kwargs()}
        raw["optimizer"].update(lr=float(settings["lr"]), warmup_epochs=0.0,
                                schedule={"name": "cosine", "end_lr": 0.0})
        raw["training"].update(epochs=epochs, steps_per_epoch=math.ceil(spec.updates / epochs),
                               seed=spec.seed,
                               chunk_size=self.chunk_size if spec.batch > self.chunk_size
                               else None)
        raw["evaluation"].update(every_n_epochs=1, at_end=False, ks=[1], backend="exact",
                                 max_images=self.curve_images)
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
        try:
            summary = train(cfg, verbose=0, restart=True)
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
        model = keras.saving.load_model(run_dir / "model.keras")
        val = evaluate_split(model, cfg, self.val, self.eval_images)
        row.update({"val_map@r": 100 * val["map@r"], "val_r@1": 100 * val["recall@1"]})
        if spec.test:
            test = evaluate_split(model, cfg, self.cfg.data.test, self.eval_images)
            row.update({"test_map@r": 100 * test["map@r"], "test_r@1": 100 * test["recall@1"]})
        row["seconds"] = round(time.time() - started, 1)
        return row
