"""Batch health: the metrics' values, the warning on a constructed
collapse or flat loss (plain fit, MultiStageModel, held batch, `tfaploss train`), and
silence on a healthy run. Patience is counted in images, as a share of the run: the
reported runs (100 steps of 920 collapsed from the start; 690 steps of 128 at
>= 0.99 with dips for 400 steps) are replayed step by step, as are healthy runs that
start in a narrow cone and runs with single-step spikes."""

import json
import types
import warnings

import keras
import numpy as np
import pytest

from tests.support import miniature as mini
from tfaploss.losses import SupAPLoss
from tfaploss.training import (
    BatchHealthMetric,
    MultiStageModel,
    TrainingHealthMonitor,
    TrainingHealthWarning,
    batch_health,
    health_metrics,
)
from tfaploss.training.health import COLLAPSE_CAUSES, random_ranking_ap, replay
from tfaploss.training.health.monitor import _find_metrics

pytestmark = pytest.mark.tensorflow  # uses TensorFlow APIs: the TensorFlow run only

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
    # 4 steps of 16 images per epoch, 2 epochs: 128 images. Window: 48 images = 3 steps.
    monitor = TrainingHealthMonitor(min_window_images=48, window_share=0.0, flat_rtol=None)
    model = _constant_model()
    history, messages = _fit(model, monitor, epochs=2)
    assert len(messages) == 1, messages  # once, not every step
    text = messages[0]
    assert "collapsed" in text and "learning rate" in text
    assert "near-collinear start" in text and "lambda_" in text
    assert "emb_cos" in text and "the last 48 training images (3 steps, 38% of the run's 128)" \
        in text
    assert [e[:2] for e in monitor.events] == [(3, "collapse")]
    assert monitor.stopped is None  # action="warn" and no stop_share: never stops
    assert int(model.optimizer.iterations) == 8
    # The metrics reach the logs (progress bar, TensorBoard, epochs.jsonl), with the
    # latest batch's size (what the monitor counts images with).
    assert history.history["emb_cos"][0] == pytest.approx(1.0, abs=1e-5)
    assert history.history["chance_ap"][0] == 1.0
    found = _find_metrics(model)
    assert sorted(found) == ["chance_ap", "emb_cos", "emb_cos_std"]
    assert {float(m.images) for m in found.values()} == {16.0}


def test_collapse_warning_fires_for_multistage_model():
    monitor = TrainingHealthMonitor(min_window_images=32, window_share=0.0, flat_rtol=None)
    trainer = MultiStageModel(_constant_model(), chunk_size=5)
    history, messages = _fit(trainer, monitor)
    assert len(messages) == 1 and "collapsed" in messages[0]
    # A multi-stage step is one whole batch of 16 (not a chunk of 5): 32 images = step 2.
    assert [e[:2] for e in monitor.events] == [(2, "collapse")]
    assert history.history["emb_cos"][0] == pytest.approx(1.0, abs=1e-5)


def test_collapse_warning_from_a_held_batch_without_compiled_metrics():
    x, y = _data()
    # Checked at steps 1, 2, 4: 16 + 2 x 16 + 2 x 16 images; 64 are reached at step 4.
    monitor = TrainingHealthMonitor(min_window_images=64, window_share=0.0, flat_rtol=None,
                                    data=(x[:16], y[:16]), every=2)
    _, messages = _fit(_constant_model(), monitor, metrics=False)
    assert len(messages) == 1 and "collapsed" in messages[0]
    assert [e[:2] for e in monitor.events] == [(4, "collapse")]


def test_flat_loss_warning_and_stop():
    # Compiled without the health metrics: only the loss speaks. Window: 3 steps.
    monitor = TrainingHealthMonitor(min_window_images=48, window_share=0.0, action="stop",
                                    batch_size=16)
    model = _constant_model()
    history, messages = _fit(model, monitor, epochs=3, metrics=False)
    assert len(messages) == 1 and "training stopped" in messages[0]
    assert "has not moved over the last 48 training images (3 steps" in messages[0]
    assert "learning rate" in messages[0]
    assert len(history.history["loss"]) == 1  # action="stop" ended training in epoch 1
    assert int(model.optimizer.iterations) == 3
    assert monitor.stopped["kind"] == "flat" and monitor.stopped["step"] == 3


