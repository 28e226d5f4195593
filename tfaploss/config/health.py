"""The batch-health thresholds, defined once: each with its default, the values it
allows and why it is what it is.

:class:`HealthThresholds` is what :class:`tfaploss.training.TrainingHealthMonitor`
judges a run by; :class:`HealthConfig`, the ``training.health`` section of a run's
config, is derived from it (plus ``enabled``), so the config, the callback and
``tfaploss train`` cannot drift apart. How the defaults were measured: ``docs/health.md``.
No Keras here: the config package imports none.

Example:

>>> HealthThresholds(stop_share=0.25).stop_share
0.25
>>> HealthConfig().thresholds() == HealthThresholds(stop_share=0.25)
True
"""

# No ``from __future__ import annotations``: HealthConfig is built from these fields'
# types, which must be types, not strings, for the schema to read them.
import dataclasses
import math
import typing
from dataclasses import dataclass

from tfaploss.config.fields import Range, ranged

__all__ = ["HealthConfig", "HealthThresholds"]


def _threshold(default, *, low=None, high=None, low_open=False, config=True,
               config_default=dataclasses.MISSING):
    """A field of :class:`HealthThresholds`: ``config=False`` keeps it out of
    :class:`HealthConfig`, ``config_default`` is ``tfaploss train``'s default when it
    differs from the callback's."""
    return ranged(default, low=low, high=high, low_open=low_open,
                  metadata={"config": config, "config_default": config_default})


@dataclass(frozen=True)
class HealthThresholds:
    """When a run counts as collapsed, stalled or flat, and when that stops it (the
    rules: docs/health.md). ``None`` turns an optional rule off.

    Args:
        collapse_cosine: mean cosine at or above which a batch counts as collapsed.
        collapse_fraction: share of the window's images that must count.
        window_share: share of the run's images the window covers.
        min_window_images: smallest window, in images.
        stop_share: stop when the collapse, with queries at chance, holds over this
            share of the run (at least ``window_share``); None only warns.
        stop_chance_ap: ``chance_ap`` at or above which a collapsed step counts
            towards the stop (0: the cosine alone).
        cone_cosine, cone_chance_ap: a step after the run's first ``stop_share``
            with both also counts towards the stop (None: no wide-cone rule).
        stall_chance_ap: ``chance_ap`` at or above which a late step counts as
            stalled at chance (None: no stall rule).
        stall_after: share of the run before the stall rule judges.
        flat_rtol: relative range of the loss under which the window is flat
            (None: no flat-loss rule). The callback's only: not a config key.

    Raises:
        ValueError: a value of the wrong type or outside its range, as
            ``"stop_share must be a number in [0.1, 1] or None, received ..."``.
    """

    # Trained models sit far below (0.05-0.6); a from-scratch start passes it briefly.
    collapse_cosine: float = _threshold(0.99, low=-1, high=1, low_open=True)
    # Dips under a fifth of the steps do not hide a collapse; single spikes are not one.
    collapse_fraction: float = _threshold(0.8, low=0, high=1, low_open=True)
    # A run collapsed from its start is reported with 90 % of its budget left.
    window_share: float = _threshold(0.1, low=0, high=1)
    # Four times the longest healthy transient measured, so short runs are not judged
    # on a handful of steps.
    min_window_images: int = _threshold(8192, low=1)
    # The callback only warns unless told; tfaploss train stops a collapse that still
    # holds over a quarter of the run, which then costs a quarter of its budget.
    stop_share: float | None = _threshold(None, low=0, high=1, config_default=0.25)
    # Random embeddings give about 0.5: a step in a narrow cone that still ranks is
    # not one that lost retrieval.
    stop_chance_ap: float = _threshold(0.5, low=0, high=1)
    # Runs stalled in a wider cone sat at 0.95-0.99; every run that learned had left
    # it (<= 0.66) by its second quarter.
    cone_cosine: float | None = _threshold(0.95, low=-1, high=1, low_open=True)
    # 0.08 below the lowest stalled epoch measured (33 % at chance).
    cone_chance_ap: float = _threshold(0.25, low=0, high=1)
    # 0.1 above the most any run that learned had in its second half (20 %).
    stall_chance_ap: float | None = _threshold(0.3, low=0, high=1, low_open=True)
    # By half the run, runs that learn rank almost every query above chance.
    stall_after: float = _threshold(0.5, low=0, high=1)
    # Real batches differ, so a learning model's loss moves more than this between them.
    flat_rtol: float | None = _threshold(1e-3, low=0, high=math.inf, config=False)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value, kinds = getattr(self, f.name), typing.get_args(f.type) or (f.type,)
            optional, integer = type(None) in kinds, int in kinds
            allowed = f.metadata["range"]
            if f.name == "stop_share":  # the one range that depends on another field
                allowed = Range(self.window_share, allowed.high)
            if optional and value is None:
                continue
            number = (isinstance(value, int) if integer else isinstance(value, (int, float)))
            if not number or isinstance(value, bool) or value not in allowed:
                what = (f"an int >= {allowed.low:g}" if integer and allowed.high is None
                        else f"{'an int' if integer else 'a number'} in {allowed}")
                raise ValueError(f"{f.name} must be {what}{' or None' if optional else ''}"
                                 f", received {f.name}={value!r}")
            if not integer:
                object.__setattr__(self, f.name, float(value))


def _config_fields():
    yield "enabled", bool, True
    for f in dataclasses.fields(HealthThresholds):
        if f.metadata["config"]:
            default = f.metadata["config_default"]
            default = f.default if default is dataclasses.MISSING else default
            yield f.name, f.type, dataclasses.field(default=default, metadata=f.metadata)


def _thresholds(self) -> HealthThresholds:
    """The :class:`HealthThresholds` of this section (the callback's own for the rest)."""
    return HealthThresholds(**{name: getattr(self, name)
                               for name, _, _ in _config_fields() if name != "enabled"})


HealthConfig = dataclasses.make_dataclass(
    "HealthConfig", list(_config_fields()), namespace={"thresholds": _thresholds})
HealthConfig.__module__ = __name__
HealthConfig.__doc__ = """The batch-health check of ``tfaploss train``
(:class:`tfaploss.training.TrainingHealthMonitor`): ``enabled`` and every field of
:class:`HealthThresholds` but ``flat_rtol``, with the same defaults and ranges, except
``stop_share``: 0.25 here, where the callback alone only warns. ``enabled: false`` turns
the check off (the metrics are still logged)."""
