"""The extras a run config needs, checked before any training (by ``train``,
``evaluate --config`` and ``compare``) so that a missing one stops at once."""

from __future__ import annotations

from tfaploss import extras
from tfaploss.config.schema import Config

__all__ = ["check_config_extras", "config_extras"]


def config_extras(cfg: Config) -> list[tuple[str, str]]:
    """``(extra, what needs it)`` for every optional part ``cfg`` uses."""
    needs = []
    ev = cfg.evaluation
    if cfg.data.test and (ev.at_end or ev.every_n_epochs):
        need = ev.search_plan.required_extra(key="evaluation.backend")
        if need is not None:
            needs.append(need)
    backbone = str(cfg.model.backbone)
    if backbone.startswith("keras_hub:"):
        needs.append(("hub", f"model.backbone: {backbone}"))
    return needs


def check_config_extras(cfg: Config) -> None:
    """Raise :class:`~tfaploss.extras.MissingExtraError` for the first extra ``cfg``
    needs that is not installed (nothing is imported)."""
    for extra, needed_by in config_extras(cfg):
        extras.require(extra, needed_by)
