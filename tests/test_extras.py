"""The optional parts: one clear line, with the install command, for each missing one.

A missing module is simulated with ``sys.modules[name] = None`` (what Python reads as
"cannot be imported"); nothing is ever uninstalled.
"""

from __future__ import annotations

import sys

import pytest

from tfaploss import extras
from tfaploss.extras import EXTRAS, Extra, MissingExtraError


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_each_missing_extra_gives_one_line_with_its_install_command(name, monkeypatch):
    for module in EXTRAS[name].modules:
        monkeypatch.setitem(sys.modules, module, None)
    assert not extras.installed(name)
    with pytest.raises(MissingExtraError) as info:
        extras.require(name, "the feature")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"the feature needs {EXTRAS[name].title}, which is not installed")
    assert f'pip install "tfaploss[{name}]"' in message
    assert info.value.extra == name and info.value.install == f'pip install "tfaploss[{name}]"'
    with pytest.raises(MissingExtraError, match="not installed"):
        extras.import_extra(name, "the feature")
    assert not extras.usable(name)


def test_missing_extra_error_is_an_import_error(monkeypatch):
    # The usual guard around an optional import keeps catching it.
    monkeypatch.setitem(sys.modules, "scann", None)
    with pytest.raises(ImportError) as info:
        extras.import_extra("scann", "evaluation.backend: scann")
    assert info.value.name == "scann"
    assert str(info.value) == ('evaluation.backend: scann needs ScaNN, which is not '
                               'installed: pip install "tfaploss[scann]" (Linux only)')


def test_an_installed_extra_imports_and_is_returned():
    json_extra = Extra("probe", "the json module", ("json",))
    EXTRAS["probe"] = json_extra
    try:
        assert extras.installed("probe") and extras.usable("probe")
        assert extras.import_extra("probe", "a test") is sys.modules["json"]
        extras.require("probe", "a test")
    finally:
        del EXTRAS["probe"]


def test_an_extra_that_is_installed_but_broken_says_so(tmp_path, monkeypatch):
    (tmp_path / "tfaploss_probe_broken.py").write_text(
        "raise RuntimeError('built for another TensorFlow\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(EXTRAS, "probe", Extra("probe", "Probe", ("tfaploss_probe_broken",)))
    assert extras.installed("probe")  # found, not imported
    assert not extras.usable("probe")
    with pytest.raises(MissingExtraError) as info:
        extras.import_extra("probe", "a feature")
    assert str(info.value) == (
        "a feature needs Probe, which is installed but cannot be imported (RuntimeError: "
        'built for another TensorFlow): pip install "tfaploss[probe]"')


def test_require_can_check_part_of_an_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "fontTools", None)
    if not extras.installed("beam") and extras.missing("beam") != ["fontTools"]:
        pytest.skip("Apache Beam is not installed here")
    extras.require("beam", "python -m tfaploss.pipelines.folder", ("apache_beam",))
    with pytest.raises(MissingExtraError, match=r'tfaploss.pipelines.glyphs needs Apache Beam.*'
                                                r'tfaploss\[beam\]'):
        extras.require("beam", "python -m tfaploss.pipelines.glyphs", ("apache_beam", "fontTools"))


def test_an_unknown_extra_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown extra 'scan'; the extras are scann, "):
        extras.require("scan", "x")
