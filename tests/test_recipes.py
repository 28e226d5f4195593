"""The shipped recipes: listed by name and description, read through ``recipe:NAME`` by
every ``--config`` (one resolution, in the config loader), printed verbatim by
``tfaploss recipes show``, and an unknown name refused with the known ones listed.
The wheel's copy of them is checked in tests/test_packaging.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from tfaploss.config import ConfigError, ConfigWarning, load_config, read_config_file
from tfaploss.config import recipes as R

REPO = Path(__file__).resolve().parents[1]
FILES = sorted((REPO / "configs").glob("*.yaml"))
NAMES = [p.stem for p in FILES]


def _description(path: Path) -> str:
    return yaml.safe_load(path.read_text(encoding="utf-8"))["description"]


def test_a_clone_reads_its_configs_folder():
    # No tfaploss/recipes/ is built in a clone (setup.py copies it into wheels only).
    assert not R._PACKAGED.exists()
    assert R.recipes_dir() == REPO / "configs"
    assert R.recipe_names() == NAMES and len(NAMES) >= 15


def test_every_recipe_is_listed_with_its_description():
    listed = R.list_recipes()
    assert [r.name for r in listed] == NAMES
    for recipe, path in zip(listed, FILES):
        assert recipe.path == path
        assert recipe.description == _description(path) and len(recipe.description) > 10


@pytest.mark.parametrize("name", NAMES)
def test_recipe_name_loads_the_file_and_validates(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        by_name = load_config(f"recipe:{name}", ["run_dir=runs/elsewhere"])
    assert by_name.to_dict() == load_config(REPO / "configs" / f"{name}.yaml",
                                            ["run_dir=runs/elsewhere"]).to_dict()
    assert by_name.run_dir == "runs/elsewhere"
    assert read_config_file(f"recipe:{name}.yaml") == read_config_file(f"recipe:{name}")


@pytest.mark.parametrize("name", ["nope", "", "../setup", "configs/demo_digits",
                                  "DEMO_DIGITS"])
def test_an_unknown_name_is_one_error_naming_the_known_ones(name):
    with pytest.raises(ConfigError) as info:
        load_config(f"recipe:{name}")
    message = str(info.value)
    assert message.startswith(f"--config recipe:{name}: no recipe named {name.strip()!r}.")
    assert all(known in message for known in NAMES)
    assert "tfaploss recipes" in message


def test_a_path_is_still_a_path_and_a_missing_one_points_to_the_recipes(tmp_path):
    own = tmp_path / "recipe-like.yaml"  # a file whose name merely looks like one
    own.write_text("loss: {name: SmoothAPLoss}\n", encoding="utf-8")
    assert load_config(own).loss.name == "SmoothAPLoss"
    with pytest.raises(ConfigError, match=r"does not exist\. .*recipe:NAME.*tfaploss recipes"):
        load_config(tmp_path / "smoothap_sop_resnet50.yaml")


def test_a_built_package_folder_wins_over_the_clone(tmp_path, monkeypatch):
    packaged = tmp_path / "recipes"
    packaged.mkdir()
    (packaged / "only_one.yaml").write_text(
        "description: the one\nloss: {name: FastAPLoss}\n", encoding="utf-8")
    monkeypatch.setattr(R, "_PACKAGED", packaged)
    assert R.recipe_names() == ["only_one"]
    assert [(r.name, r.description) for r in R.list_recipes()] == [("only_one", "the one")]
    assert load_config("recipe:only_one").loss.name == "FastAPLoss"
    with pytest.raises(ConfigError, match="The recipes are: only_one "):
        load_config("recipe:demo_digits")


def test_no_packaged_folder_and_no_clone_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "_PACKAGED", tmp_path / "recipes")
    monkeypatch.setattr(R, "_CLONE", tmp_path)
    (tmp_path / "configs").mkdir()  # a stray configs/ without setup.py is not a clone
    with pytest.raises(ConfigError, match="no recipes found.*pip wheel"):
        R.recipe_names()


# -- the command ----------------------------------------------------------------------


def test_recipes_command_lists_names_and_descriptions(capsys):
    from tfaploss.cli import main

    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()  # not a terminal: the table alone
    assert [line.split()[0] for line in lines] == NAMES
    for line, path in zip(lines, FILES):
        assert re.fullmatch(rf"{path.stem} +{re.escape(_description(path))}", line), line


@pytest.mark.parametrize("name", NAMES)
def test_recipes_show_prints_the_file_verbatim(name, capsys):
    from tfaploss.cli import main

    assert main(["recipes", "show", name]) == 0
    assert capsys.readouterr().out == (REPO / "configs" / f"{name}.yaml").read_text(
        encoding="utf-8")


def test_recipes_show_of_an_unknown_name_exits_2(capsys):
    from tfaploss.cli import main

    assert main(["recipes", "show", "smoothap"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: no recipe named 'smoothap'. The recipes are: ")
    assert "smoothap_sop_resnet50" in captured.err and "Traceback" not in captured.err


def test_every_config_taking_command_reads_recipe_names(capsys):
    from tfaploss.cli import main

    assert main(["config", "--config", "recipe:pnp_sop_resnet50_dq",
                 "--set", "run_dir=runs/x"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = load_config(REPO / "configs" / "pnp_sop_resnet50_dq.yaml", ["run_dir=runs/x"])
    assert printed == yaml.safe_load(yaml.safe_dump(expected.to_dict()))
    # train and evaluate reach the same loader: an unknown name stops them alike.
    for argv in (["train", "--config", "recipe:nope"], ["evaluate", "--config", "recipe:nope"]):
        assert main(argv) == 2
        assert capsys.readouterr().err.startswith("error: --config recipe:nope: no recipe")


# -- what the docs and recipes say ----------------------------------------------------


def _texts():
    yield from FILES
    yield REPO / "README.md"
    yield from sorted((REPO / "docs").rglob("*.md"))
    yield from sorted((REPO / "tfaploss").rglob("*.py"))


def test_every_recipe_name_the_docs_use_exists():
    used = {}
    for path in _texts():
        for name in re.findall(r"recipe:([a-z0-9_]+)", path.read_text(encoding="utf-8")):
            used.setdefault(name, path.relative_to(REPO))
    assert used, "no recipe:NAME example anywhere"
    unknown = {name: str(where) for name, where in used.items() if name not in NAMES}
    assert not unknown


def test_the_recipes_own_commands_use_recipe_names():
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        assert "--config configs/" not in text, path.name
        if "tfaploss train --config" in text:
            assert f"tfaploss train --config recipe:{path.stem}" in text, path.name


def test_a_reader_that_stops_early_gets_no_traceback():
    # `tfaploss recipes | head -1`: the pipe's reader is gone before the table is written.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "tfaploss.cli", "recipes"],
                                stdout=write_end, stderr=subprocess.PIPE, text=True,
                                cwd=REPO, timeout=120, check=False)
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr
    assert result.returncode == 0
