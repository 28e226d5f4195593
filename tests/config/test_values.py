"""Config values that parse but make no sense are refused with the key and the range.

A class of inputs, not one example: huge integers (as digits, as floats, through
``--set`` and in a file), floats where an integer is meant, zero and negative sizes,
non-finite numbers, and loss arguments the loss class itself refuses.
"""

from __future__ import annotations

import re

import pytest
import yaml

from tfaploss.config import ConfigError, config_from_dict, load_config
from tfaploss.config.fields import MAX_BATCH, MAX_SEED, Range

MINIMAL = {"loss": {"name": "APLoss"}}


def _nested(key: str, value) -> dict:
    raw: dict = {}
    node = raw
    *sections, last = key.split(".")
    for section in sections:
        node = node.setdefault(section, {})
    node[last] = value
    return raw


def _refusal(raw: dict, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict({**MINIMAL, **raw}, list(overrides), warn=False)
    return str(info.value)


# (key, value, the allowed range shown) for values that parse and are out of range.
OUT_OF_RANGE = [
    ("training.epochs", 1e26, "[1, 1000000]"),
    ("training.epochs", 0, "[1, 1000000]"),
    ("training.epochs", -3, "[1, 1000000]"),
    ("training.steps_per_epoch", 0, "[1, 1000000000]"),
    ("training.chunk_size", 0, f"[1, {MAX_BATCH}]"),
    ("training.chunk_size", MAX_BATCH + 1, f"[1, {MAX_BATCH}]"),
    ("training.seed", -1, f"[0, {MAX_SEED}]"),
    ("training.seed", 2 ** 40, f"[0, {MAX_SEED}]"),
    ("training.xbm.size", -5, "[0, 16777216]"),
    ("data.batch_size", 0, f"[1, {MAX_BATCH}]"),
    ("data.batch_size", 2 ** 21, f"[1, {MAX_BATCH}]"),
    ("data.batch_size", -128, f"[1, {MAX_BATCH}]"),
    ("data.m", 0, f"[1, {MAX_BATCH}]"),
    ("data.image_size", 0, "[8, 8192]"),
    ("data.image_size", 10 ** 6, "[8, 8192]"),
    ("data.test_image_size", 4, "[8, 8192]"),
    ("data.seed", -7, f"[0, {MAX_SEED}]"),
    ("model.embedding_dim", 0, "[1, 65536]"),
    ("model.embedding_dim", 10 ** 9, "[1, 65536]"),
    ("model.head_lr_multiplier", 0.0, "(0, 10000]"),
    ("model.precise_bn_images", -1, "[0, 16777216]"),
    ("optimizer.lr", 0.0, "(0, 100]"),
    ("optimizer.lr", -1e-3, "(0, 100]"),
    ("optimizer.lr", 1e300, "(0, 100]"),
    ("optimizer.weight_decay", -0.1, "[0, 10]"),
    ("evaluation.every_n_epochs", -1, "[0, 1000000]"),
    ("evaluation.max_images", 1, "[2, 2147483647]"),
]


@pytest.mark.parametrize("key, value, allowed", OUT_OF_RANGE)
def test_out_of_range_values_name_key_range_and_value(key, value, allowed):
    message = _refusal(_nested(key, value))
    assert f"config key '{key}'" in message and f"must be in {allowed}" in message
    assert repr(int(value) if key.endswith(("epochs", "size")) and isinstance(value, float)
                else value) in message


@pytest.mark.parametrize("key, value, allowed", OUT_OF_RANGE[:6])
def test_the_same_values_are_refused_in_a_yaml_file(tmp_path, key, value, allowed):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, **_nested(key, value)}))
    with pytest.raises(ConfigError, match=re.escape(f"must be in {allowed}")):
        load_config(path, warn=False)


def test_list_items_are_checked_each_with_its_index():
    message = _refusal({"evaluation": {"ks": [1, 10, 0]}})
    assert "'evaluation.ks[2]'" in message and "received 0" in message
    message = _refusal({"optimizer": {"schedule": {"name": "step", "step_epochs": [0, 2],
                                                   "gamma": 0.1}}})
    assert "'optimizer.schedule.step_epochs[0]'" in message


@pytest.mark.parametrize("digits", [31, 400, 5000, 100_000])
@pytest.mark.parametrize("key", ["training.epochs", "training.seed", "loss.num_bins"])
def test_integers_of_many_digits_are_refused_not_crashed(key, digits, tmp_path):
    text = "9" * digits
    with pytest.raises(ConfigError, match=f"integer of {digits} digits"):
        config_from_dict(MINIMAL, [f"{key}={text}"], warn=False)
    path = tmp_path / "run.yaml"
    section, name = key.split(".")
    extra = "  name: APLoss\n" if section == "loss" else ""
    path.write_text(f"loss: {{name: APLoss}}\n{section}:\n{extra}  {name}: {text}\n"
                    if section != "loss" else f"loss:\n{extra}  {name}: {text}\n")
    with pytest.raises(ConfigError, match=f"integer of {digits} digits"):
        load_config(path, warn=False)


