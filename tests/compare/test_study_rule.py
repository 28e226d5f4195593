"""The study's pre-registered rule (experiments/fair_comparison/decide.py) on synthetic
results: every cell's lower bound must be above 0, a missing cell leaves it undecided,
and the AP loss and the peer are the ones compare chose on validation."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "fair_comparison" / "decide.py"


@pytest.fixture(scope="module")
def decide():
    spec = importlib.util.spec_from_file_location("decide", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(batch, difference, half, budget="images"):
    """A cell as compare writes it: FastAP chosen on validation though Smooth-AP leads
    on test, against the triplet."""
    common = {"budget": budget, "batch": batch, "best_ap": "FastAP", "best_peer": "Triplet",
              "interval": "repeats"}
    return [{**common, "loss": "FastAP", "vs_best_peer": [difference, half]},
            {**common, "loss": "SmoothAP", "vs_best_peer": [difference + 5, half]},
            {**common, "loss": "Triplet", "vs_best_peer": None}]


def test_every_cell_above_zero_is_yes_and_one_at_or_below_is_no(decide):
    strong = _cell(2048, 0.5, 0.2) + _cell(4096, 0.3, 0.1)
    weak = _cell(2048, 1.0, 0.5) + _cell(4096, 0.25, 0.2)
    answer, cells = decide.verdict({"strong": strong, "weak": weak})
    assert answer == "yes" and len(cells) == 4
    assert {(c["ap"], c["peer"]) for *_, c in cells} == {("FastAP", "Triplet")}
    assert cells[0][2]["lower"] == pytest.approx(0.3)
    # a lower bound of exactly 0 is not above it
    at_zero = _cell(2048, 0.5, 0.2) + _cell(4096, 0.2, 0.2)
    assert decide.verdict({"strong": at_zero, "weak": weak})[0] == "no"
    # a failing cell decides even while another is missing
    assert decide.verdict({"strong": _cell(2048, -0.1, 0.05), "weak": weak})[0] == "no"


def test_a_missing_cell_leaves_it_undecided(decide):
    weak = _cell(2048, 1.0, 0.5) + _cell(4096, 0.25, 0.2)
    answer, cells = decide.verdict({"strong": _cell(2048, 0.5, 0.2), "weak": weak})
    assert answer == "undecided"
    assert [(name, batch) for name, batch, c in cells if c is None] == [("strong", 4096)]
    # another budget's cells do not count for the images budget
    other = _cell(2048, 0.5, 0.2) + _cell(4096, 0.3, 0.1, budget="seconds")
    assert decide.verdict({"strong": other, "weak": weak})[0] == "undecided"
    assert decide.verdict({"strong": [], "weak": []})[0] == "undecided"
