"""The extras a run config needs, checked before any training."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tfaploss.config import config_from_dict, load_config
from tfaploss.extras import MissingExtraError
from tfaploss.run.needs import check_config_extras, config_extras

REPO = Path(__file__).resolve().parents[2]


def _cfg(**evaluation):
    return config_from_dict({"data": {"train": "x/train", "test": "x/test"},
                             "loss": {"name": "APLoss"}, "evaluation": evaluation},
                            warn=False)


def test_auto_is_the_default_and_needs_no_extra():
    cfg = _cfg()
    assert cfg.evaluation.backend == "auto"
    assert config_extras(cfg) == []
    assert config_extras(_cfg(target_recall=0.9)) == []


def test_a_named_scann_backend_needs_scann_only_when_evaluation_runs():
    assert config_extras(_cfg(backend="scann")) == [("scann", "evaluation.backend: scann")]
    assert config_extras(_cfg(backend="scann_ah", at_end=False, every_n_epochs=2)) == [
        ("scann", "evaluation.backend: scann_ah")]
    assert config_extras(_cfg(backend="scann", at_end=False)) == []
    assert config_extras(_cfg(backend="exact", target_recall=0.9))[0][0] == "scann"


def test_a_missing_extra_stops_the_run_with_its_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "scann", None)
    with pytest.raises(MissingExtraError) as info:
        check_config_extras(_cfg(backend="scann_ah"))
    assert str(info.value) == ('evaluation.backend: scann_ah needs ScaNN, which is not '
                               'installed: pip install "tfaploss[scann]" (Linux only)')
    check_config_extras(_cfg())  # auto: nothing to install


def test_train_checks_before_it_touches_the_run_directory(tmp_path, monkeypatch):
    from tfaploss.run.trainer import train

    monkeypatch.setitem(sys.modules, "scann", None)
    cfg = config_from_dict({"data": {"train": "x/train", "test": "x/test"},
                            "loss": {"name": "APLoss"}, "run_dir": str(tmp_path / "run"),
                            "evaluation": {"backend": "scann"}}, warn=False)
    with pytest.raises(MissingExtraError, match=r"tfaploss\[scann\]"):
        train(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_the_recipes_need_no_extra_unless_they_name_one(path):
    cfg = load_config(path, warn=False)
    names_scann = cfg.evaluation.backend in ("scann", "scann_ah")
    names_hub = cfg.model.backbone.startswith("keras_hub:")
    assert [e for e, _ in config_extras(cfg)] == (
        (["scann"] if names_scann else []) + (["hub"] if names_hub else []))
    # Only the recipe whose 136k-image test set wants ScaNN's tree names it.
    assert names_scann == (path.name == "roadmap_inat_resnet50.yaml")