@pytest.mark.parametrize("spelling", ["1_000", "0x1F", "-0b1", "+12"])
def test_ordinary_yaml_integers_still_load(spelling):
    cfg = config_from_dict(MINIMAL, [f"evaluation.every_n_epochs={spelling}"], warn=False) \
        if not spelling.startswith("-") else None
    if cfg is not None:
        assert cfg.evaluation.every_n_epochs == int(spelling.replace("_", ""), 0)
    else:
        with pytest.raises(ConfigError, match="must be in"):
            config_from_dict(MINIMAL, [f"evaluation.every_n_epochs={spelling}"], warn=False)


@pytest.mark.parametrize("key, value", [
    ("loss.num_bins", 2.5), ("training.epochs", 3.5), ("data.batch_size", 127.9),
    ("evaluation.ks", [1, 2.5]),
])
def test_a_fraction_where_an_integer_is_meant_is_refused_not_truncated(key, value):
    raw = {"loss": {"name": "APLoss", "num_bins": value}} if key == "loss.num_bins" \
        else _nested(key, value)
    message = _refusal(raw)
    assert "an integer" in message and repr(2.5 if key == "evaluation.ks" else value) in message


def test_a_whole_float_where_an_integer_is_meant_is_that_integer():
    cfg = config_from_dict({"loss": {"name": "FastAPLoss", "num_bins": 12.0},
                            "training": {"epochs": 3.0}}, warn=False)
    assert cfg.loss.kwargs["num_bins"] == 12 and isinstance(cfg.loss.kwargs["num_bins"], int)
    assert cfg.training.epochs == 3 and isinstance(cfg.training.epochs, int)


@pytest.mark.parametrize("key", ["optimizer.lr", "optimizer.weight_decay",
                                 "model.head_lr_multiplier", "loss.temperature"])
@pytest.mark.parametrize("spelling", [".nan", ".inf", "-.inf", ".NaN"])
def test_non_finite_numbers_are_refused(key, spelling):
    overrides = [f"{key}={spelling}"]
    raw = {"loss": {"name": "SmoothAPLoss"}} if key.startswith("loss.") else MINIMAL
    with pytest.raises(ConfigError, match=re.escape(f"'{key}'") + ".*finite"):
        config_from_dict(raw, overrides, warn=False)


@pytest.mark.parametrize("loss, key, value, words", [
    ("APLoss", "num_bins", 0, "[2, 4096]"),
    ("APLoss", "num_bins", 1, "[2, 4096]"),
    ("FastAPLoss", "num_bins", 10 ** 7, "[2, 4096]"),
    ("SmoothAPLoss", "temperature", 0.0, "temperature must be a number > 0"),
    ("SmoothAPLoss", "temperature", -0.01, "temperature must be a number > 0"),
    ("PNPLoss", "variant", "Dx", "variant must be one of"),
])
def test_loss_arguments_the_loss_refuses_are_config_errors(loss, key, value, words):
    message = _refusal({"loss": {"name": loss, key: value}})
    assert f"config key 'loss.{key}'" in message and words in message


def test_in_range_values_still_load():
    cfg = config_from_dict({**MINIMAL, "data": {"batch_size": MAX_BATCH, "m": 4},
                            "training": {"epochs": 1_000_000, "seed": MAX_SEED,
                                         "chunk_size": 512},
                            "optimizer": {"lr": 100.0}}, warn=False)
    assert (cfg.data.batch_size, cfg.training.epochs, cfg.optimizer.lr) == \
        (MAX_BATCH, 1_000_000, 100.0)


@pytest.mark.parametrize("rng, inside, outside", [
    (Range(1, 10), [1, 10, 5.5], [0, 11, 0.999]),
    (Range(0, 1, low_open=True), [1e-9, 1], [0, -1, 1.0001]),
    (Range(None, 0), [-1e300, 0], [1e-300]),
])
def test_range_bounds_are_inclusive_unless_open(rng, inside, outside):
    for value in inside:
        rng.check(value, "k")
    for value in outside:
        with pytest.raises(ConfigError, match=re.escape(str(rng))):
            rng.check(value, "k")


def test_the_config_command_refuses_with_exit_2_and_no_traceback(tmp_path, capsys):
    from tfaploss.cli import main

    path = tmp_path / "run.yaml"
    path.write_text("loss: {name: APLoss}\ntraining: {epochs: 1.0e+26}\n")
    assert main(["config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "training.epochs" in err and "[1, 1000000]" in err and "Traceback" not in err


@pytest.mark.parametrize("loss, key, value", [("SupRecallLoss", "at_k", [10]),
                                              ("SupRecallLoss", "at_k", [1, 5, 10, 20, 50, 100]),
                                              ("RecallAtKLoss", "k", [1, 4])])
def test_recall_cut_offs_take_any_number_of_values(loss, key, value):
    """The authors' SupRecall@10 config lists one cut-off where the default lists five."""
    cfg = config_from_dict({"loss": {"name": loss, key: value}}, warn=False)
    assert cfg.loss.kwargs[key] == tuple(value)


@pytest.mark.parametrize("value, words", [([], "non-empty list"), ([1.5], r"at_k\[0\]"),
                                          ("ten", "non-empty list"), ([1, "x"], r"at_k\[1\]")])
def test_recall_cut_offs_are_still_checked(value, words):
    with pytest.raises(ConfigError, match=words):
        config_from_dict({"loss": {"name": "SupRecallLoss", "at_k": value}}, warn=False)
