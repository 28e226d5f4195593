"""Retrieval metrics: goldens from pytorch-metric-learning / ROADMAP and hand cases."""

import numpy as np
import pytest

from tests.support import needs_scann
from tfaploss.evaluation import gldv2_map_at_k, retrieval_metrics
from tfaploss.evaluation.metrics import per_query_metrics

_GOLDEN_KEYS = {
    "precision@1": "precision_at_1",
    "map@r": "mean_average_precision_at_r",
    "r_precision": "r_precision",
    "map": "mean_average_precision",
    "recall@1": "recall_at_1",
    "recall@2": "recall_at_2",
    "recall@4": "recall_at_4",
    "recall@8": "recall_at_8",
    "recall@16": "recall_at_16",
}


@pytest.mark.parametrize("case", ["A", "B"])
@pytest.mark.parametrize("backend", ["exact", pytest.param("scann", marks=needs_scann)])
def test_goldens(case, backend, smooth_rank_goldens, retrieval_goldens):
    x = np.asarray(smooth_rank_goldens["inputs"][case]["X"])
    y = np.asarray(smooth_rank_goldens["inputs"][case]["y"])
    got = retrieval_metrics(x, y, ks=(1, 2, 4, 8, 16), backend=backend)
    want = retrieval_goldens["retrieval_metrics"][case]
    for ours, theirs in _GOLDEN_KEYS.items():
        assert got[ours] == pytest.approx(want[theirs], abs=1e-7), ours
    assert want["numpy_exact_mAP_self_excluded"] == pytest.approx(got["map"], abs=1e-7)


