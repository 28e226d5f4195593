"""``tfaploss compare``: which loss, which batch, for my data?

The same tuning protocol for every loss (:mod:`tfaploss.compare.protocol`), every run
kept in a ledger keyed on its whole setup (:mod:`tfaploss.compare.ledger`), on cached
backbone features (:mod:`tfaploss.compare.features`) or on images, from scratch or
fine-tuning (:mod:`tfaploss.compare.images`), with tables and figures
(:mod:`tfaploss.compare.report`); :mod:`tfaploss.compare.command` puts them together.
"""

from tfaploss.compare.protocol import (
    AP_LOSSES,
    BUDGETS,
    PEERS,
    SEARCH_SPACES,
    Ledger,
    Protocol,
    RunSpec,
    interval,
    nested_interval,
    run,
    updates_for,
)

__all__ = ["AP_LOSSES", "BUDGETS", "PEERS", "SEARCH_SPACES", "Ledger", "Protocol", "RunSpec",
           "interval", "nested_interval", "run", "updates_for"]
