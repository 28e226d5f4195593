"""The cached-feature tier: a frozen backbone embeds every image once, and each run
trains only an embedding head on those features (a fraction of a second per step, so the
whole protocol fits on a CPU).

:func:`extract_features` embeds the splits with the config's backbone and pooling (its
``model.weights``, BatchNorm frozen, no head) and caches them as ``.npz`` files keyed by
what produced them. :class:`FeatureRunner` trains one run: a head with Adam and a cosine
decay to 0 on seeded batches of ``m`` images of ``B / m`` classes; it records the
validation MAP@R at the run's end, and for the evaluation seeds the convergence curve
and the test MAP@R.

The head starts where the features are, so that a run measures what its loss adds to
them: ``residual`` (default) ``x + W2 relu(W1 x + b1) + b2`` with W2, b2 zero at step 0;
``linear`` ``W x + b`` with W = I, b = 0; ``mlp`` ``Dense(hidden, relu) -> Dense(dim)``
from a random start (the first studies' head). Every report carries the frozen features'
score and their PCA as baseline rows (:func:`baselines`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np

from tfaploss.compare.protocol import SEARCH_SPACES, RunSpec, grid_settings
from tfaploss.data.samplers import m_per_class_rows
from tfaploss.durable import atomic

LOG = logging.getLogger(__name__)


def _fingerprint(cfg, paths: dict) -> str:
    m = cfg.model
    parts = [m.backbone, m.pooling, m.weights, _digest(m.weights), list(cfg.image_shape),
             sorted(paths.items())]
    if m.backbone_file or m.preprocessing != "auto":  # older caches keep their names
        parts.append([m.backbone_file, _digest(m.backbone_file), m.preprocessing])
    text = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _digest(path) -> str | None:
    if not path or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def feature_model(cfg):
    """The config's backbone and pooling, no head, BatchNorm frozen (L2-normalised
    pooled features)."""
    from tfaploss.models import build_embedding_model
    from tfaploss.run.build import config_backbone

    m = cfg.model
    return build_embedding_model(backbone=config_backbone(m), pooling=m.pooling,
                                 embedding_dim=None, head="identity",
                                 weights=None if m.backbone_file else m.weights,
                                 input_shape=(*cfg.image_shape, 3), freeze_bn=True,
                                 preprocessing=None if m.preprocessing == "none"
                                 else m.preprocessing)


def extract_features(cfg, paths: dict, cache_dir: str | os.PathLike) -> dict:
    """``{split: (features, labels)}`` of every split in ``paths`` ({name: folder}),
    embedded once by :func:`feature_model` and cached under ``cache_dir``."""
    from tfaploss.run.trainer import embed_split

    cache = Path(cache_dir) / f"features-{_fingerprint(cfg, paths)}"
    out, model = {}, None
    for split, path in paths.items():
        file = cache / f"{split}.npz"
        if file.is_file():
            with np.load(file) as saved:
                out[split] = (saved["features"], saved["labels"])
            continue
        if model is None:
            import keras

            # A backbone without weights (model.weights: null) is a random draw: the
            # training seed's, so that its cached splits are embedded by one network.
            keras.utils.set_random_seed(cfg.training.seed)
            model = feature_model(cfg)
        started = time.time()
        features, labels = embed_split(model, cfg, path)
        features = np.asarray(features, "float32")
        labels = np.asarray(labels).astype("int64")
        cache.mkdir(parents=True, exist_ok=True)
        atomic.atomic_write(file, lambda tmp, f=features, y=labels: np.savez(
            tmp, features=f, labels=y), fault="report")
        LOG.info("features of %s: %d x %d in %.0f s (cached in %s)", split, *features.shape,
                 time.time() - started, file)
        out[split] = (features, labels)
    return out


def class_subset(features, labels, classes: int | None, seed: int = 0):
    """The rows of ``classes`` classes drawn at random (all when None or more)."""
    unique = np.unique(labels)
    if classes is None or classes >= len(unique):
        return features, labels
    keep = np.random.default_rng(seed).choice(unique, classes, replace=False)
    rows = np.isin(labels, keep)
    return features[rows], labels[rows]


def class_folds(features, labels, folds: int, seed: int = 2) -> list[tuple]:
    """``folds`` class-disjoint parts of the rows, the classes dealt at random (seeded)
    and as evenly as they divide."""
    unique = np.random.default_rng(seed).permutation(np.unique(labels))
    if folds > len(unique):
        raise ValueError(f"val_folds={folds} needs as many validation classes; there are "
                         f"{len(unique)}.")
    return [(features[rows], labels[rows]) for rows in
            (np.isin(labels, part) for part in np.array_split(unique, folds))]


def features_digest(data: dict) -> str:
    """A hash of the cached features and labels of every split (``{split: (x, y)}``):
    what a comparison's runs were trained and scored on."""
    h = hashlib.sha256()
    for split in sorted(data):
        for array in data[split]:
            array = np.ascontiguousarray(array)
            h.update(f"{split}{array.dtype}{array.shape}".encode())
            h.update(array.tobytes())
    return h.hexdigest()[:16]


