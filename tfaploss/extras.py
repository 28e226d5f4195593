"""The optional parts of tfaploss (pip extras): what each brings, how to install it, and
one clear error when a feature needs one that is missing.

The core install trains, evaluates with exact search and exports; :data:`EXTRAS` lists
the rest, each installed as ``pip install "tfaploss[<extra>]"``. A feature that needs one
calls :func:`require` (nothing is imported) or :func:`import_extra`; a missing extra
raises :class:`MissingExtraError`, one line naming what needs it and the install command.
Standard library only, so the Beam jobs use it without loading TensorFlow.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass

LOG = logging.getLogger(__name__)

__all__ = ["EXTRAS", "Extra", "MissingExtraError", "import_extra", "install_command",
           "installed", "missing", "require", "usable"]


@dataclass(frozen=True)
class Extra:
    """One pip extra: its name, the modules it must make importable, and a note."""

    name: str
    title: str             # what the message calls it ("ScaNN", "Apache Beam")
    modules: tuple[str, ...]
    note: str = ""         # shown after the install command, e.g. "Linux only"

    @property
    def install(self) -> str:
        return install_command(self.name)


EXTRAS: dict[str, Extra] = {e.name: e for e in (
    Extra("scann", "ScaNN", ("scann",), "Linux only"),
    Extra("faiss", "faiss", ("faiss",),
          "or install faiss-gpu yourself for the GPU path"),
    # fontTools: only the glyphs job reads fonts (it asks for it by name).
    Extra("beam", "Apache Beam", ("apache_beam", "fontTools")),
    # Beam's Dask runner imports both (apache-beam[dask]).
    Extra("dask", "Dask", ("dask", "distributed")),
    Extra("viz", "matplotlib", ("matplotlib",)),
    Extra("tfds", "TensorFlow Datasets", ("tensorflow_datasets",)),
    Extra("compare", "Optuna", ("optuna",)),
    Extra("hub", "keras-hub", ("keras_hub",)),
    Extra("demo", "scikit-learn", ("sklearn",)),
)}


def install_command(extra: str) -> str:
    """``pip install "tfaploss[<extra>]"`` (quoted: shells such as zsh expand brackets)."""
    return f'pip install "tfaploss[{extra}]"'


class MissingExtraError(ImportError):
    """An optional part is missing (not installed, or installed but failing to import).

    An :class:`ImportError`, so that ``except ImportError`` guards keep catching it.
    Attributes: ``extra`` (its name), ``needed_by``, ``install``.
    """

    def __init__(self, extra: str, needed_by: str, problem: str | None = None):
        spec = _extra(extra)
        why = problem or "which is not installed"
        note = f" ({spec.note})" if spec.note else ""
        super().__init__(f"{needed_by} needs {spec.title}, {why}: {spec.install}{note}",
                         name=spec.modules[0])
        self.extra = extra
        self.needed_by = needed_by
        self.install = spec.install


def _extra(name: str) -> Extra:
    try:
        return EXTRAS[name]
    except KeyError:
        raise ValueError(f"unknown extra {name!r}; the extras are "
                         f"{', '.join(EXTRAS)}.") from None


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a blocked or half-imported module
        return False


def missing(extra: str, modules: tuple[str, ...] | None = None) -> list[str]:
    """The modules of ``extra`` (or these of them) that cannot be found (nothing is
    imported)."""
    spec = _extra(extra)
    return [m for m in (spec.modules if modules is None else modules) if not _findable(m)]


def installed(extra: str) -> bool:
    """True when every module of ``extra`` can be found (cheap: nothing is imported)."""
    return not missing(extra)


def require(extra: str, needed_by: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise :class:`MissingExtraError` unless ``extra`` is installed (nothing is
    imported: a start-up check, before any work). ``modules``: check these modules of
    the extra instead of all of them (e.g. one job's share of ``beam``)."""
    if missing(extra, modules):
        raise MissingExtraError(extra, needed_by)


def import_extra(extra: str, needed_by: str, module: str | None = None):
    """Import ``module`` (default: the extra's first) and return it, or raise
    :class:`MissingExtraError` naming ``needed_by`` and the install command.

    An extra that is installed but fails to import (e.g. ScaNN built for another
    TensorFlow) is reported the same way, with the first line of the failure.
    """
    spec = _extra(extra)
    name = module or spec.modules[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        # Another package than the extra's is missing: the extra is installed but broken.
        broken = err.name and err.name.split(".")[0] != name.split(".")[0]
        problem = f"which cannot be imported (it misses {err.name!r})" if broken else None
        raise MissingExtraError(extra, needed_by, problem) from err
    except Exception as err:  # a broken install: any error of its import
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise MissingExtraError(
            extra, needed_by,
            f"which is installed but cannot be imported ({type(err).__name__}: {first})"
        ) from err


def usable(extra: str) -> bool:
    """True when every module of ``extra`` imports (it is imported: use where it is
    about to be used anyway, e.g. choosing a search backend)."""
    if not installed(extra):
        return False
    try:
        for module in _extra(extra).modules:
            import_extra(extra, "", module)
    except MissingExtraError as err:
        LOG.debug("%s is installed but does not import: %s", extra, err.__cause__)
        return False
    return True
