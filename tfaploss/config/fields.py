"""The schema's field building blocks (the error, numeric ranges, shared bounds), apart
from :mod:`tfaploss.config.schema` so that sections in their own modules share them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A run configuration that cannot be used as written; the message says what to fix."""


MAX_BATCH = 2 ** 20
MAX_SEED = 2 ** 31 - 1  # tf.random.set_seed and numpy's Generator both take it
MAX_EPOCHS = 10 ** 6


@dataclass(frozen=True)
class Range:
    """The values a numeric key allows: ``low``..``high``, ``low`` excluded when
    ``low_open``; the bounds are what the code can run (``epochs: 1.0e+26`` is refused)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def __str__(self) -> str:
        def shown(bound, none):
            if bound is None:
                return none
            return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"

        low, high = shown(self.low, "-inf"), shown(self.high, "inf")
        return f"{'(' if self.low_open else '['}{low}, {high}]"

    def __contains__(self, value) -> bool:
        too_low = self.low is not None and (value <= self.low if self.low_open
                                            else value < self.low)
        return not too_low and (self.high is None or value <= self.high)

    def check(self, value, path: str) -> None:
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self.check(item, f"{path}[{i}]")
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return  # null or a named choice ('original'): the type check covers it
        if value not in self:
            raise ConfigError(f"config key '{path}': must be in {self}, received "
                              f"{value!r}.")


def ranged(default=dataclasses.MISSING, *, low=None, high=None, low_open=False,
           default_factory=dataclasses.MISSING, metadata=None):
    """A dataclass field whose numbers must lie in :class:`Range` (each item of a list);
    ``metadata`` adds to the field's own."""
    return field(default=default, default_factory=default_factory,
                 metadata={**(metadata or {}), "range": Range(low, high, low_open)})
