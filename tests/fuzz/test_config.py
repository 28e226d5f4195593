"""Fuzz: the config loader on random mutations of every recipe of ``configs/``.

One mutation per case, at a key drawn from the whole recipe (sections, keys, list
items): the key dropped, renamed, its value replaced by one of another type (None, an
empty or blank string, a boolean, an integer up to 10^40, a float up to 1e308, NaN,
+-inf, a list, a mapping), nested one level down (``{value: v}`` or ``[v]``) or made a
list of two. The mutated recipe reaches the loader three ways: as a dict
(``config_from_dict``), as a YAML file (``load_config``) and, for a value, as a
``--set key=value`` override of the recipe's file. A second test mutates the file's
text (bytes flipped, cut short, inserted).

Every case either loads (the mutation was harmless: a default, an allowed value) or
raises ONE :class:`ConfigError`, never another exception, whose message names the key:
the mutated key (for a rename: the new one or the missing old one; for a drop: the
dropped key or a key of the same section whose value no longer fits the default that
took its place). A file refused by the YAML reader (an integer of more than 30 digits,
a text mutation) names the file instead. The ``loss`` section is checked by building
the loss, so the cases reach every loss constructor too.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz import harness
from tests.fuzz.profiles import examples
from tests.support.timing import speed_factor
from tfaploss.config import ConfigError, config_from_dict, load_config
from tfaploss.config.yaml_loader import load_yaml_text

pytestmark = pytest.mark.tensorflow  # the loss section builds a Keras loss

RECIPES = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
SOFT_S = 2.0  # a case: ~7 ms on an idle core (3000 cases: 21 s)
_SPEED = speed_factor()

VALUES = st.one_of(
    st.none(), st.just(""), st.just(" "), st.booleans(),
    st.integers(-(10 ** 40), 10 ** 40), st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, -1e308, 5e-324]),
    st.text(max_size=12), st.sampled_from(["1e-4", "nan", ".inf", "0x10", "null"]),
    st.lists(st.integers(-3, 3) | st.none() | st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _paths(node, prefix=()):
    """Every key path of a recipe: (section, key, ...), list items by index."""
    items = node.items() if isinstance(node, dict) else (
        enumerate(node) if isinstance(node, list) else ())
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))


def _dotted(path) -> str:
    """The dotted key of a path, list indices left out (``evaluation.ks``)."""
    return ".".join(str(p) for p in path if not isinstance(p, int))


@st.composite
def mutations(draw, raw: dict):
    """``(mutated raw, op, path, new key or None, value or None)``."""
    raw = copy.deepcopy(raw)
    path = draw(st.sampled_from(list(_paths(raw))))
    parent = raw
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    op = draw(st.sampled_from(["drop", "rename", "value", "nest", "listify"]))
    if op == "rename" and not isinstance(parent, dict):
        op = "drop"  # a list item has no name to change
    renamed, value = None, None
    if op == "drop":
        parent.pop(key)
    elif op == "rename":
        renamed = draw(st.sampled_from([f"{key}_", f"{key}s", str(key).upper(), f" {key}",
                                        "", "name"]))
        while renamed in parent:
            renamed += "_"
        parent[renamed] = parent.pop(key)
    elif op == "nest":
        value = parent[key] = draw(st.sampled_from([{"value": parent[key]}, [parent[key]]]))
    elif op == "listify":
        value = parent[key] = [parent[key], parent[key]]
    else:
        value = parent[key] = draw(VALUES)
    return raw, op, path, renamed, value


def _names_key(message: str, op: str, path, renamed, raw: dict) -> bool:
    dotted = _dotted(path)
    if op == "rename":
        new = _dotted((*path[:-1], renamed))
        return dotted in message or new in message or f"'{renamed}'" in message
    if dotted in message:
        return True
    if op == "drop":
        # The default that took its place may not fit a key beside it.
        section = _dotted(path[:-1])
        return (section + "." if section else "'") in message or section == ""
    return False


def _override(dotted: str, value) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
    return f"{dotted}={text.removesuffix('...').strip()}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
@settings(max_examples=examples("config"))
@given(data=st.data())
def test_a_mutated_recipe_loads_or_names_the_key(recipe, data):
    raw = load_yaml_text(recipe.read_text(encoding="utf-8"))
    mutated, op, path, renamed, value = data.draw(mutations(raw))
    route = data.draw(st.sampled_from(["dict", "file", "set"]))
    if route == "set" and (op != "value" or any(isinstance(p, int) for p in path)
                           or not all(isinstance(p, str) and p.strip() == p and p
                                      for p in path)):
        route = "dict"  # --set takes a dotted path of plain keys to a new value
    what = f"{recipe.stem}: {op} {_dotted(path) or path} ({route})"
    with harness.case("config", soft_s=SOFT_S * _SPEED, label=what) as case, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _load(route, mutated, recipe, path, value)
            case.outcome = "loaded"
            return
        except ConfigError as err:
            message = str(err)
            case.outcome = "ConfigError"
    assert "Traceback" not in message and len(message) < 4000, message
    file_refused = route == "file" and "line " in message and "config key" not in message
    assert file_refused or _names_key(message, op, path, renamed, mutated), (what, message)


def _load(route, mutated, recipe, path, value):
    if route == "dict":
        return config_from_dict(mutated, warn=False)
    if route == "set":
        return load_config(recipe, [_override(_dotted(path), value)], warn=False)
    with tempfile.TemporaryDirectory() as folder:
        target = os.path.join(folder, "mutated.yaml")
        with open(target, "w", encoding="utf-8") as f:
            f.write(yaml.safe_dump(mutated, allow_unicode=True, width=1 << 30))
        return load_config(target, warn=False)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
@settings(max_examples=examples("config_text"))
@given(data=st.data())
def test_a_recipe_with_mutated_text_loads_or_names_the_file(recipe, data):
    text = recipe.read_bytes()
    kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
    at = data.draw(st.integers(0, len(text) - 1))
    if kind == "flip":
        mutated = text[:at] + bytes([text[at] ^ (1 << data.draw(st.integers(0, 7)))]) \
            + text[at + 1:]
    elif kind == "cut":
        mutated = text[:at]
    else:
        mutated = text[:at] + data.draw(st.sampled_from(
            [b":", b"- ", b"\t", b"&a ", b"*a", b"[", b"{", b"!!python/object ", b"\xff",
             b"\n  x: 1\n", b"\x00", b"'", b"%YAML 1.1\n"])) + text[at:]
    with harness.case("config", soft_s=SOFT_S * _SPEED, label=f"{recipe.stem}: {kind}@{at}") \
            as case, tempfile.TemporaryDirectory() as folder:
        target = os.path.join(folder, "mutated.yaml")
        with open(target, "wb") as f:
            f.write(mutated)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                load_config(target, warn=False)
                case.outcome = "loaded"
                return
            except ConfigError as err:
                case.outcome = "ConfigError"
                message = str(err)
    assert target in message and "Traceback" not in message, message
