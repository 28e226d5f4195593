"""``tfaploss train`` and callbacks: the user's (``training.callbacks``), which see the
evaluation's logs, and the share of lone queries in the epoch log."""

import json

import keras
import numpy as np
import pytest

from tfaploss.config import config_from_dict
from tfaploss.run.trainer import train

SEEN = []  # (tag, log keys) of each epoch a Recorder saw


class Recorder(keras.callbacks.Callback):
    """A user's callback, named in the config by its import path."""

    def __init__(self, tag):
        super().__init__()
        self.tag = tag

    def on_epoch_end(self, epoch, logs=None):
        SEEN.append((self.tag, sorted(logs or {})))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from PIL import Image

    from pipelines import folder

    root = tmp_path_factory.mktemp("callbacks")
    rng = np.random.default_rng(0)
    for k in range(6):
        (root / "pngs" / f"c{k}").mkdir(parents=True)
        for i in range(4):
            img = rng.integers(0, 60, (16, 16, 3), dtype=np.uint8)
            img[2 + 2 * k:6 + 2 * k, 2:10] = 230
            Image.fromarray(img).save(root / "pngs" / f"c{k}" / f"{i}.png")
    folder.run(["--input_dir", str(root / "pngs"), "--output_dir", str(root / "records"),
                "--test_classes", "c4,c5", "--direct_running_mode", "in_memory",
                "--direct_num_workers", "1"])
    return root


@pytest.mark.slow
def test_user_callbacks_see_the_evaluation_and_the_log_has_the_lone_share(records):
    SEEN.clear()
    cfg = config_from_dict({
        "run_dir": str(records / "run"),
        "data": {"train": str(records / "records" / "train"),
                 "test": str(records / "records" / "test"), "sampler": "m_per_class",
                 "batch_size": 4, "m": 2, "image_size": 16},
        "model": {"backbone": "small_cnn", "pooling": "gem", "embedding_dim": 8,
                  "weights": None},
        "loss": {"name": "SmoothAPLoss"},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "training": {"epochs": 2, "steps_per_epoch": 2, "callbacks": [
            {"class": "tests.run.test_trainer_callbacks.Recorder", "kwargs": {"tag": "a"}}]},
        "evaluation": {"every_n_epochs": 1, "at_end": False, "ks": [1]},
    }, warn=False)
    train(cfg, verbose=0)
    assert [tag for tag, _ in SEEN] == ["a", "a"]
    assert {"loss", "val_recall@1", "val_map@r"} <= set(SEEN[0][1])
    rows = [json.loads(line) for line in
            (records / "run" / "epochs.jsonl").read_text(encoding="utf-8").splitlines()]
    # m_per_class with m=2: every query has a positive.
    assert [row["lone_query_share"] for row in rows] == [0.0, 0.0]
