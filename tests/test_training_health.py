"""Batch health (issue 14, item 1): the metrics' values, the warning on a constructed
collapse or flat loss (plain fit, MultiStageModel, held batch, `tfaploss train`), and
silence on a healthy run."""

import json
import warnings

import keras
import numpy as np
import pytest

from tests import miniature as mini
from tfaploss.losses import SupAPLoss
from tfaploss.training import (
    BatchHealthMetric,
    MultiStageModel,
    TrainingHealthMonitor,
    TrainingHealthWarning,
    batch_health,
    health_metrics,
)
from tfaploss.training.health import random_ranking_ap

LABELS = np.repeat(np.arange(4), 4).astype("int32")


def _values(embeddings, labels=LABELS, **kw):
    return {k: float(v) for k, v in batch_health(np.asarray(embeddings, "float32"),
                                                 labels, **kw).items()}


def test_random_ranking_ap_by_hand_and_by_sampling():
    # N=3, P=1: the positive is at rank 1, 2 or 3: (1 + 1/2 + 1/3) / 3.
    assert float(random_ranking_ap(3, 1)) == pytest.approx(11 / 18, rel=1e-6)
    assert float(random_ranking_ap(2, 2)) == pytest.approx(1.0)  # every ranking is perfect
    rng = np.random.default_rng(0)
    rel = np.zeros((40000, 15))
    rel[:, :4] = 1
    rel = rng.permuted(rel, axis=1)
    ap = np.sum(rel * np.cumsum(rel, 1) / np.arange(1, 16), 1) / 4
    assert float(random_ranking_ap(15, 4)) == pytest.approx(ap.mean(), abs=3e-3)


def test_identical_embeddings_are_collapsed_and_all_at_chance():
    v = _values(np.tile([[0.3, -1.0, 2.0]], (16, 1)))
    assert v["cos_mean"] == pytest.approx(1.0, abs=1e-6)
    assert v["cos_std"] == pytest.approx(0.0, abs=1e-3)
    assert v["chance_ap"] == 1.0  # ties count against the query


def test_separated_classes_have_no_query_at_chance_and_cosines_by_hand():
    e = np.eye(4)[LABELS]  # each class on its own axis: cos 1 within, 0 across
    v = _values(e)
    assert v["chance_ap"] == 0.0
    # 16 x 15 ordered pairs, of which 16 x 3 are same-class (cos 1), the rest 0.
    mean = 48 / 240
    assert v["cos_mean"] == pytest.approx(mean, abs=1e-6)
    assert v["cos_std"] == pytest.approx(np.sqrt(mean - mean ** 2), abs=1e-5)


def test_chance_fraction_by_hand_and_max_queries():
    # Unit vectors at these angles; labels 0, 0, 1, 1. Queries 0 and 1 (angles 0 and
    # pi) are each other's only positive and each other's farthest image: rank 3 of 3,
    # AP 1/3 <= E[AP] = 11/18, at chance. Queries 2 and 3 are each other's nearest: AP 1.
    angles = np.array([0.0, np.pi, 0.5, 0.6])
    e = np.stack([np.cos(angles), np.sin(angles)], 1)
    labels = np.array([0, 0, 1, 1], "int32")
    assert _values(e, labels)["chance_ap"] == pytest.approx(0.5)
    assert _values(e, labels, max_queries=2)["chance_ap"] == pytest.approx(1.0)