def test_real_fit_of_a_collapsed_model_is_stopped_at_the_expected_step():
    """model.fit of a model whose output is one constant direction: 20 steps of 16
    images (320). Window max(64, 10 % of 320) = 64 images = 4 steps."""
    x, y = _data(n=320)
    model = _constant_model()
    monitor = TrainingHealthMonitor(min_window_images=64, action="stop")
    _, messages = _fit(model, monitor, x=x, y=y)
    assert int(model.optimizer.iterations) == 4  # the step it stopped at
    assert monitor.stopped["step"] == 4 and monitor.stopped["kind"] == "collapse"
    assert len(messages) == 1 and messages[0].startswith("tfaploss: training stopped")
    # Warn first, stop when it still holds over 25 % of the run (80 images = 5 steps).
    model = _constant_model()
    monitor = TrainingHealthMonitor(min_window_images=64, stop_share=0.25)
    _, messages = _fit(model, monitor, x=x, y=y)
    assert int(model.optimizer.iterations) == 5
    assert [(r["step"], r["kind"], r["stop"]) for r in monitor.records] == [
        (4, "collapse", False), (4, "flat", False), (5, "collapse", True)]
    assert "will be stopped if the collapse, with retrieval at chance, holds over 25% of " \
        "the run" in messages[0]
    assert monitor.stopped["images"] == 80 and monitor.stopped["share_of_run"] == 0.25


def _healthy_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.UnitNormalization()(keras.layers.Dense(8)(inputs)))


def test_healthy_run_stays_silent():
    monitor = TrainingHealthMonitor(min_window_images=32, window_share=0.0, stop_share=0.5)
    history, messages = _fit(_healthy_model(), monitor, epochs=4, lr=0.05)
    assert messages == [] and monitor.events == []
    cos = history.history["emb_cos"]
    assert max(cos) < 0.99
    assert history.history["chance_ap"][-1] < 0.5


# -- replayed runs: per-step (emb_cos, loss, batch size) fed to the callback ------------


