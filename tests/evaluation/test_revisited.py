"""Revisited Oxford/Paris protocol: trapezoid AP goldens, protocols, safe gnd loading."""

import json
import os
import pickle

import numpy as np
import pytest

from tfaploss.evaluation import (
    load_revisited_gnd,
    revisited_map,
    revisited_map_from_ranks,
    revisited_per_query_ap,
    trapezoid_ap,
)


def _scores_for_ranking(n):
    """One query whose ranking is database items 0, 1, ..., n-1."""
    return np.linspace(1.0, 0.0, n)[None, :]


def test_trapezoid_goldens(aploss_goldens):
    g = aploss_goldens["tie_and_protocol_cases"]["revisitop"]
    assert trapezoid_ap([0, 2], 2) == pytest.approx(g["ranks_0_2"])
    assert trapezoid_ap([0], 1) == pytest.approx(g["single_pos_rank0"])
    assert trapezoid_ap([1], 1) == pytest.approx(g["single_pos_rank1"])
    assert trapezoid_ap([9], 1) == pytest.approx(g["single_pos_rank9"])


def test_junk_removed_before_positions_are_counted(aploss_goldens):
    # Ranked list P J N P J P: junk at ranks 1 and 4.
    g = aploss_goldens["tie_and_protocol_cases"]["revisitop"]
    gnd = [{"easy": [0, 3, 5], "hard": [], "junk": [1, 4]}]
    got = revisited_map(_scores_for_ranking(6), gnd, protocol="medium")
    assert got["map"] == pytest.approx(g["list_P_J_N_P_J_P_after_junk"])


@pytest.mark.parametrize("k", [0, 1, 9])
def test_single_positive_through_revisited_map(aploss_goldens, k):
    g = aploss_goldens["tie_and_protocol_cases"]["revisitop"]
    gnd = [{"easy": [k], "hard": [], "junk": []}]
    assert revisited_map(_scores_for_ranking(12), gnd)["map"] == pytest.approx(
        g[f"single_pos_rank{k}"])


def test_easy_medium_hard_and_mp_at_k():
    # Ranking: 0=hard, 1=easy, 2=negative, 3=junk, 4=easy.
    gnd = [{"easy": [1, 4], "hard": [0], "junk": [3]},
           {"easy": [], "hard": [], "junk": [0]}]  # no positives: left out
    scores = np.vstack([_scores_for_ranking(5), _scores_for_ranking(5)])
    easy = revisited_map(scores, gnd, "easy")
    medium = revisited_map(scores, gnd, "medium", ks=(1, 2, 5))
    hard = revisited_map(scores, gnd, "hard")
    assert easy["map"] == pytest.approx((2 + (1 / 2 + 2 / 3)) / 4)  # positions 0, 2
    assert medium["map"] == pytest.approx(1 / 3 + 1 / 3 + (2 / 3 + 3 / 4) / 6)
    assert hard["map"] == pytest.approx(1.0)
    # Radenović's mP@k: kq = min(last positive position, k) = 4 for k = 5.
    assert medium["mp@1"] == 1.0 and medium["mp@2"] == 1.0
    assert medium["mp@5"] == pytest.approx(3 / 4)
    aps = revisited_per_query_ap(scores, gnd, "medium")
    assert np.isnan(aps[1]) and aps[0] == pytest.approx(medium["map"])


def test_ties_broken_by_index():
    scores = np.array([[0.5, 0.5, 0.1]])
    assert revisited_map(scores, [{"easy": [0], "hard": [], "junk": []}])["map"] == 1.0
    assert revisited_map(scores, [{"easy": [1], "hard": [], "junk": []}])["map"] == 0.25


def test_truncated_ranks_give_a_lower_bound():
    gnd = [{"easy": [0, 7], "hard": [], "junk": []}]
    ranks = np.arange(5)[None, :]  # item 7 was cut off by the searcher
    got = revisited_map_from_ranks(ranks, gnd, database_size=10)
    assert got["lower_bound"] is True
    assert got["map"] == pytest.approx(0.5)  # only the found positive contributes
    full = revisited_map(_scores_for_ranking(10), gnd)
    assert full["map"] > got["map"]
    assert got["mp@1"] == full["mp@1"] and got["mp@5"] == full["mp@5"]
    complete = revisited_map_from_ranks(np.arange(10)[None, :], gnd, database_size=10)
    assert complete["lower_bound"] is False and complete["map"] == pytest.approx(full["map"])


