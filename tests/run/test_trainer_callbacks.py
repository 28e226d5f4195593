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


def _bars(label, size):
    from PIL import Image

    img = np.random.default_rng(label).integers(0, 60, (size[1], size[0], 3), dtype=np.uint8)
    img[2 + 2 * label:6 + 2 * label, 2:10] = 230
    return Image.fromarray(img)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    # The splits as the Beam jobs lay them out, written directly (seconds faster).
    from tests.support import miniature as mini

    root = tmp_path_factory.mktemp("callbacks")
    mini.write_split_records(str(root / "records" / "train"), {k: 4 for k in range(4)},
                             size=(16, 16), image_fn=_bars)
    mini.write_split_records(str(root / "records" / "test"), {k: 4 for k in (4, 5)},
                             size=(16, 16), image_fn=_bars)
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