def score(embed, features, labels) -> tuple[float, float, float]:
    """``(MAP@R %, R@1 %, mean pairwise cosine)`` of ``embed(features)`` (a callable on
    a block of rows), L2-normalised, on ``labels``."""
    from tfaploss.evaluation.retrieval import retrieval_metrics

    embeddings = np.concatenate([np.asarray(embed(features[i:i + 8192]), "float32")
                                 for i in range(0, len(features), 8192)])
    norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
    embeddings = embeddings / np.maximum(norms, 1e-12)
    metrics = retrieval_metrics(embeddings, labels, ks=(1,))
    sample = embeddings[np.random.default_rng(0).choice(len(embeddings),
                                                         min(1000, len(embeddings)), False)]
    cos = sample @ sample.T
    off = cos[~np.eye(len(sample), dtype=bool)]
    return 100 * metrics["map@r"], 100 * metrics["recall@1"], float(off.mean())


def baselines(train, val, test, dim: int) -> dict:
    """The rows every report carries beside the trained heads, on the same validation
    and test classes: the frozen features themselves, and their PCA (fitted on the
    training features) to ``dim`` dimensions. ``{"frozen": {...}, "pca": {...}}``, each
    with ``val_map@r``, ``val_r@1``, ``test_map@r``, ``test_r@1`` (%)."""
    x = np.asarray(train[0], "float64")
    mean = x.mean(axis=0)
    # the principal axes: right singular vectors of the centred training features
    _, _, axes = np.linalg.svd(x - mean, full_matrices=False)
    dim = min(int(dim), axes.shape[0])
    projection = axes[:dim].T.astype("float32")
    centre = mean.astype("float32")
    out = {}
    for name, embed in (("frozen", lambda block: block),
                        ("pca", lambda block: (block - centre) @ projection)):
        row = {"dim": int(train[0].shape[1]) if name == "frozen" else dim}
        for split, (features, labels) in (("val", val), ("test", test)):
            map_r, r1, _ = score(embed, features, labels)
            row.update({f"{split}_map@r": map_r, f"{split}_r@1": r1})
        out[name] = row
    return out


HEADS = ("residual", "linear", "mlp")

#: The seed of the test classes a comparison scores with ``test_classes`` set
#: (:func:`class_subset`): the same draw in every comparison, and for anyone scoring a
#: backbone on "the comparison's test classes".
TEST_CLASS_SEED = 2


