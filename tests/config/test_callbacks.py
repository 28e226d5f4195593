"""``training.callbacks``: the user's callbacks by import path, checked at load time."""

import keras
import pytest

from tfaploss.config import ConfigError, config_from_dict
from tfaploss.config.callbacks import build_callback


def _cfg(callbacks):
    return config_from_dict({"training": {"callbacks": callbacks}}, warn=False)


def test_paths_with_and_without_arguments_load_and_build():
    entries = ["keras.callbacks.TerminateOnNaN",
               {"class": "keras.callbacks.EarlyStopping",
                "kwargs": {"monitor": "val_map@r", "mode": "max", "patience": 3}}]
    cfg = _cfg(entries)
    assert cfg.training.callbacks == entries
    assert cfg.to_dict()["training"]["callbacks"] == entries  # round-trips
    built = [build_callback(e, f"training.callbacks[{i}]") for i, e in enumerate(entries)]
    assert isinstance(built[0], keras.callbacks.TerminateOnNaN)
    assert built[1].monitor == "val_map@r" and built[1].patience == 3
    assert _cfg([]).training.callbacks == []


@pytest.mark.parametrize("entry, says", [
    ("no_such_module_xyz.Callback",
     "'training.callbacks[0]': 'no_such_module_xyz.Callback' cannot be imported"),
    ("keras.callbacks.NoSuchCallback",
     "'training.callbacks[0]': 'keras.callbacks.NoSuchCallback' not found"),
    ("EarlyStopping", "'training.callbacks[0]': 'EarlyStopping' is not an import path"),
    ({"class": "keras.callbacks.EarlyStopping", "kwargs": {"patiense": 3}},
     "'training.callbacks[0].kwargs': keras.callbacks.EarlyStopping does not take"),
    ({"klass": "keras.callbacks.EarlyStopping"}, "'training.callbacks[0]': a callback is"),
    ("keras.layers.Dense", "is not a keras.callbacks.Callback subclass"),
    (3, "'training.callbacks[0]': expected"),
])
def test_bad_entries_name_the_key_and_value(entry, says):
    with pytest.raises(ConfigError) as err:
        _cfg([entry])
    assert says in str(err.value)
