"""Reading config files: alias bombs, duplicate keys, bad paths and encodings, loss
arguments defaulting to None, and the loss defaults `tfaploss config` prints."""

from __future__ import annotations

import inspect

import pytest
import yaml

from tfaploss.config import (
    ConfigError,
    config_from_dict,
    load_config,
    loss_classes,
    loss_parameters,
)
from tfaploss.config.loss_section import NONE_DEFAULT_LOSS_ARGS
from tfaploss.config.yaml_loader import YAMLLimitError, load_yaml_text


def _bomb(levels: int, width: int) -> str:
    """Billion laughs inside a valid key: each level is a list of `width` aliases of the
    level before (the old loader spent minutes and gigabytes printing it in the error)."""
    items = ["&a0 [lol]"]
    for i in range(1, levels + 1):
        items.append(f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return "description: [" + ",\n  ".join(items) + "]\n"


def _load_error(tmp_path, text: str | bytes, name="bad.yaml") -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message, message
    return message


def test_alias_bomb_is_refused_with_a_clear_message(tmp_path):
    bomb = _bomb(9, 9)  # 9**9 = 387 million strings from 600 bytes
    assert len(bomb.encode()) < 700
    message = _load_error(tmp_path, bomb)
    assert "aliases" in message and "100000" in message and "line" in message
    # a smaller one that old code would have walked in a moment is refused the same way
    assert "aliases" in _load_error(tmp_path, _bomb(6, 9), "small.yaml")
    # --set values go through the same reader
    with pytest.raises(ConfigError, match="aliases"):
        config_from_dict({}, ["description=" + "{a: &a [x, x, x, x, x, x, x, x, x, x], "
                              "b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a], "
                              "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b], "
                              "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c], "
                              "e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d, *d]}"])


def test_aliases_within_bounds_and_merge_keys_still_work():
    data = load_yaml_text("base: &b {lr: 1.0, epochs: 2}\nrun: {<<: *b, lr: 0.5}\n"
                          "ks: &k [1, 10]\nagain: *k\n")
    assert data["run"] == {"lr": 0.5, "epochs": 2} and data["again"] == [1, 10]
    with pytest.raises(YAMLLimitError, match="more than 20 values"):
        load_yaml_text("a: &a [1, 2, 3, 4, 5]\nb: [*a, *a, *a, *a]\n", max_nodes=20)
    assert load_yaml_text("a: &a [1, 2, 3, 4, 5]\nb: [*a, *a, *a, *a]\n", max_nodes=40)


def test_recursive_alias_is_refused(tmp_path):
    assert "recursive alias" in _load_error(tmp_path, "description: &a [1, *a]\n")


def test_duplicate_key_names_the_key_and_both_lines(tmp_path):
    message = _load_error(tmp_path, "loss: {name: APLoss}\noptimizer:\n  lr: 0.001\n"
                                    "  name: adam\n  lr: 0.01\n")
    assert "duplicate key 'lr'" in message and "line 3" in message and "line 5" in message
    message = _load_error(tmp_path, "run_dir: a\ndescription: x\nrun_dir: b\n", "top.yaml")
    assert "duplicate key 'run_dir'" in message and "line 1" in message and "line 3" in message


def test_directory_missing_and_non_utf8_paths(tmp_path):
    folder = tmp_path / "configs_dir"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is a directory") as info:
        load_config(folder)
    assert str(folder) in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    message = _load_error(tmp_path, b"loss: {name: APLoss}\ndescription: caf\xe9\n", "l1.yaml")
    assert "not UTF-8" in message and "0xe9" in message and "line 2" in message


def test_deep_nesting_is_a_config_error(tmp_path):
    message = _load_error(tmp_path, "description: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nested too deeply" in message


# -- loss arguments whose default is None --------------------------------------------------


@pytest.mark.parametrize("key,value,loss", [
    ("pairs_per_block", "hello", "SmoothAPLoss"),
    ("pairs_per_block", 2.5, "PNPLoss"),
    ("pairs_per_block", [4], "ROADMAPLoss"),
    ("seed", "abc", "BlackBoxAPLoss"),
    ("offset", "far", "SupAPLoss"),
])
def test_none_default_loss_args_are_type_checked_at_load(tmp_path, key, value, loss):
    text = yaml.safe_dump({"loss": {"name": loss, key: value}})
    message = _load_error(tmp_path, text)
    assert f"'loss.{key}'" in message


def test_none_default_loss_args_accept_their_type_and_null():
    cfg = config_from_dict({"loss": {"name": "SupAPLoss", "pairs_per_block": 4096,
                                     "offset": 0.25}})
    assert cfg.loss.kwargs == {"pairs_per_block": 4096, "offset": 0.25}
    cfg = config_from_dict({"loss": {"name": "BlackBoxAPLoss", "seed": None}})
    assert cfg.loss.kwargs == {"seed": None}
    with pytest.raises(ConfigError, match="'loss.pairs_per_block': must be at least 1"):
        config_from_dict({"loss": {"name": "SmoothAPLoss", "pairs_per_block": 0}})


def test_every_none_default_loss_arg_has_a_declared_type():
    for name, cls in loss_classes().items():
        for key, param in loss_parameters(cls).items():
            if param.default is None:
                assert key in NONE_DEFAULT_LOSS_ARGS, (name, key)


# -- `tfaploss config` prints the loss defaults ---------------------------------------------


def test_to_dict_fills_in_every_loss_default():
    for name, cls in loss_classes().items():
        cfg = config_from_dict({"loss": {"name": name}})
        printed = cfg.to_dict()["loss"]
        params = loss_parameters(cls)
        expected = {k: p.default for k, p in params.items()
                    if p.default is not inspect.Parameter.empty}
        assert set(printed) == {"name", *expected}, name
        for key, default in expected.items():
            want = list(default) if isinstance(default, tuple) else default
            assert printed[key] == want, (name, key)
        # the filled-in dict reads back to the same config
        assert config_from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    cfg = config_from_dict({"loss": {"name": "ContrastiveLoss", "margin": 0.3}})
    assert cfg.to_dict()["loss"] == {"name": "ContrastiveLoss", "margin": 0.3,
                                     "normalize": True, "include_self": False,
                                     "averaging": "pairs"}
    assert cfg.loss.kwargs == {"margin": 0.3}  # what build_loss passes stays explicit


def test_tfaploss_config_command_prints_the_loss_defaults(tmp_path, capsys):
    from tfaploss.cli import main

    path = tmp_path / "c.yaml"
    path.write_text("loss: {name: ContrastiveLoss}\n", encoding="utf-8")
    assert main(["config", "--config", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["loss"] == {"name": "ContrastiveLoss", "margin": 1.0, "normalize": True,
                               "include_self": False, "averaging": "pairs"}