def _constant_model(dim=8):
    """Every input -> the same embedding: a collapse by construction."""
    inputs = keras.Input((4,))
    x = keras.layers.Dense(dim, kernel_initializer="zeros", bias_initializer="ones")(inputs)
    return keras.Model(inputs, keras.layers.UnitNormalization()(x))


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(n // 4), 4).astype("int32")
    centres = rng.normal(size=(n // 4, 4))
    return (centres[labels] + 0.3 * rng.normal(size=(n, 4))).astype("float32"), labels


def _fit(model, monitor, epochs=1, metrics=True, lr=0.0, x=None, y=None):
    if x is None:
        x, y = _data()
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=SupAPLoss(),
                  metrics=health_metrics() if metrics else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                            callbacks=[monitor])
    health = [w for w in caught if issubclass(w.category, TrainingHealthWarning)]
    return history, [str(w.message) for w in health]


def test_collapse_warning_fires_in_plain_fit_and_names_the_causes():
    monitor = TrainingHealthMonitor(patience=3, flat_steps=0)
    history, messages = _fit(_constant_model(), monitor, epochs=2)
    assert len(messages) == 1, messages  # once, not every step
    text = messages[0]
    assert "collapsed" in text and "learning rate" in text
    assert "near-collinear start" in text and "lambda_" in text
    assert [e[:2] for e in monitor.events] == [(3, "collapse")]
    # The metrics reach the logs (progress bar, TensorBoard, epochs.jsonl).
    assert history.history["emb_cos"][0] == pytest.approx(1.0, abs=1e-5)
    assert history.history["chance_ap"][0] == 1.0


def test_collapse_warning_fires_for_multistage_model():
    monitor = TrainingHealthMonitor(patience=2, flat_steps=0)
    trainer = MultiStageModel(_constant_model(), chunk_size=5)
    history, messages = _fit(trainer, monitor)
    assert len(messages) == 1 and "collapsed" in messages[0]
    assert history.history["emb_cos"][0] == pytest.approx(1.0, abs=1e-5)


def test_collapse_warning_from_a_held_batch_without_compiled_metrics():
    x, y = _data()
    monitor = TrainingHealthMonitor(patience=4, flat_steps=0, data=(x[:16], y[:16]),
                                    every=2)
    _, messages = _fit(_constant_model(), monitor, metrics=False)
    assert len(messages) == 1 and "collapsed" in messages[0]


def test_flat_loss_warning_and_stop():
    # A cosine threshold of 1 turns the collapse check off: only the loss speaks.
    monitor = TrainingHealthMonitor(collapse_cosine=1.0, flat_steps=3, action="stop")
    history, messages = _fit(_constant_model(), monitor, epochs=3)
    assert len(messages) == 1 and "has not moved for 3 steps" in messages[0]
    assert "learning rate" in messages[0]
    assert len(history.history["loss"]) == 1  # action="stop" ended training in epoch 1


def _healthy_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.UnitNormalization()(keras.layers.Dense(8)(inputs)))


def test_healthy_run_stays_silent():
    monitor = TrainingHealthMonitor(patience=2, flat_steps=3)
    history, messages = _fit(_healthy_model(), monitor, epochs=4, lr=0.05)
    assert messages == [] and monitor.events == []
    cos = history.history["emb_cos"]
    assert max(cos) < 0.99
    assert history.history["chance_ap"][-1] < 0.5


def test_flat_check_follows_the_per_step_loss_through_running_means():
    """The monitor recovers each step's loss from Keras's running mean."""

    def feed(losses_per_epoch, **kw):
        monitor = TrainingHealthMonitor(collapse_cosine=1.0, **kw)
        monitor.set_model(_healthy_model())
        monitor.on_train_begin()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for epoch, losses in enumerate(losses_per_epoch):
                monitor.on_epoch_begin(epoch)
                for k, _ in enumerate(losses):
                    monitor.on_train_batch_end(k, {"loss": np.mean(losses[:k + 1])})
        return [kind for _, kind, _ in monitor.events]

    # A loss that falls then sits at one value: the running mean keeps falling, yet
    # the steps are flat from step 6 on.
    assert feed([[0.9, 0.8, 0.7, 0.69, 0.6852] + [0.6851] * 6], flat_steps=5) == ["flat"]
    # A plateau with batch-to-batch noise (1%) is a learning model: silent.
    rng = np.random.default_rng(0)
    noisy = list(0.685 + 0.007 * rng.standard_normal(40))
    assert feed([noisy[:20], noisy[20:]], flat_steps=5) == []
    # The window runs across epochs.
    assert feed([[0.5] * 3, [0.5] * 3], flat_steps=5) == ["flat"]
    # A loss at its minimum, 0, has converged: silent.
    assert feed([[0.2, 0.05] + [0.0] * 8], flat_steps=5) == []


def test_non_finite_health_is_not_called_a_collapse():
    monitor = TrainingHealthMonitor(patience=1, flat_steps=0)
    monitor.on_train_begin()
    monitor._check_collapse(float("nan"), float("nan"), 1.0)
    assert monitor.events == []
    with pytest.warns(TrainingHealthWarning):
        monitor._check_collapse(0.999, 0.0, 1.0)


def test_monitor_arguments_are_checked():
    with pytest.raises(ValueError, match="patience must be an int >= 0, received patience=-1"):
        TrainingHealthMonitor(patience=-1)
    with pytest.raises(ValueError, match="action must be 'warn' or 'stop'"):
        TrainingHealthMonitor(action="raise")
    with pytest.raises(ValueError, match="max_queries must be an int >= 2"):
        health_metrics(max_queries=1)
    with pytest.raises(ValueError, match="statistic must be one of"):
        BatchHealthMetric("cosine")


def test_tfaploss_train_logs_health_and_warns_on_collapse(tmp_path, monkeypatch):
    """`tfaploss train` compiles the metrics and runs the monitor: flat grey images
    embed to one point, and the run says so."""
    from PIL import Image

    from tfaploss.config.schema import config_from_dict
    from tfaploss.config.trainer import train
    from tfaploss.training import health

    split = tmp_path / "train"
    mini.write_split_records(str(split), {0: 4, 1: 4},
                             image_fn=lambda label, size: Image.new("RGB", size, (90,) * 3))
    cfg = config_from_dict({
        "run_dir": str(tmp_path / "run"),
        "data": {"train": str(split), "batch_size": 8, "m": 4, "image_size": 16,
                 "augmentation": {"crop": "center_crop"}},
        "model": {"backbone": "small_cnn", "embedding_dim": 8, "weights": None,
                  "bn_calibration_images": 0},
        "loss": {"name": "SupAPLoss"},
        "training": {"epochs": 1, "steps_per_epoch": 3, "chunk_size": 4},
        "evaluation": {"at_end": False, "every_n_epochs": 0},
    }, warn=False)
    # The recipe's patience (200 steps) is longer than this run: shorten it.
    defaults = list(health.TrainingHealthMonitor.__init__.__defaults__)
    defaults[0] = 2
    monkeypatch.setattr(health.TrainingHealthMonitor.__init__, "__defaults__", tuple(defaults))
    with pytest.warns(TrainingHealthWarning, match="embeddings have collapsed"):
        train(cfg, verbose=0)
    row = json.loads((tmp_path / "run" / "epochs.jsonl").read_text().splitlines()[0])
    assert row["emb_cos"] == pytest.approx(1.0, abs=1e-4)
    assert row["chance_ap"] == 1.0