class FeatureRunner:
    """Trains and scores one :class:`~tfaploss.compare.protocol.RunSpec` on features.

    Args:
        data: ``{"train", "val", "test"}: (features, labels)``.
        m: images per class in a batch.
        head: ``residual`` (default), ``linear`` or ``mlp`` (module docstring).
        hidden: the hidden units of the residual and mlp heads.
        dim: the mlp head's embedding size (the others keep the features' width).
        curve_points: validation evaluations along the run (the last at its end).
        curve_classes: validation classes the curve is measured on (all: None).
        test_classes: test classes scored (a fixed draw; all: None).
        val_folds: also score this many class-disjoint folds of the validation classes
            (``val_folds`` in each row; tuning repeats by folds pick on them).
    """

    def __init__(self, data: dict, m: int = 4, head: str = "residual", hidden: int = 512,
                 dim: int = 128, curve_points: int = 5, curve_classes: int | None = 100,
                 test_classes: int | None = None, val_folds: int | None = None):
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}; received head={head!r}.")
        self.train = data["train"]
        self.val = data["val"]
        self.curve_val = class_subset(*data["val"], curve_classes, seed=1)
        self.test = class_subset(*data["test"], test_classes, seed=TEST_CLASS_SEED)
        self.val_folds = val_folds
        self.folds = class_folds(*self.val, val_folds) if val_folds else []
        # class ids 0..C-1 for the proxies
        self.classes, self.train_labels = np.unique(self.train[1], return_inverse=True)
        self.width = int(self.train[0].shape[1])
        self.m, self.head_kind, self.hidden = m, head, hidden
        self.dim = dim if head == "mlp" else self.width
        self.curve_points, self.curve_classes = curve_points, curve_classes
        self.test_classes = test_classes
        self.eligible_classes = int(np.sum(np.bincount(self.train_labels) >= m))

    def setup(self) -> dict:
        """What defines this runner's runs beside their spec (the ledger keys on it)."""
        return {"head": self.head_kind, "hidden": None if self.head_kind == "linear"
                else self.hidden, "dim": self.dim, "m": self.m,
                "test_classes": self.test_classes, "curve_classes": self.curve_classes,
                "curve_points": self.curve_points,
                **({"val_folds": self.val_folds} if self.val_folds else {})}

    def baselines(self, dim: int) -> dict:
        """:func:`baselines` on this runner's validation and test classes."""
        return baselines(self.train, self.val, self.test, dim)

    def check(self, batch_sizes):
        """Refuse, before any run, a batch the training features cannot fill."""
        bad = [b for b in batch_sizes if b // self.m > self.eligible_classes]
        if bad:
            raise ValueError(
                f"batch sizes {bad} need more than the {self.eligible_classes} training "
                f"classes with >= m={self.m} images ({self.m} images of B/m classes per "
                "batch); use smaller batches or a smaller --m.")

    def head(self):
        """A new head (module docstring), before any step."""
        import keras

        inputs = keras.Input((self.width,))
        if self.head_kind == "linear":
            outputs = keras.layers.Dense(self.width, kernel_initializer="identity")(inputs)
        elif self.head_kind == "residual":
            hidden = keras.layers.Dense(self.hidden, activation="relu")(inputs)
            update = keras.layers.Dense(self.width, kernel_initializer="zeros")(hidden)
            outputs = keras.layers.Add()([inputs, update])
        else:
            hidden = keras.layers.Dense(self.hidden, activation="relu")(inputs)
            outputs = keras.layers.Dense(self.dim)(hidden)
        return keras.Model(inputs, outputs, name="head")

    def _model(self, spec: RunSpec):
        import keras

        from tfaploss import losses
        from tfaploss.run.build import _uses_proxies
        from tfaploss.run.schedule import RecipeSchedule

        keras.utils.set_random_seed(spec.seed)
        kwargs = spec.loss_kwargs()
        loss_cls = getattr(losses, SEARCH_SPACES[spec.loss][0])
        proxies = _uses_proxies(loss_cls, kwargs)
        loss = (loss_cls(num_classes=len(self.classes), **kwargs) if proxies
                else loss_cls(**kwargs))
        model = self.head()
        if proxies:
            model = loss.with_proxies(model)
        settings = spec.settings
        schedule = RecipeSchedule(kind="cosine", lr=settings["lr"], total_steps=spec.updates,
                                  end_lr=0.0)
        optimizer = keras.optimizers.Adam(schedule)
        factor = settings.get("proxy_lr_multiplier", 1.0)
        if factor != 1.0:
            from tfaploss.models.lr_multipliers import LRMultiplierOptimizer

            optimizer = LRMultiplierOptimizer(optimizer, losses.proxies_multipliers(factor))
        model.compile(optimizer=optimizer, loss=loss, jit_compile="auto")
        return model

    def step(self, model):
        """``(x, y) -> loss``: one update of the compiled ``model``. Under TensorFlow a
        ``tf.function`` without autograph (``train_on_batch`` retraced every run's step
        with autograph: half of a short run), compiled with XLA: at B=4096 a Smooth-AP
        update took 0.77 s against 2.5 s, triplet 1.2 against 2.7, FastAP 0.79 against
        1.1 (2 cores); other backends: ``train_on_batch``, jitted on JAX."""
        import keras

        if keras.backend.backend() != "tensorflow":
            return lambda x, y: float(model.train_on_batch(x, y))
        import tensorflow as tf

        loss, optimizer, variables = model.loss, model.optimizer, model.trainable_variables
        optimizer.build(variables)

        @tf.function(autograph=False, jit_compile=True)
        def update(x, y):
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            optimizer.apply(tape.gradient(value, variables), variables)
            return value

        return lambda x, y: float(update(x, y))

    def step_seconds(self, loss: str, batch: int, updates: int = 10) -> float:
        """The median wall-clock seconds of one update of ``loss`` at ``batch``, over
        ``updates`` updates after 3 that trace and warm up; its knobs at their ranges'
        middle (the ``seconds`` budget's timing)."""
        import keras

        params = grid_settings(loss, 2, 1)[0]
        spec = RunSpec(loss, tuple(sorted(params.items())), batch, updates + 3, 0, False)
        keras.backend.clear_session()
        update = self.step(self._model(spec))
        x, y = self.train[0], self.train_labels
        times = []
        batches = m_per_class_rows(y, batch, self.m, 0).take(updates + 3)
        for rows in batches.as_numpy_iterator():
            started = time.perf_counter()
            update(x[rows], y[rows])
            times.append(time.perf_counter() - started)
        return float(np.median(times[3:]))

    def __call__(self, spec: RunSpec) -> dict:
        import keras

        started = time.time()
        keras.backend.clear_session()
        model = self._model(spec)
        update = self.step(model)
        embed = functools.partial(model, training=False)
        x, y = self.train[0], self.train_labels
        marks = sorted({max(1, round(spec.updates * k / self.curve_points))
                        for k in range(1, self.curve_points + 1)})
        row = {"status": "ok", "curve": []}
        last = float("nan")
        batches = m_per_class_rows(y, spec.batch, self.m, spec.seed).take(spec.updates)
        for step, rows in enumerate(batches.as_numpy_iterator(), start=1):
            last = update(x[rows], y[rows])
            if not math.isfinite(last):
                row.update(status="non-finite", detail=f"loss {last} at update {step}")
                break
            # the curve: for the evaluation seeds (the tuning only needs the end)
            if spec.test and step in marks and step != spec.updates:
                row["curve"].append([step * spec.batch, score(embed, *self.curve_val)[0]])
        row["final_loss"] = last
        if row["status"] == "ok":
            if spec.test:
                row["curve"].append([spec.updates * spec.batch,
                                     score(embed, *self.curve_val)[0]])
            val, val_r1, cos = score(embed, *self.val)
            row.update({"val_map@r": val, "val_r@1": val_r1, "emb_cos": cos})
            if self.folds:  # keys as strings: the ledger's rows go through JSON
                row["val_folds"] = {str(i): score(embed, *fold)[0]
                                    for i, fold in enumerate(self.folds)}
            # A collapse ranks at chance; a narrow cone alone (mean cosine near 1,
            # seen with proxy and histogram losses) can still rank well.
            if cos > 0.95 and val < 10.0:
                row["status"] = "collapsed"
            if spec.test:
                test, test_r1, _ = score(embed, *self.test)
                row.update({"test_map@r": test, "test_r@1": test_r1})
        row["seconds"] = round(time.time() - started, 2)
        return row