def test_protocol_errors():
    with pytest.raises(ValueError, match="protocol"):
        revisited_map(_scores_for_ranking(3), [{"easy": [0], "hard": [], "junk": []}], "extreme")
    with pytest.raises(ValueError, match="lacks"):
        revisited_map(_scores_for_ranking(3), [{"easy": [0]}])
    with pytest.raises(ValueError, match="no query has a positive"):
        revisited_map(_scores_for_ranking(3), [{"easy": [], "hard": [], "junk": []}])
    # ks: the metrics' one check (a float or a zero is refused, whichever function)
    for ks in ((0,), (), (1.5,), ("5",)):
        with pytest.raises(ValueError, match="`ks` must be a non-empty sequence of positive"):
            revisited_map(_scores_for_ranking(3), [{"easy": [0], "hard": [], "junk": []}],
                          ks=ks)


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_gnd_loader_reads_the_json_the_job_writes(tmp_path):
    path = tmp_path / "gnd_test.json"
    path.write_text(json.dumps({
        "imlist": ["a", "b", "c"], "qimlist": ["q"],
        "gnd": [{"easy": [0], "hard": [2], "junk": [], "bbx": [1.0, 2.0, 30.0, 40.0]}],
        "source": {"file": "gnd_test.pkl", "sha256": "0" * 64}}))
    got = load_revisited_gnd(str(path))
    assert got["gnd"][0] == {"easy": [0], "hard": [2], "junk": [], "bbx": [1, 2, 30, 40]}
    assert got["imlist"] == ["a", "b", "c"]


@pytest.mark.parametrize("name", ["gnd_roxford5k.pkl", "gnd_rparis6k.pickle",
                                  "gnd_rparis6k.json"])
def test_gnd_loader_never_unpickles_and_names_the_conversion(tmp_path, name):
    """Evaluation reads JSON only: a pickle (by its name, or by its first byte under a
    .json name) is refused with the command that converts it; its payload never runs."""
    marker = tmp_path / "pwned"
    payload = {"imlist": [], "qimlist": [], "gnd": [_Exploit(marker)]}
    path = tmp_path / name
    path.write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(ValueError) as info:
        load_revisited_gnd(str(path))
    message = str(info.value)
    assert str(path) in message and "JSON only" in message
    assert "python -m tfaploss.pipelines.revisited" in message and "--ground_truth_only" in message
    assert ("rparis6k" if "rparis" in name else "roxford5k") in message
    assert not marker.exists()


def _pickle_scores(truth, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((len(truth["qimlist"]), len(truth["imlist"])))


def test_json_ground_truth_gives_the_same_metrics_as_the_pickle(tmp_path):
    """Converted once (sandboxed reader -> JSON), the ground truth scores exactly as
    the pickle's own content (read here by pickle itself, trusted) did before."""
    from tests.reliability.hostile_pickles import realistic_gnd
    from tfaploss.evaluation.revisited import check_revisited_gnd
    from tfaploss.pipelines.pickle_sandbox import loads_plain

    truth = realistic_gnd(num_db=400, num_queries=9, index_dtype=np.int32)
    pkl = tmp_path / "gnd_roxford5k.pkl"
    pkl.write_bytes(pickle.dumps(truth, protocol=4))
    converted = tmp_path / "gnd_roxford5k.json"
    converted.write_text(json.dumps(check_revisited_gnd(loads_plain(pkl.read_bytes()))))
    from_json = load_revisited_gnd(str(converted))["gnd"]
    from_pickle = pickle.loads(pkl.read_bytes())["gnd"]  # numpy arrays, as before
    scores = _pickle_scores(truth)
    for protocol in ("easy", "medium", "hard"):
        want = revisited_map(scores, from_pickle, protocol, ks=(1, 5, 10))
        assert revisited_map(scores, from_json, protocol, ks=(1, 5, 10)) == want
        np.testing.assert_array_equal(revisited_per_query_ap(scores, from_json, protocol),
                                      revisited_per_query_ap(scores, from_pickle, protocol))
    # ... and through evaluate(), given the JSON path as `tfaploss evaluate --gnd` does
    from tfaploss.evaluation import evaluate

    rng = np.random.default_rng(1)
    db = rng.standard_normal((400, 8)).astype(np.float32)
    q = rng.standard_normal((9, 8)).astype(np.float32)
    by_path = evaluate(db, query=q, gnd=str(converted), protocol="roxford", verbose=0)
    by_pickle = evaluate(db, query=q, gnd=from_pickle, protocol="roxford", verbose=0)
    assert by_path.metrics == by_pickle.metrics and "medium/map" in by_path.metrics
