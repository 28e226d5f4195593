"""The study's pre-registered rules on synthetic numbers: the answer
(experiments/fair_comparison/decide.py: every cell's lower bound must be above 0, a
missing cell leaves it undecided, and the AP loss and the peer are the ones compare
chose on validation) and the plateau (plateau_pilot.py: a larger budget must confirm
it)."""

import importlib.util
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parents[2] / "experiments" / "fair_comparison"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, STUDY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def decide():
    return _script("decide")


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


def test_a_plateau_needs_a_larger_budget_to_confirm_it():
    pilot = _script("plateau_pilot")
    losses = ("A", "B")
    # validation MAP@R by budget: A flat from 2; B gains 0.3 from 2 to 4, then flat
    scores = {"A": {1: 90.0, 2: 91.0, 4: 91.1, 8: 91.15}, "B": {1: 80.0, 2: 80.5, 4: 80.8,
                                                               8: 80.9}}
    val = {(loss, i): {"val_map@r": v, "last_fifth": 0.01}
           for loss in losses for i, v in scores[loss].items()}
    # the largest budget tried only confirms: 4 is no plateau until 8 is tried
    assert pilot._plateau([1, 2, 4], losses, val) is None
    assert pilot._plateau([1, 2, 4, 8], losses, val) == 4
    # a last fifth still moving rules a budget out, and a missing one too
    val[("A", 4)]["last_fifth"] = 0.2
    assert pilot._plateau([1, 2, 4, 8], losses, val) is None
    val[("A", 4)]["last_fifth"] = None
    assert pilot._plateau([1, 2, 4, 8], losses, val) is None
    # a budget not yet run at every rate counts against a plateau: with B flat from 2,
    # 2 is the plateau until B's runs at 16 (not tried: fewer rates) score 0.25 above it
    val[("A", 4)]["last_fifth"] = 0.01
    flat = {k: dict(v) for k, v in val.items()}
    flat[("B", 4)]["val_map@r"] = flat[("B", 8)]["val_map@r"] = 80.6
    assert pilot._plateau([1, 2, 4, 8], losses, flat) == 2
    flat[("B", 16)] = {"val_map@r": 80.75, "last_fifth": 0.0}
    assert pilot._plateau([1, 2, 4, 8], losses, flat) == 4
    flat[("B", 16)]["val_map@r"] = 80.85
    assert pilot._plateau([1, 2, 4, 8], losses, flat) is None


def test_a_budget_keeps_each_loss_at_its_best_learning_rate():
    pilot = _script("plateau_pilot")
    rows = [{"lr": 1e-3, "val_map@r": 80.0}, {"lr": 1e-2, "val_map@r": None},
            {"lr": 3e-3, "val_map@r": 82.5}]
    assert pilot._best(rows)["lr"] == 3e-3
    # a failed rate never beats a scored one, even a score of 0
    assert pilot._best([{"lr": 1, "val_map@r": None}, {"lr": 2, "val_map@r": 0.0}])["lr"] == 2
    assert pilot._best([{"lr": 1, "val_map@r": None}])["lr"] == 1


def test_the_pilot_draws_each_loss_at_each_rate(tmp_path):
    pytest.importorskip("matplotlib")
    pilot = _script("plateau_pilot")
    runs = [{"loss": loss, "images": i, "lr": lr, "val_map@r": 80.0 + i / 1e5 + lr}
            for loss in ("A", "B") for i in (65536, 131072) for lr in (1e-3, 1e-2)]
    runs.append({"loss": "A", "images": 262144, "lr": 1e-3, "val_map@r": None})
    record = {"runs": runs, "batch": 4096, "config": "c.yaml", "plateau_images": 65536}
    path = pilot._plot(record, ["A", "B"], [1e-3, 1e-2], tmp_path / "pilot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["pilot.png"]  # no temporary left


def test_knobs_are_read_and_keep_their_runs_apart():
    pilot = _script("plateau_pilot")
    knobs = pilot._parse_knobs("SupCon:temperature=0.023, SmoothAP:temperature=1e-3")
    assert knobs == {"SupCon": {"temperature": 0.023}, "SmoothAP": {"temperature": 0.001}}
    assert pilot._parse_knobs("") == {}
    with pytest.raises(SystemExit, match="not LOSS:KNOB=VALUE"):
        pilot._parse_knobs("SupCon=0.1")
    # the same loss, budget and rate at other knobs is another run
    assert pilot._key("SupCon", 1, 1e-3, {}) != pilot._key("SupCon", 1, 1e-3, knobs["SupCon"])