def _replay(cosines, batch, losses=None, steps_per_epoch=None, epochs=1, chance=None,
            **kw):
    """Feed the callback a run step by step, as model.fit does (through
    ``health.replay``): the compiled metrics' latest values (emb_cos; chance_ap if
    given) and batch size, the running mean of the loss. Stops where the callback stops
    training. Returns the monitor and the number of steps run."""
    steps_per_epoch = steps_per_epoch or len(cosines) // epochs
    rows = []
    for epoch in range(epochs):
        part = slice(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
        rows.append({"emb_cos": list(cosines[part]), "images": [batch] * steps_per_epoch,
                     "chance_ap": None if chance is None else list(chance[part]),
                     "loss": None if losses is None else list(losses[part])})
    monitor = replay(rows, steps_per_epoch=steps_per_epoch, **kw)
    return monitor, len(monitor.trace)


def _kinds(monitor):
    return [(r["step"], r["kind"], r["stop"]) for r in monitor.records]


def _trained(n, rng, start=0.55, end=0.25):
    """A healthy run's cosines: falling from `start` to `end`, with batch noise."""
    return list(np.linspace(start, end, n) + 0.03 * rng.standard_normal(n))


def _noisy_loss(n, rng, start=0.9, end=0.5):
    return list(np.linspace(start, end, n) + 0.01 * rng.standard_normal(n))


def test_large_batch_run_collapsed_from_the_start_is_reported_at_a_tenth():
    """The report: APLoss, batch 920, 100 steps, every embedding at one point (cosine
    1.0000) and the loss at 0.992 for the whole run. 200 consecutive steps never came."""
    cos, loss = [1.0] * 100, [0.992] * 100
    monitor, steps = _replay(cos, 920, loss)
    assert _kinds(monitor) == [(10, "collapse", False), (10, "flat", False)]
    assert steps == 100 and monitor.stopped is None  # warns only, by default
    text = monitor.records[0]["message"]
    assert "emb_cos" in text and ">= 0.99" in text
    assert "the last 9,200 training images (10 steps, 10% of the run's 92,000)" in text
    assert COLLAPSE_CAUSES in text
    assert monitor.records[0]["share_of_run"] == 0.1
    # tfaploss train's default: warned at 10 %, stopped at 25 % of the run, as every
    # query of a batch at one point ranks at chance (ties count against it).
    monitor, steps = _replay(cos, 920, loss, chance=[1.0] * 100, stop_share=0.25)
    assert steps == 25
    assert _kinds(monitor) == [(10, "collapse", False), (10, "flat", False),
                               (25, "collapse", True)]
    assert monitor.stopped["images"] == 23000 and monitor.stopped["share_of_run"] == 0.25
    text = monitor.stopped["message"]
    assert text.startswith("tfaploss: training stopped: the embeddings have collapsed")
    assert "the last 23,000 training images (25 steps, 25% of the run's 92,000)" in text
    assert "chance_ap" in text and COLLAPSE_CAUSES in text
    # The same cosines with most queries still beating chance (a model learning in a
    # narrow cone, as digits runs at lr 1e-2 did before escaping): warned, not stopped.
    monitor, steps = _replay(cos, 920, loss, chance=[0.2] * 100, stop_share=0.25)
    assert steps == 100 and monitor.stopped is None
    assert _kinds(monitor) == [(10, "collapse", False), (10, "flat", False)]
    assert "most queries still rank better than chance" in monitor.records[0]["message"]


@pytest.mark.parametrize("dips", ["every_7th", "random_15pct"])
def test_long_collapse_with_dips_is_reported_and_stopped(dips):
    """The report: ROADMAP, batch 128, ~690 steps, ~400 of them at mean cosine >= 0.99
    with dips below it (which reset the old consecutive count)."""
    rng = np.random.default_rng(0)
    if dips == "every_7th":
        stretch = [0.985 if i % 7 == 0 else 0.996 for i in range(400)]
    else:
        stretch = list(np.where(rng.random(400) < 0.15, 0.97, 0.997))
    cos = _trained(100, rng, 0.95, 0.9) + stretch + _trained(190, rng, 0.9, 0.6)
    loss = _noisy_loss(690, rng)
    chance = [0.1] * 100 + [0.9] * 400 + [0.1] * 190  # ranking at chance in the stretch
    monitor, steps = _replay(cos, 128, loss, chance=chance, stop_share=0.25)
    # Window: 10 % of 88,320 images = 8,832 = 69 steps, of which >= 80 % (56) collapsed:
    # reported 56 to ~75 steps into the stretch (steps 101-500).
    warned, stopped = monitor.records[0], monitor.stopped
    assert warned["kind"] == "collapse" and not warned["stop"]
    assert 156 <= warned["step"] <= 175, warned["step"]
    # Stopped once it holds over 25 % of the run (173 steps), well inside the stretch.
    assert stopped is not None and stopped["kind"] == "collapse"
    assert 238 <= stopped["step"] <= 300 and steps == stopped["step"]
    # With the queries beating chance in the stretch: warned only.
    monitor, steps = _replay(cos, 128, loss, chance=[0.1] * 690, stop_share=0.25)
    assert [r["kind"] for r in monitor.records] == ["collapse"]
    assert monitor.stopped is None and steps == 690
    # stop_chance_ap=0: the cosine alone stops it.
    monitor, _ = _replay(cos, 128, loss, chance=[0.1] * 690, stop_share=0.25,
                         stop_chance_ap=0.0)
    # (without the dips, which count as a wide cone once the queries rank at chance)
    assert 238 <= monitor.stopped["step"] <= 300 and monitor.stopped["step"] >= stopped["step"]


@pytest.mark.parametrize("steps,batch,cone", [
    (690, 128, 20),  # ROADMAP-sized run, 3 % of it in the cone
    (690, 128, 35),  # 5 %
    (100, 920, 5),   # the large-batch run, 5 % of it in the cone
    (100, 920, 7),   # 7 %
    (150, 96, 17),   # the digits demo: CalibrationLoss lr 1e-3 sat >= 0.99 to step 17
])
def test_healthy_run_starting_in_a_narrow_cone_is_not_reported(steps, batch, cone):
    """A network trained from scratch starts with every embedding in a narrow cone
    (mean cosine 0.9-0.999) and leaves it within a few % of the run."""
    rng = np.random.default_rng(steps + cone)
    cos = list(np.linspace(0.999, 0.991, cone)) + _trained(steps - cone, rng, 0.93, 0.3)
    loss = _noisy_loss(steps, rng)
    monitor, run = _replay(cos, batch, loss, stop_share=0.25)
    assert monitor.events == [] and run == steps
    assert sum(c >= 0.99 for c in cos) >= cone  # the cone really was >= 0.99


def test_a_cone_lasting_most_of_the_window_is_reported():
    """The other side of the previous test: 9 of the large-batch run's first 10 steps
    collapsed is 90 % of its window: warned (not stopped: it left before 25 %)."""
    rng = np.random.default_rng(1)
    cos = [0.999] * 9 + _trained(91, rng, 0.93, 0.3)
    monitor, run = _replay(cos, 920, _noisy_loss(100, rng), stop_share=0.25)
    assert _kinds(monitor) == [(10, "collapse", False)] and run == 100


@pytest.mark.parametrize("period", [2, 4, 10])
def test_single_step_spikes_are_not_reported(period):
    """A healthy run whose cosine jumps to 1 for one step every `period` steps."""
    rng = np.random.default_rng(period)
    cos = [1.0 if k % period == 0 else c for k, c in enumerate(_trained(690, rng))]
    monitor, run = _replay(cos, 128, _noisy_loss(690, rng), stop_share=0.25)
    assert monitor.events == [] and run == 690
    # "Spikes" in 9 steps of 10 are a collapse with dips: reported, then stopped.
    cos = [c if k % 10 == 0 else 1.0 for k, c in enumerate(_trained(690, rng))]
    monitor, _ = _replay(cos, 128, _noisy_loss(690, rng), stop_share=0.25)
    assert [(r["kind"], r["stop"]) for r in monitor.records] == [("collapse", False),
                                                                ("collapse", True)]


def test_windows_follow_the_run_length_and_total_images():
    rng = np.random.default_rng(0)
    # A long run: 10 % of 20 epochs x 500 steps x 64 images = 64,000 images = 1,000 steps.
    cos = [1.0] * 10000
    monitor, _ = _replay(cos, 64, steps_per_epoch=500, epochs=20, flat_rtol=None)
    assert monitor.records[0]["step"] == 1000 and monitor.records[0]["epoch"] == 2
    # A short run: the minimum window (8,192 images = 128 steps of 64) decides.
    monitor, _ = _replay(cos[:400], 64, flat_rtol=None)
    assert monitor.records[0]["step"] == 128
    # A run shorter than the minimum window is judged over the whole run, at its end;
    # there is nothing left to stop, so it is a warning.
    monitor, run = _replay(cos[:30], 64, flat_rtol=None, stop_share=0.25)
    assert _kinds(monitor) == [(30, "collapse", False)] and run == 30
    assert "the last 1,920 training images (30 steps, 100% of the run's 1,920)" in \
        monitor.records[0]["message"]
    healthy, _ = _replay(_trained(30, rng), 64, flat_rtol=None, stop_share=0.25)
    assert healthy.events == []
    # Without Keras's steps (a dataset of unknown length), total_images gives the run.
    monitor = TrainingHealthMonitor(total_images=92000, flat_rtol=None)
    monitor.set_model(types.SimpleNamespace(metrics=[], stop_training=False))
    monitor.on_train_begin()
    monitor._windows = monitor._make_windows(920)
    assert monitor._windows["collapse"].size == 9200


def test_flat_check_follows_the_per_step_loss_through_running_means():
    """The monitor recovers each step's loss from Keras's running mean."""

    def feed(losses_per_epoch, steps=5):
        # No compiled metrics, no Keras params: a window of `steps` steps of 16 images.
        monitor = TrainingHealthMonitor(min_window_images=16 * steps, window_share=0.0,
                                        batch_size=16)
        monitor.set_model(_healthy_model())
        monitor.on_train_begin()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for epoch, losses in enumerate(losses_per_epoch):
                monitor.on_epoch_begin(epoch)
                for k, _ in enumerate(losses):
                    monitor.on_train_batch_end(k, {"loss": np.mean(losses[:k + 1])})
        return [(step, kind) for step, kind, _ in monitor.events]

    # A loss that falls then sits at one value: the running mean keeps falling, yet
    # steps 5-9 (0.6852, then 0.6851) are within 0.1 % of each other.
    assert feed([[0.9, 0.8, 0.7, 0.69, 0.6852] + [0.6851] * 6]) == [(9, "flat")]
    # A plateau with batch-to-batch noise (1%) is a learning model: silent.
    rng = np.random.default_rng(0)
    noisy = list(0.685 + 0.007 * rng.standard_normal(40))
    assert feed([noisy[:20], noisy[20:]]) == []
    # The window runs across epochs.
    assert feed([[0.5] * 3, [0.5] * 3]) == [(5, "flat")]
    # A loss at its minimum, 0, has converged: silent.
    assert feed([[0.2, 0.05] + [0.0] * 8]) == []


def test_non_finite_health_is_not_called_a_collapse():
    monitor, _ = _replay([float("nan")] * 20, 16, min_window_images=32, window_share=0.0)
    assert monitor.events == []  # the non-finite guards report those, not this check
    monitor, _ = _replay([float("nan")] * 10 + [0.999] * 10, 16, min_window_images=32,
                         window_share=0.0)
    assert _kinds(monitor) == [(12, "collapse", False)]


def test_monitor_arguments_are_checked():
    with pytest.raises(ValueError, match="action must be 'warn' or 'stop'"):
        TrainingHealthMonitor(action="raise")
    with pytest.raises(ValueError, match=r"stop_share must be a number in \[0.1, 1\]"):
        TrainingHealthMonitor(stop_share=0.05)
    with pytest.raises(ValueError, match="stop_share is only used with action='warn'"):
        TrainingHealthMonitor(stop_share=0.5, action="stop")
    with pytest.raises(ValueError, match=r"collapse_fraction must be a number in \(0, 1\]"):
        TrainingHealthMonitor(collapse_fraction=0)
    with pytest.raises(ValueError, match="min_window_images must be an int >= 1"):
        TrainingHealthMonitor(min_window_images=0)
    for bad in (0, -0.1, 1.5, True, "0.3"):
        with pytest.raises(ValueError, match=r"stall_chance_ap must be a number in "
                                             rf"\(0, 1\] or None, received "
                                             rf"stall_chance_ap={bad!r}"):
            TrainingHealthMonitor(stall_chance_ap=bad)
    with pytest.raises(ValueError, match=r"stall_after must be a number in \[0, 1\]"):
        TrainingHealthMonitor(stall_after=1.5)
    with pytest.raises(ValueError, match="max_queries must be an int >= 2"):
        health_metrics(max_queries=1)
    with pytest.raises(ValueError, match="statistic must be one of"):
        BatchHealthMetric("cosine")


@pytest.mark.slow
def test_tfaploss_train_stops_a_collapsed_run_and_records_why(tmp_path, capsys):
    """`tfaploss train` compiles the metrics and runs the monitor: flat grey images
    embed to one point; the run is warned about, stopped, and says so in summary.json
    and epochs.jsonl."""
    from PIL import Image

    from tfaploss.config import config_from_dict
    from tfaploss.run.trainer import train

    split = tmp_path / "train"
    mini.write_split_records(str(split), {0: 4, 1: 4},
                             image_fn=lambda label, size: Image.new("RGB", size, (90,) * 3))
    raw = {
        "run_dir": str(tmp_path / "run"),
        "data": {"train": str(split), "batch_size": 8, "m": 4, "image_size": 16,
                 "augmentation": {"crop": "center_crop"}},
        "model": {"backbone": "small_cnn", "embedding_dim": 8, "weights": None,
                  "bn_calibration_images": 0},
        "loss": {"name": "SupAPLoss"},
        # 6 steps of 8 images (48): warned after 16 images (2 steps), stopped when it
        # still holds over half of the run (24 images: step 3).
        "training": {"epochs": 1, "steps_per_epoch": 6, "chunk_size": 4,
                     "health": {"min_window_images": 16, "window_share": 0.25,
                                "stop_share": 0.5}},
        "evaluation": {"at_end": False, "every_n_epochs": 0},
    }
    cfg = config_from_dict(raw, warn=False)
    with pytest.warns(TrainingHealthWarning, match="embeddings have collapsed"):
        summary = train(cfg, verbose=0)
    out = capsys.readouterr().out
    assert "Training stopped by the batch-health check at step 3 of epoch 1" in out
    assert "emb_cos" in out and "Usual causes" in out
    stop = summary["stopped_early"]
    assert (stop["by"], stop["reason"], stop["step"], stop["images"],
            stop["share_of_run"]) == ("batch_health", "collapse", 3, 24, 0.5)
    assert summary["updates"] == 3 and summary["epochs_completed"] == 0
    # The loss of identical embeddings is constant too: flat, reported with the collapse.
    assert [(e["step"], e["kind"], e["stop"]) for e in summary["health_events"]] == [
        (2, "collapse", False), (2, "flat", False), (3, "collapse", True)]
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["stopped_early"] == stop
    row = json.loads((tmp_path / "run" / "epochs.jsonl").read_text().splitlines()[0])
    assert row["emb_cos"] == pytest.approx(1.0, abs=1e-4)
    assert row["chance_ap"] == 1.0
    assert row["stopped_early"]["step"] == 3 and len(row["health"]) == 3
    # Each step the check saw is logged, and replaying the log with the run's health
    # arguments reproduces its reports, step for step.
    steps = row["health_steps"]
    assert steps["images"] == [8, 8, 8]
    assert "health_steps" not in summary["history"][0]  # the summary stays per epoch
    assert np.mean(steps["emb_cos"]) == pytest.approx(row["emb_cos"], abs=1e-6)
    assert np.mean(steps["chance_ap"]) == pytest.approx(row["chance_ap"], abs=1e-6)
    assert np.mean(steps["loss"]) == pytest.approx(row["loss"], rel=1e-5)
    again = replay([row], total_epochs=1, steps_per_epoch=6, stop_share=0.5,
                   **{k: raw["training"]["health"][k]
                      for k in ("min_window_images", "window_share")})
    assert [(e["step"], e["kind"], e["stop"]) for e in again.records] == [
        (e["step"], e["kind"], e["stop"]) for e in summary["health_events"]]
    assert (tmp_path / "run" / "model.keras").is_file()
    assert not (tmp_path / "run" / "backup").exists()
    # The same command again: the stopped run is finished, not trained again ...
    assert train(cfg, verbose=0)["stopped_early"] == stop
    assert "stopped by the batch-health check after 3 updates" in capsys.readouterr().out
    # ... also when its summary was written before training.health existed.
    old = json.loads((tmp_path / "run" / "summary.json").read_text())
    old["config"]["training"].pop("health")
    (tmp_path / "run" / "summary.json").write_text(json.dumps(old))
    default_cfg = config_from_dict({**raw, "training": {
        k: v for k, v in raw["training"].items() if k != "health"}}, warn=False)
    assert train(default_cfg, verbose=0)["stopped_early"] == stop


def test_the_config_defaults_are_the_monitors():
    """``training.health`` (tfaploss.config, which imports no Keras) and the monitor
    read one definition of the thresholds; they must not drift apart. stop_share is
    the one that differs on purpose: the callback only warns unless told,
    ``tfaploss train`` stops."""
    import dataclasses

    from tfaploss.config.health import HealthConfig, HealthThresholds

    monitor = TrainingHealthMonitor().thresholds
    config = HealthConfig()
    assert monitor == HealthThresholds()
    for name in ("collapse_cosine", "collapse_fraction", "window_share",
                 "min_window_images", "stop_chance_ap", "cone_cosine", "cone_chance_ap",
                 "stall_chance_ap", "stall_after"):
        assert getattr(config, name) == getattr(monitor, name), name
    assert monitor.stop_share is None
    assert config.stop_share == 0.25
    assert config.thresholds() == dataclasses.replace(monitor, stop_share=0.25)
    # Every threshold but the callback's flat_rtol is a config key, with its range.
    keys = {f.name for f in dataclasses.fields(HealthConfig)} - {"enabled"}
    assert keys == {f.name for f in dataclasses.fields(HealthThresholds)} - {"flat_rtol"}
    for f in dataclasses.fields(HealthConfig):
        if f.name != "enabled":
            assert f.metadata["range"] is HealthThresholds.__dataclass_fields__[
                f.name].metadata["range"], f.name


def _roadmap_96_updates():
    """ROADMAP at lr 4e-3, B=2048, 96 updates on the glyph sweep: epoch means emb_cos
    0.978 / 0.969 / 0.961 / 0.950 and chance_ap 0.51 / 0.39 / 0.35 / 0.33, trained to
    the end at validation MAP@R 2.3. Per step (not logged): the epoch means with a
    batch-to-batch swing of +-0.05 in chance_ap and +-0.005 in emb_cos."""
    return _sweep_run([(0.978, 0.51), (0.969, 0.39), (0.961, 0.345), (0.950, 0.325)],
                      cos_swing=0.005)


def test_a_slow_stall_in_a_wide_cone_is_stopped_since_the_chance_line_is_025():
    """ROADMAP at 4e-3 with 96 updates stalled in the cone more slowly than at 24: its
    share of queries at chance fell from 39 to 33 % after its first epoch, so half its
    steps were under the old 35 % line and it trained to the end unreported. With the
    line at 25 % (``HealthThresholds.cone_chance_ap``) it is stopped once its first quarter and
    one more window of 80 % qualifying steps have passed; at 35 % it is not."""
    cos, chance = _roadmap_96_updates()
    monitor, steps = _replay(cos, 2048, chance=chance, stop_share=0.25, epochs=4)
    assert monitor.stopped is not None and "stalled in a narrow cone" in monitor.stopped["message"]
    # 24 steps of grace, then 80 % of a 24-step window: stopped at step 44
    assert steps == 44
    monitor, steps = _replay(cos, 2048, chance=chance, stop_share=0.25, epochs=4,
                             cone_chance_ap=0.35)
    assert steps == 96 and monitor.stopped is None
    # A run that learned in the same cosine range never stops, whatever its chance share:
    # on the sweep every such run left emb_cos >= 0.95 within its first epoch.
    learned_cos = [0.97] * 24 + [0.66] * 72
    monitor, steps = _replay(learned_cos, 2048, chance=[0.45] * 96, stop_share=0.25,
                             epochs=4)
    assert steps == 96 and monitor.stopped is None


def test_a_run_stalled_in_a_wide_cone_is_stopped_after_its_first_quarter():
    """The glyph sweep at B=2048 (24 steps): ROADMAP sat at emb_cos 0.96-0.98 with
    38-57 % of queries at chance in every epoch (validation MAP@R 2-4 %), below the
    0.99 collapse line, and nothing was reported. Now: stopped once the cone holds,
    after the first 25 % of the run, over 25 % of it. The runs that learned left the
    cone in their first quarter (emb_cos 0.38-0.87 and 34-57 % at chance in epoch 1,
    <= 0.66 from epoch 2): never stopped."""
    cos = [0.961] * 6 + [0.983] * 6 + [0.972] * 6 + [0.968] * 6
    chance = [0.57] * 6 + [0.47] * 6 + [0.47] * 6 + [0.42] * 6
    monitor, steps = _replay(cos, 2048, chance=chance, stop_share=0.25, epochs=4)
    # the cone counts from step 7 (after 12,288 images): 5 of the 6 steps in the
    # window at step 11 is >= 80 % of it
    assert steps == 11 and monitor.stopped["step"] == 11
    text = monitor.stopped["message"]
    assert "stalled in a narrow cone" in text and ">= 0.95" in text and "25%" in text
    assert "the last 12,288 training images (6 steps, 25% of the run's 49,152)" in text
    # A run that learned: the first epoch in the cone, then out of it.
    learned = [0.97] * 6 + [0.38] * 6 + [0.3] * 12
    learned_chance = [0.57] * 6 + [0.28] * 6 + [0.02] * 12
    monitor, steps = _replay(learned, 2048, chance=learned_chance, stop_share=0.25,
                             epochs=4)
    assert steps == 24 and monitor.stopped is None
    # cone_cosine=None: the old rule does not stop it; only the stall check, which
    # never stops, warns once half the run (12 steps) and a 4-step window have passed.
    monitor, steps = _replay(cos, 2048, chance=chance, stop_share=0.25, epochs=4,
                             cone_cosine=None)
    assert steps == 24 and _kinds(monitor) == [(16, "stall", False)]
    monitor, steps = _replay(cos, 2048, chance=chance, stop_share=0.25, epochs=4,
                             cone_cosine=None, stall_chance_ap=None)
    assert steps == 24 and monitor.records == []


def test_replay_of_a_logged_run_with_other_arguments_and_its_input_errors():
    """A log holds what the check saw, so a rule can be tried on it: a run at emb_cos
    0.97 with 40 % at chance over 4 epochs is stopped with the cone rule and runs to
    its end without it; rows without per-step values are refused, naming the epoch."""
    rows = [{"epoch": e + 1, "health_steps": {
        "images": [512] * 24, "emb_cos": [0.97] * 24, "chance_ap": [0.4] * 24,
        "loss": [0.5 + 0.01 * ((k * 7) % 5) for k in range(24)]}} for e in range(4)]
    stopped = replay(rows, stop_share=0.25)
    # The cone counts after the first quarter (24 steps); in the 25 % window (12,288
    # images = 24 steps), 80 % are cone steps after 20 of them: step 44.
    assert stopped.stopped is not None and stopped.stopped["step"] == 44
    assert "stalled in a narrow cone" in stopped.stopped["message"]
    assert len(stopped.trace) == 44 and stopped.trace[-1]["epoch"] == 2
    free = replay(rows, stop_share=0.25, cone_cosine=None)
    assert free.stopped is None and len(free.trace) == 96
    # Recovered per-step losses are the logged ones.
    assert [t["loss"] for t in free.trace[:24]] == pytest.approx(
        rows[0]["health_steps"]["loss"], abs=1e-12)
    with pytest.raises(ValueError, match=r"epochs\[1\] has no per-step emb_cos"):
        replay([rows[0], {"epoch": 2, "loss": 0.5}])
    with pytest.raises(TypeError, match=r"epochs\[0\] must be a dict.*list"):
        replay([[0.97] * 24])


def _sweep_run(epoch_means, swing=0.05, steps_per_epoch=24, cos_swing=0.0):
    """Per-step (emb_cos, chance_ap) of a glyph-sweep run from its logged epoch means,
    with a batch-to-batch swing of +-``swing`` in chance_ap (clipped to [0, 1]) and
    +-``cos_swing`` in emb_cos, alternating from + at each epoch's first step."""
    cos, chance = [], []
    for c, a in epoch_means:
        cos += [c + cos_swing * (-1) ** k for k in range(steps_per_epoch)]
        chance += [min(max(a + swing * (-1) ** k, 0.0), 1.0) for k in range(steps_per_epoch)]
    return cos, chance


# Epoch means (emb_cos, chance_ap) of 4-epoch glyph-sweep runs at B=2048
# (experiments/batch_sweep/results; validation MAP@R in the name), replayed here as
# runs of 96 steps whatever their own length (24 or 96 updates).
# all-pairs ContrastiveLoss at lr 1.6e-2, 96 updates
SPREAD_AT_CHANCE_3_3 = [(0.27, 0.59), (0.04, 0.53), (0.01, 0.43), (0.00, 0.40)]
# ContrastiveLoss(averaging="per_query") at lr 1.6e-2, 24 updates
WIDE_CONE_0_8 = [(0.84, 0.57), (0.89, 0.54), (0.83, 0.46), (0.80, 0.44)]
# SupRecall and RS@k at lr 1.6e-2 (24 updates), APLoss at 1e-3 (96 updates)
LEARNED_17_2 = [(0.48, 0.62), (0.39, 0.36), (0.24, 0.20), (0.25, 0.14)]
LEARNED_43_9 = [(0.53, 0.54), (0.42, 0.44), (0.25, 0.13), (0.16, 0.04)]
LEARNED_96_6 = [(0.37, 0.19), (0.02, 0.00), (0.01, 0.00), (0.00, 0.00)]


@pytest.mark.parametrize("means", [SPREAD_AT_CHANCE_3_3, WIDE_CONE_0_8],
                         ids=["spread apart", "wide cone"])
def test_a_run_still_at_chance_after_half_of_it_is_warned_whatever_its_cosine(means):
    """Neither the collapse nor the cone rule sees these (emb_cos far under 0.95); each
    kept 40-59 % of its queries at chance and ended at validation MAP@R 3.3 and 0.8 %.
    After half the run (48 steps of 2048) and one window (max(8,192, 10 % of 196,608)
    = 19,661 images: 10 steps), the stall check warns once, and never stops."""
    cos, chance = _sweep_run(means)
    monitor, steps = _replay(cos, 2048, chance=chance, stop_share=0.25, epochs=4)
    assert steps == 96 and monitor.stopped is None
    assert _kinds(monitor) == [(58, "stall", False)]
    record = monitor.records[0]
    text = record["message"]
    assert text.startswith("tfaploss: training is not learning to rank: after the run's "
                           "first 50%, over the last 20,480 training images (10 steps, "
                           "10% of the run's 196,608), 100% of the images")
    assert "at least 30% of queries" in text and "learning rate" in text
    assert "m_per_class" in text and "averaging='per_query'" in text
    assert record["share_of_run"] == pytest.approx(20480 / 196608, abs=1e-4)
    # action="stop" stops at it, as at any report
    monitor, steps = _replay(cos, 2048, chance=chance, epochs=4, action="stop")
    assert steps == 58 and monitor.stopped["kind"] == "stall"


@pytest.mark.parametrize("means", [LEARNED_17_2, LEARNED_43_9, LEARNED_96_6],
                         ids=["SupRecall 17.2", "RS@k 43.9", "APLoss 96.6"])
def test_runs_that_learned_are_not_warned_about_chance(means):
    """The learners of the sweep nearest the line: at chance in 36-62 % of queries in
    their first half, at most 20 % (epoch mean) in their second."""
    cos, chance = _sweep_run(means)
    monitor, steps = _replay(cos, 2048, chance=chance, stop_share=0.25, epochs=4)
    assert steps == 96 and monitor.records == []
    # ... while a line under their second half would have warned the slowest of them
    if means is LEARNED_17_2:
        monitor, _ = _replay(cos, 2048, chance=chance, epochs=4, stall_chance_ap=0.15)
        assert [k for _, k, _ in _kinds(monitor)] == ["stall"]


def test_the_stall_check_judges_only_the_second_half_and_rearms():
    """Chance in the grace is never counted; a run that climbs out clears the warning
    and is warned again if it falls back."""
    n = 200  # steps of 128 images: 25,600 in all; window 8,192 images = 64 steps
    monitor, _ = _replay([0.5] * n, 128, chance=[0.9] * 100 + [0.0] * 100, epochs=4)
    assert monitor.records == []
    # grace 0.5 (100 steps): the window is full at step 164, all of it at chance
    late = [0.0] * 100 + [0.5] * 100
    monitor, _ = _replay([0.5] * n, 128, chance=late, epochs=4)
    assert _kinds(monitor) == [(164, "stall", False)]
    # grace 0.25 (50 steps): steps 51-100 are counted, and fine; 80 % of the window
    # (52 of 64 steps) at chance at step 152
    monitor, _ = _replay([0.5] * n, 128, chance=late, epochs=4, stall_after=0.25)
    assert _kinds(monitor) == [(152, "stall", False)]
    # 300 steps, grace 75: at chance over steps 76-139, out over 140-203, back from 204.
    # Warned at 139; cleared when under 40 % of the window (25 of 64 steps: step 178);
    # warned again when 52 of the last 64 are at chance (step 255).
    chance = [0.0] * 75 + [0.5] * 64 + [0.0] * 64 + [0.5] * 97
    monitor, _ = _replay([0.5] * 300, 128, chance=chance, epochs=4, stall_after=0.25)
    assert _kinds(monitor) == [(139, "stall", False), (255, "stall", False)]
    # no chance_ap metric: nothing to judge
    monitor, _ = _replay([0.5] * n, 128, epochs=4)
    assert monitor.records == []
    # A run whose second half is shorter than a window (40 steps of 128: 5,120 images,
    # 2,560 after the grace) is judged on all of that half, at its last step.
    monitor, _ = _replay([0.5] * 40, 128, chance=[0.0] * 20 + [0.5] * 20, epochs=2)
    assert _kinds(monitor) == [(40, "stall", False)]
    assert "the last 2,560 training images (20 steps, 50% of the run's 5,120)" in \
        monitor.records[0]["message"]
    monitor, _ = _replay([0.5] * 40, 128, chance=[0.5] * 20 + [0.0] * 20, epochs=2)
    assert monitor.records == []


def test_a_collapse_is_reported_once_not_again_as_a_stall():
    """A run collapsed to one point is at chance too; its collapse warning already
    says so."""
    monitor, _ = _replay([0.999] * 200, 128, chance=[1.0] * 200, epochs=4)
    assert [k for _, k, _ in _kinds(monitor)] == ["collapse"]


def test_tfaploss_train_passes_the_stall_settings_to_its_monitor():
    from tfaploss.config import config_from_dict
    from tfaploss.run.trainer import _health_monitor

    raw = {"data": {"train": "unused", "batch_size": 8, "m": 4},
           "model": {"backbone": "small_cnn", "weights": None}}
    monitor = _health_monitor(config_from_dict(raw, warn=False))
    assert (monitor.thresholds.stall_chance_ap, monitor.thresholds.stall_after) == (0.3, 0.5)
    monitor = _health_monitor(config_from_dict(raw, [
        "training.health.stall_chance_ap=0.4", "training.health.stall_after=0.6"],
        warn=False))
    assert (monitor.thresholds.stall_chance_ap, monitor.thresholds.stall_after) == (0.4, 0.6)
    off = _health_monitor(config_from_dict(raw, ["training.health.stall_chance_ap=null"],
                                           warn=False))
    assert off.thresholds.stall_chance_ap is None and "stall" not in off._make_windows(8)