def test_lone_queries_counted_in_recall_not_in_precision():
    x = np.array([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
    y = np.array([0, 0, 1])  # query 2 has no other item of its class
    m, details = retrieval_metrics(x, y, ks=(1, 2), return_details=True)
    assert m["recall@1"] == pytest.approx(2 / 3)
    assert m["recall@2"] == pytest.approx(2 / 3)
    assert m["precision@1"] == 1.0
    assert m["map"] == m["map@r"] == m["r_precision"] == 1.0
    assert details["lone_queries"] == 1


def test_ties_broken_by_index():
    q = np.array([[1.0, 0.0]])
    db = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # rows 0 and 1 tie
    m = retrieval_metrics(q, [0], db, [1, 0, 0], ks=(1, 2))
    assert m["recall@1"] == 0.0 and m["recall@2"] == 1.0
    assert m["map"] == pytest.approx((1 / 2 + 2 / 3) / 2)
    swapped = retrieval_metrics(q, [0], db, [0, 1, 0], ks=(1, 2))
    assert swapped["precision@1"] == 1.0
    assert swapped["map"] == pytest.approx((1 + 2 / 3) / 2)


@pytest.mark.parametrize("backend", ["exact", pytest.param("scann", marks=needs_scann)])
def test_self_removed_by_index_with_exact_duplicates(backend):
    # Rows 0 and 1 are identical but belong to different classes: dropping "the first
    # neighbour" of query 1 would drop row 0 and leave the query itself at rank 1.
    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    y = np.array([0, 1, 0, 1])
    m = retrieval_metrics(x, y, ks=(1, 2, 3), backend=backend)
    assert m["recall@1"] == 0.0
    assert m["recall@2"] == 0.5
    assert m["recall@3"] == 1.0
    assert m["map"] == pytest.approx((1 / 3 + 1 / 2 + 1 / 2 + 1 / 3) / 4)


def test_separate_query_and_database_sets():
    rng = np.random.default_rng(3)
    db = rng.standard_normal((40, 6))
    db_y = rng.integers(0, 5, 40)
    q = rng.standard_normal((7, 6))
    q_y = rng.integers(0, 5, 7)
    m = retrieval_metrics(q, q_y, db, db_y, ks=(1, 5))
    # Reference straight from the definitions.
    s = q @ db.T
    order = np.lexsort((np.broadcast_to(np.arange(40), s.shape), -s), axis=1)
    rel = db_y[order] == q_y[:, None]
    r = rel.sum(1)
    prec = np.cumsum(rel, 1) / np.arange(1, 41)
    ap = (prec * rel).sum(1) / np.maximum(r, 1)
    assert m["map"] == pytest.approx(ap[r > 0].mean())
    assert m["recall@5"] == pytest.approx(rel[:, :5].any(1).mean())
    map_r = [(prec[i, :r[i]] * rel[i, :r[i]]).sum() / r[i] for i in range(7) if r[i]]
    assert m["map@r"] == pytest.approx(np.mean(map_r))


def test_truncated_depth_is_a_lower_bound(smooth_rank_goldens):
    x = np.asarray(smooth_rank_goldens["inputs"]["A"]["X"])
    y = np.asarray(smooth_rank_goldens["inputs"]["A"]["y"])
    full = retrieval_metrics(x, y)
    short, details = retrieval_metrics(x, y, map_depth=5, return_details=True)
    assert details["map_is_lower_bound"] and details["depth"] == 5
    assert short["map"] < full["map"]
    assert short["recall@1"] == full["recall@1"]
    assert short["map@r"] == pytest.approx(full["map@r"])  # R = 3 <= depth


def test_per_query_non_interpolated_ap(aploss_goldens):
    # ranks_0_2: positives at 0-based ranks 0 and 2, non-interpolated AP 0.8333.
    rel = np.array([[True, False, True, False]])
    out = per_query_metrics(rel, np.array([2]), ks=(1,))
    want = aploss_goldens["tie_and_protocol_cases"]["revisitop"]["noninterp_ranks_0_2"]
    assert out["ap"][0] == pytest.approx(want)


def test_bad_inputs_have_clear_errors():
    x = np.eye(3)
    with pytest.raises(ValueError, match="backend"):
        retrieval_metrics(x, [0, 0, 1], backend="annoy")
    with pytest.raises(ValueError, match="query_labels"):
        retrieval_metrics(x, [0, 0])
    with pytest.raises(ValueError, match="no query has a relevant"):
        retrieval_metrics(x, [0, 1, 2])
    with pytest.raises(ValueError, match="ks"):
        retrieval_metrics(x, [0, 0, 1], ks=(0,))
    with pytest.raises(ValueError, match="non-integer"):
        retrieval_metrics(x, [0.5, 0, 1])


def test_gldv2_map_at_100_hand_case():
    retrieved = [[5, 1, 7, 2], [3, 4, 9, 8], [1, 2, 3, 4]]
    relevant = [{1, 2}, {8}, set()]  # the third query has no ground truth: ignored
    ap0 = (1 / 2 + 2 / 4) / 2
    ap1 = (1 / 4) / 1
    assert gldv2_map_at_k(retrieved, relevant, k=100) == pytest.approx((ap0 + ap1) / 2)
    # k smaller than the number of relevant images: divided by min(m, k).
    assert gldv2_map_at_k([[1, 2]], [{1, 2, 3}], k=2) == pytest.approx(1.0)


def test_exclude_by_index_with_separate_database_equals_self_retrieval(smooth_rank_goldens):
    x = np.asarray(smooth_rank_goldens["inputs"]["A"]["X"])
    y = np.asarray(smooth_rank_goldens["inputs"]["A"]["y"])
    self_mode = retrieval_metrics(x, y, ks=(1, 4))
    separate = retrieval_metrics(x, y, x, y, ks=(1, 4), exclude=np.arange(len(x)))
    assert separate == pytest.approx(self_mode)
    # Without the exclusion every query finds itself first.
    assert retrieval_metrics(x, y, x, y, ks=(1,))["recall@1"] == 1.0


def _reference_per_query(q, q_y, db, db_y, exclude, depth, ks):
    """Full (score desc, index asc) sort in float64 -> relevance matrix -> metrics."""
    s = q.astype(np.float64) @ db.T.astype(np.float64)
    rel_all = db_y[None, :] == q_y[:, None]
    if exclude is not None:
        rows = np.flatnonzero(exclude >= 0)
        s[rows, exclude[rows]] = -np.inf
        rel_all[rows, exclude[rows]] = False
    order = np.lexsort((np.broadcast_to(np.arange(len(db)), s.shape), -s), axis=1)
    n_avail = len(db) - (exclude is not None and np.any(exclude >= 0))
    rel = np.take_along_axis(rel_all, order, 1)[:, :min(depth, n_avail)]
    return per_query_metrics(rel, rel_all.sum(1), ks), rel_all.sum(1)


@pytest.mark.parametrize("num_classes", [3, 60])  # classes of ~100 (sort) and ~5 (compare)
@pytest.mark.parametrize("depth", [None, 7])
def test_exact_metrics_from_positive_ranks_equal_full_sort_with_ties(num_classes, depth):
    rng = np.random.default_rng(num_classes)
    # Integer vectors: many exactly tied scores, across blocks and within positives.
    db = rng.integers(-1, 2, (300, 3)).astype(np.float32)
    db_y = rng.integers(0, num_classes, 300)
    q = rng.integers(-1, 2, (41, 3)).astype(np.float32)
    q_y = rng.integers(0, num_classes + 1, 41)  # label num_classes: a lone query
    exclude = rng.integers(-1, 300, 41)
    ks = (1, 5, 50)
    got, details = retrieval_metrics(q, q_y, db, db_y, ks=ks, exclude=exclude,
                                     map_depth=depth, return_details=True)
    ref, r = _reference_per_query(q, q_y, db, db_y, exclude, depth or 300, ks)
    valid = r > 0
    assert details["lone_queries"] == int((~valid).sum()) > 0
    for k in ks:
        assert got[f"recall@{k}"] == pytest.approx(ref[f"hit@{k}"].mean(), abs=1e-12)
    assert got["precision@1"] == pytest.approx(ref["p@1"][valid].mean(), abs=1e-12)
    assert got["map@r"] == pytest.approx(ref["ap@r"][valid].mean(), abs=1e-12)
    assert got["r_precision"] == pytest.approx(ref["r_prec"][valid].mean(), abs=1e-12)
    assert got["map"] == pytest.approx(ref["ap"][valid].mean(), abs=1e-12)
    np.testing.assert_allclose(details["per_query"]["ap"], ref["ap"], atol=1e-12)


def test_metrics_from_ranks_equal_relevance_matrix_metrics():
    from tfaploss.evaluation.metrics import metrics_from_ranks

    rng = np.random.default_rng(11)
    rel_full = rng.random((30, 40)) < 0.2
    rel_full[3] = False  # a query without positives
    num_relevant = rel_full.sum(1)
    query, ranks = np.nonzero(rel_full)
    for depth in (1, 9, 40):
        want = per_query_metrics(rel_full[:, :depth], num_relevant, (1, 3, 20))
        got = metrics_from_ranks(ranks + 1, query, 30, num_relevant, depth, (1, 3, 20))
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, atol=1e-12, err_msg=f"{key} {depth}")
