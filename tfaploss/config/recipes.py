"""The shipped recipes: YAML run configurations with a ``description:`` key in
``configs/``, copied into a wheel as ``tfaploss/recipes/*.yaml`` (setup.py's ``build_py``).
:func:`resolve_config_path` is the one place the ``recipe:`` prefix is understood.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tfaploss.config.fields import ConfigError

__all__ = ["RECIPE_PREFIX", "Recipe", "list_recipes", "recipe_names", "recipe_path", "recipe_text",
           "recipes_dir", "resolve_config_path"]

RECIPE_PREFIX = "recipe:"

# In a wheel: site-packages/tfaploss/recipes/. In a clone: <clone>/configs/, beside the
# package; setup.py marks the clone's root, so a stray top-level `configs` folder of some
# other distribution in site-packages is never taken for ours.
_PACKAGED = Path(__file__).resolve().parents[1] / "recipes"
_CLONE = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One shipped recipe: its name (the file's stem), its ``description:``, its file."""

    name: str
    description: str
    path: Path


def recipes_dir() -> Path:
    """The folder the recipes are read from: the installed package's
    ``tfaploss/recipes/``, else the clone's ``configs/``."""
    if _PACKAGED.is_dir():
        return _PACKAGED
    if (_CLONE / "setup.py").is_file() and (_CLONE / "configs").is_dir():
        return _CLONE / "configs"
    raise ConfigError(
        f"no recipes found: the installed package has no {_PACKAGED.name}/ folder and it "
        "does not run from a clone (configs/). Reinstall tfaploss from a wheel built by "
        "its setup.py (pip wheel . -w dist), which copies configs/*.yaml into it.")


def recipe_names() -> list[str]:
    """The recipes' names, sorted (the ``*.yaml`` files' stems)."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml") if p.is_file())


def recipe_path(name: str) -> Path:
    """The file of recipe ``name`` (a trailing ``.yaml`` is accepted); a
    :class:`ConfigError` listing the known names when there is none."""
    names = recipe_names()
    stem = name.removesuffix(".yaml")
    # Only a listed name is joined to the folder, so no name reaches a file outside it.
    if stem not in names:
        raise ConfigError(
            f"no recipe named {name!r}. The recipes are: "
            f"{', '.join(names) or '(none)'} (`tfaploss recipes` lists them with their "
            "descriptions).")
    return recipes_dir() / f"{stem}.yaml"


def recipe_text(name: str) -> str:
    """Recipe ``name``'s YAML text exactly as shipped (comments included)."""
    return recipe_path(name).read_bytes().decode("utf-8")


def list_recipes() -> list[Recipe]:
    """Every recipe with its ``description:`` ("" when it has none), sorted by name."""
    from tfaploss.config.yaml_loader import load_yaml_text

    recipes = []
    for name in recipe_names():
        path = recipes_dir() / f"{name}.yaml"
        raw = load_yaml_text(path.read_bytes().decode("utf-8"), name=str(path))
        description = raw.get("description") if isinstance(raw, dict) else None
        recipes.append(Recipe(name, str(description or ""), path))
    return recipes


def resolve_config_path(config: str | Path) -> Path:
    """What a ``--config`` value names: ``recipe:NAME`` is the shipped recipe's file,
    anything else the path as given."""
    if isinstance(config, str) and config.startswith(RECIPE_PREFIX):
        try:
            return recipe_path(config[len(RECIPE_PREFIX):].strip())
        except ConfigError as err:
            raise ConfigError(f"--config {config}: {err}") from None
    return Path(config)
