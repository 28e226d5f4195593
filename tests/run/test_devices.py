"""``training.distribute``: the devices of a ``tfaploss train`` run.

The TensorFlow test process has several logical CPU devices (tests/conftest.py,
tests/distribute/test_tf.py), so the data-parallel path runs here on CPU devices: a
run over 2 devices ranks the global batch and trains exactly like one device.
"""

import json

import keras
import numpy as np
import pytest

from tfaploss.config import ConfigError, config_from_dict
from tfaploss.run.devices import plan_devices
from tfaploss.run.trainer import initial_model, train


def _cfg(root=None, **distribute):
    raw = {"data": {"batch_size": 8, "m": 2, "image_size": 16},
           "training": {"distribute": distribute}}
    if root is not None:
        raw = {
            "run_dir": str(root / f"run_{distribute.get('strategy', 'auto')}"),
            "data": {"train": str(root / "records" / "train"), "sampler": "m_per_class",
                     "batch_size": 8, "m": 2, "image_size": 16},
            # frozen BatchNorm: live statistics would be per device
            "model": {"backbone": "small_cnn", "pooling": "gem", "embedding_dim": 8,
                      "weights": None, "freeze_bn": True, "bn_calibration_images": 8},
            "loss": {"name": "APLoss"},
            "optimizer": {"name": "sgd", "lr": 0.5},
            "training": {"epochs": 1, "steps_per_epoch": 3, "distribute": distribute},
            "evaluation": {"at_end": False},
        }
    return config_from_dict(raw, warn=False)


def test_one_device_unless_asked_or_several_gpus():
    for distribute in ({}, {"strategy": "auto"}, {"strategy": "none", "devices": 2}):
        plan = plan_devices(_cfg(**distribute))
        assert plan.strategy == "none" and len(plan.devices) == 1
        assert plan.describe().startswith("one device")


def test_data_parallel_splits_the_global_batch():
    plan = plan_devices(_cfg(strategy="data_parallel", devices=2))
    assert plan.strategy == "data_parallel" and len(plan.devices) == 2
    assert (plan.global_batch, plan.per_device_batch) == (8, 4)
    assert "2 devices" in plan.describe() and "global batch 8, 4 per device" in plan.describe()


@pytest.mark.parametrize("distribute,batch,key", [
    ({"strategy": "data_parallel", "devices": 64}, 8, "training.distribute.devices"),
    ({"strategy": "data_parallel", "devices": 2}, 9, "data.batch_size"),
])
def test_impossible_plans_name_the_key(distribute, batch, key):
    cfg = _cfg(**distribute)
    cfg.data.batch_size = batch
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        plan_devices(cfg)


@pytest.mark.parametrize("bad", [{"strategy": "mirrored"}, {"devices": 0},
                                 {"strategy": "data_parallel", "device": 2}])
def test_bad_distribute_keys_are_refused(bad):
    with pytest.raises(ConfigError, match="training.distribute"):
        _cfg(**bad)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from PIL import Image

    from tfaploss.pipelines import folder

    root = tmp_path_factory.mktemp("devices")
    rng = np.random.default_rng(0)
    for k in range(5):
        (root / "pngs" / f"c{k}").mkdir(parents=True)
        for i in range(6):
            img = rng.integers(0, 60, (16, 16, 3), dtype=np.uint8)
            img[2 + 3 * k:6 + 3 * k, 2:10] = 230
            Image.fromarray(img).save(root / "pngs" / f"c{k}" / f"{i}.png")
    folder.run(["--input_dir", str(root / "pngs"), "--output_dir", str(root / "records"),
                "--test_classes", "c4", "--direct_running_mode", "in_memory",
                "--direct_num_workers", "1"])
    return root


class _OwnKeys:
    """A MirroredStrategy whose collectives use keys of their own: every
    MirroredStrategy numbers its collective instances from the same base, and another
    test's 2-replica strategy in this process would meet these collectives under the
    same keys with other shapes (TensorFlow's own tests offset the base this way)."""

    @staticmethod
    def strategy(devices):
        import tensorflow as tf

        class Strategy(tf.distribute.MirroredStrategy):
            _collective_key_base = 3000

        return Strategy(devices)


@pytest.mark.slow
def test_a_run_over_two_devices_trains_and_records_its_devices(records, capsys,
                                                               monkeypatch):
    """The whole ``train`` path under MirroredStrategy: the health metrics (sync-on-read
    variables) and the finite-weights guard read distributed variables, which failed
    before. Equality with one device is pinned in tests/distribute/test_tf.py: the
    training stream differs here (a distributed dataset draws its first batch anew)."""
    monkeypatch.setattr("tfaploss.run.devices.mirrored_strategy", _OwnKeys.strategy)
    cfg = _cfg(records, strategy="data_parallel", devices=2)
    start = initial_model(cfg).get_weights()
    two = train(cfg, verbose=0)
    assert two["distribute"] == {**two["distribute"], "strategy": "data_parallel",
                                 "devices": 2, "global_batch": 8, "per_device_batch": 4}
    assert "on 2 devices" in capsys.readouterr().out
    assert 0.05 < two["final_loss"] < 1.0 and two["updates"] == 3
    trained = keras.saving.load_model(two["model"]).get_weights()
    assert max(float(np.abs(a - b).max()) for a, b in zip(trained, start)) > 1e-3
    log = (records / "run_data_parallel" / "epochs.jsonl").read_text(encoding="utf-8")
    logged = [json.loads(line) for line in log.splitlines()]
    assert len(logged) == 1 and np.isfinite(logged[0]["emb_cos"])
