"""The bfloat16 prefilter of exact search: its bit tricks, its error bound, and that
the top-k it returns is the float32 top-k, on data made to strain each part."""

import logging

import ml_dtypes
import numpy as np
import pytest

from tfaploss.evaluation import bfloat16_prefilter as bp
from tfaploss.evaluation import load_searcher
from tfaploss.evaluation.exact_search import ExactSearcher
from tfaploss.evaluation.exact_topk import exact_topk as fp32_topk

ALL_BITS = np.arange(-(1 << 15), 1 << 15, dtype=np.int32).astype(np.int16)
FINITE_BITS = ALL_BITS[np.isfinite(bp.bfloat16_values(ALL_BITS))]


def _products():
    params = []
    for name in ("torch", "tensorflow"):
        why = bp.choose_product(name)[1]
        params.append(pytest.param(name, marks=pytest.mark.skipif(
            why is not None, reason=str(why))))
    return params


# -- the bits -------------------------------------------------------------------------

def test_rounding_is_to_nearest_even_like_ml_dtypes():
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal(20_000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 20_000),
        # exact halfway cases, both parities, and the edges of the range
        bp.bfloat16_values(FINITE_BITS[::97]) * np.float32(1 + 2.0 ** -8),
        np.array([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, 3.38e38, -3.38e38, 3.4e38],
                 np.float32)]).astype(np.float32)
    expected = x.astype(ml_dtypes.bfloat16).view(np.int16)
    np.testing.assert_array_equal(bp.round_to_bfloat16(x), expected)
    np.testing.assert_array_equal(bp.bfloat16_values(expected),
                                  expected.view(ml_dtypes.bfloat16).astype(np.float32))


def test_keys_order_every_finite_bfloat16_like_its_value():
    values = bp.bfloat16_values(FINITE_BITS)
    keys = bp._keys(FINITE_BITS)
    by_key = np.argsort(keys, kind="stable")
    assert np.all(np.diff(values[by_key]) >= 0)  # -0 sits just below +0: still in order
    np.testing.assert_array_equal(bp._values(keys), values)
    # Positive values: the raw bits already are the keys (the compare's fast path).
    positive = values > 0
    np.testing.assert_array_equal(keys[positive], FINITE_BITS[positive])


@pytest.mark.parametrize("t", [-np.inf, -3.0, -1e-30, -0.0, 0.0, 1e-40, 0.2,
                               0.70703125, 0.7071, 1.0, 5e37])
def test_key_at_most_admits_every_value_at_or_above_the_threshold(t):
    values = bp.bfloat16_values(FINITE_BITS)
    key = bp._key_at_most(np.array([t]))[0]
    keys = bp._keys(FINITE_BITS)
    assert np.all(keys[values >= t] >= key)
    # ... and not much more: at most one bfloat16 step below the threshold.
    below = values[(keys >= key) & (values < t)]
    assert below.size <= 2


# -- the error bound ------------------------------------------------------------------

def test_admission_drops_only_what_cannot_reach_the_kth_score():
    """Below the admission threshold an entry's upper bound a + u'|a| + E is below the
    k-th entry's lower bound lo - u'|lo| - E; just above it, it is not."""
    rng = np.random.default_rng(1)
    lo = np.concatenate([rng.uniform(-2, 2, 2000), [0.0, 1e-30, -1e-30, 0.003, -0.003]])
    bound = 10.0 ** rng.uniform(-8, -1, lo.size)
    adm = bp._admission(lo, bound)
    kth_low = lo - bp._U_OUT * np.abs(lo) - bound

    def high(a):
        return a + bp._U_OUT * np.abs(a) + bound

    step = 1e-7 * (1 + np.abs(adm))
    assert np.all(high(adm - step) < kth_low)
    assert np.all(high(adm + step) >= kth_low)
    assert np.all(np.isneginf(bp._admission(np.array([-np.inf]), np.array([0.1]))))


def _strained_data(rng, n, d, nq):
    """Mixed norms (1e-3 .. 1e3), signs, and exact duplicates of some queries."""
    db = rng.standard_normal((n, d)).astype(np.float32)
    db *= (10.0 ** rng.uniform(-3, 3, (n, 1))).astype(np.float32)
    q = rng.standard_normal((nq, d)).astype(np.float32)
    q *= (10.0 ** rng.uniform(-2, 2, (nq, 1))).astype(np.float32)
    db[rng.integers(0, n, nq // 4)] = q[: nq // 4]
    return db, q


@pytest.mark.parametrize("product", _products())
@pytest.mark.parametrize("d, scale", [(32, 1.0), (131, 1.0), (131, 1e-20)])
def test_the_error_bound_holds_for_every_score(product, d, scale):
    """At scale 1e-20 most products are subnormal in float32 (flushed to zero)."""
    rng = np.random.default_rng(d)
    db, q = _strained_data(rng, 3000, d, 64)
    db, q = db * np.float32(scale), q * np.float32(scale)
    prepared = bp.PreparedDatabase(db, product, database_block=1024)
    bits = bp.round_to_bfloat16(q)
    bound = prepared.error_bounds(q, bp.bfloat16_values(bits))
    handle = prepared.product.from_bits(bits)
    approx = np.concatenate([bp.bfloat16_values(prepared.product.matmul(handle, b))
                             for b in prepared.blocks], axis=1).astype(np.float64)
    exact = q.astype(np.float64) @ db.T.astype(np.float64)
    err = np.abs(approx - exact)
    allowed = bp._U_OUT * np.abs(approx) + bound[:, None]
    assert np.all(err <= allowed)
    # The bound is not vacuous: the worst score uses a fair share of it (with
    # subnormals the flush-to-zero terms dominate, and rarely bite in full).
    assert (err / allowed).max() > (0.1 if scale == 1.0 else 0.01)


def test_the_self_check_rejects_products_that_accumulate_or_round_in_bfloat16():
    class _Emulated:
        name = "emulated"

        def __init__(self, accumulate_in_bfloat16=False, truncate=False):
            self.accumulate, self.truncate = accumulate_in_bfloat16, truncate

        def from_bits(self, bits):
            return bp.bfloat16_values(bits)

        def matmul(self, q, x):
            if self.accumulate:
                out = np.zeros((len(q), len(x)), np.float32)
                for i in range(q.shape[1]):
                    out = bp.bfloat16_values(bp.round_to_bfloat16(out + np.outer(q[:, i], x[:, i])))
            else:
                out = (q @ x.T).astype(np.float32)
            if self.truncate:
                return (out.view(np.uint32) >> np.uint32(16)).astype(np.uint16).view(np.int16)
            return bp.round_to_bfloat16(out)

    assert bp._check_product(_Emulated()) is None
    assert "accumulate" in bp._check_product(_Emulated(accumulate_in_bfloat16=True))
    assert "round to nearest" in bp._check_product(_Emulated(truncate=True))


# -- the top-k ------------------------------------------------------------------------

def _assert_same_topk(got, want):
    """Same scores (to float32 re-scoring), same indices except among scores that
    agree to float32 rounding."""
    (gs, gi), (ws, wi) = got, want
    np.testing.assert_allclose(gs, ws, rtol=1e-5, atol=1e-5 * np.abs(ws).max())
    near = np.abs(gs[:, :, None] - ws[:, None, :]) <= 1e-5 * np.abs(ws).max()
    differ = gi != wi
    # Where the indices differ, the scores there have a near-tie in the other result.
    assert np.all(near.any(axis=2)[differ])
    assert differ.mean() < 0.05


def _clustered(rng, n, d, nq, clusters=50):
    centres = rng.standard_normal((clusters, d)).astype(np.float32)

    def draw(m):
        x = centres[rng.integers(0, clusters, m)] + 0.5 * rng.standard_normal((m, d))
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    return draw(n), draw(nq)


@pytest.mark.parametrize("product", _products())
@pytest.mark.parametrize("case", ["clustered", "strained", "negative", "sorted"])
def test_the_top_k_is_the_float32_top_k(product, case):
    rng = np.random.default_rng(7)
    if case == "clustered":
        db, q = _clustered(rng, 20_000, 64, 300)
    elif case == "strained":
        db, q = _strained_data(rng, 20_000, 48, 300)
    elif case == "negative":  # every score below zero: the keys' slow path
        db, q = _clustered(rng, 20_000, 64, 300)
        db = -np.abs(db)
        q = np.abs(q)
    else:  # a database sorted by score for the first query: every block raises the bar
        db, q = _clustered(rng, 20_000, 64, 300)
        db = db[np.argsort(db @ q[0])]
    prepared = bp.PreparedDatabase(db, product, database_block=2048)
    for k, threads in ((1, 1), (37, 2), (100, 2)):
        got = bp.exact_topk(q, prepared, k, query_block=128, threads=threads)
        _assert_same_topk(got, fp32_topk(q, db, k))


@pytest.mark.parametrize("product", _products())
def test_small_and_ragged_shapes(product):
    rng = np.random.default_rng(3)
    db, q = _clustered(rng, 5000, 40, 70)
    # database smaller than k in a shard, a last partial block, one query
    prepared = bp.PreparedDatabase(db[:150], product, database_block=64)
    _assert_same_topk(bp.exact_topk(q, prepared, 120, query_block=16, threads=2),
                      fp32_topk(q, db[:150], 120))
    prepared = bp.PreparedDatabase(db, product, database_block=1000)
    _assert_same_topk(bp.exact_topk(q[:1], prepared, 10, threads=2), fp32_topk(q[:1], db, 10))


@pytest.mark.parametrize("product", _products())
def test_a_database_of_duplicates_falls_back_to_float32_and_keeps_memory_bounded(
        product, monkeypatch, caplog):
    rng = np.random.default_rng(5)
    row = rng.standard_normal((1, 32)).astype(np.float32)
    db = np.repeat(row, 6000, axis=0)
    db[::7] += 1e-3  # a few rows score differently
    q = rng.standard_normal((20, 32)).astype(np.float32)
    monkeypatch.setattr(bp, "MAX_CANDIDATES", 2000)
    prepared = bp.PreparedDatabase(db, product, database_block=1024)
    with caplog.at_level(logging.INFO, logger=bp.__name__):
        got = bp.exact_topk(q, prepared, 50, query_block=8, threads=1)
    assert "searched in float32" in caplog.text
    want = fp32_topk(q, db, 50)
    np.testing.assert_array_equal(got[1], want[1])  # ties by index, like float32
    np.testing.assert_array_equal(got[0], want[0])


# -- the searcher ---------------------------------------------------------------------

@pytest.mark.parametrize("product", _products())
def test_exact_searcher_with_the_prefilter(product, tmp_path, monkeypatch):
    rng = np.random.default_rng(11)
    db, q = _clustered(rng, 12_000, 64, 200)
    plain = ExactSearcher(db, prefilter="none")
    fast = ExactSearcher(db, prefilter=f"bfloat16-{product}")
    assert fast.resolved_prefilter(len(q)) == product
    assert plain.resolved_prefilter(len(q)) is None
    exclude = np.arange(len(q)) * 3
    got_i, got_s = fast.search(q, 25, exclude=exclude)
    want_i, want_s = plain.search(q, 25, exclude=exclude)
    _assert_same_topk((got_s, got_i), (want_s, want_i))
    assert not np.any(got_i == exclude[:, None])
    restored = load_searcher(fast.serialize(str(tmp_path / "s")))
    assert restored.get_config()["prefilter"] == f"bfloat16-{product}"
    np.testing.assert_array_equal(restored.search(q, 25)[0], fast.search(q, 25)[0])


@pytest.mark.parametrize("product", [p for p in _products() if p.values[0] == "torch"])
def test_overlapping_searches_give_torch_back_its_threads(product):
    """Search A starts, B starts, A ends (torch must stay single-threaded for B), B
    ends (torch gets the count A found)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        first, second = bp._TorchProduct(), bp._TorchProduct()
        a, b = first.one_thread_each(True), second.one_thread_each(True)
        a.__enter__()
        b.__enter__()
        assert torch.get_num_threads() == 1
        a.__exit__(None, None, None)
        assert torch.get_num_threads() == 1
        b.__exit__(None, None, None)
        assert torch.get_num_threads() == 3
        with first.one_thread_each(False):
            assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_auto_leaves_small_searches_in_float32(monkeypatch):
    called = []
    monkeypatch.setattr(bp, "choose_product", lambda only=None: called.append(1) or ("torch", None))
    searcher = ExactSearcher(np.ones((1000, 64), np.float32))
    assert searcher.resolved_prefilter(100) is None
    assert not called  # nothing imported, nothing checked
    assert bp.worthwhile(2000, 300_000, 128)


def test_prefilter_argument_errors(monkeypatch):
    db = np.ones((10, 4), np.float32)
    with pytest.raises(ValueError, match=r"`prefilter`.*'fast'"):
        ExactSearcher(db, prefilter="fast")
    with pytest.raises(ValueError, match=r"runs on the numpy engine; received engine='tensorflow'"):
        ExactSearcher(db, prefilter="bfloat16", engine="tensorflow")
    monkeypatch.setattr(bp, "_cpu_has_bfloat16_units", lambda: False)
    for prefilter in ("bfloat16", "bfloat16-torch", "bfloat16-tensorflow"):
        with pytest.raises(ValueError, match=f"`prefilter='{prefilter}'` cannot run here: "
                                             "the CPU has no bfloat16 matrix units"):
            ExactSearcher(db, prefilter=prefilter)
    assert ExactSearcher(np.ones((10, 64), np.float32)).resolved_prefilter(10**8) is None


@pytest.mark.parametrize("product", _products())
@pytest.mark.parametrize("big", [3.4e38, 1e36, 1e20])
def test_scores_near_float32_range_are_searched_in_float32(monkeypatch, big, product):
    """3.4e38 rounds to infinity in bfloat16; 1e36 and 1e20 stay finite but their
    scores (or norms) could overflow, and the bound assumes none does."""
    prefiltered = []
    real = bp.exact_topk
    monkeypatch.setattr(bp, "exact_topk", lambda *a, **kw: prefiltered.append(1) or real(*a, **kw))
    db = np.ones((300, 8), np.float32)
    db[5] = big
    q = np.full((2, 8), 1e12 if big == 1e20 else 1.0, np.float32)
    searcher = ExactSearcher(db, prefilter=f"bfloat16-{product}")
    with np.errstate(over="ignore"):
        idx, _ = searcher.search(q, 3)
    assert idx[0, 0] == 5 and not prefiltered


# -- prefilter="auto": the cost of the first call -------------------------------------

@pytest.fixture
def round_costs(monkeypatch):
    """Cost constants with round numbers, so that each decision below is derived by
    hand: float32 1e10 multiply-adds/s; the prefilter 2x that with PyTorch, 1.5x with
    TensorFlow; imports 2 s / 7 s; the copy 1e8 database elements/s."""
    monkeypatch.setattr(bp, "FLOAT32_RATE", 1e10)
    monkeypatch.setattr(bp, "PREFILTER_SPEEDUP", {"torch": 2.0, "tensorflow": 1.5})
    monkeypatch.setattr(bp, "IMPORT_SECONDS", {"torch": 2.0, "tensorflow": 7.0})
    monkeypatch.setattr(bp, "COPY_RATE", 1e8)


BOTH = ("torch", "tensorflow")


def test_search_seconds_add_the_one_off_costs_that_are_due(round_costs):
    # 300k x 128 (a copy of 3.84e7 elements: 0.384 s), 500 queries: 1.92e10 multiply-adds.
    args = (500, 300_000, 128)
    assert bp.search_seconds(*args) == pytest.approx(1.92)
    assert bp.search_seconds(*args, "torch") == pytest.approx(0.96)
    assert bp.search_seconds(*args, "torch", copied=False) == pytest.approx(1.344)
    assert bp.search_seconds(*args, "torch", imported=False, copied=False) == \
        pytest.approx(3.344)
    assert bp.search_seconds(*args, "tensorflow", copied=False) == pytest.approx(1.664)


def test_a_cold_product_is_taken_only_by_a_search_that_repays_its_import(round_costs):
    """PyTorch not imported, no copy: 2 + 0.384 + W / 2e10 < W / 1e10 exactly when
    W > 4.768e10 multiply-adds, i.e. more than 1,241.67 queries of 300k x 128."""
    n, d = 300_000, 128
    assert bp.cheapest(1241, n, d, ["torch"]) is None
    assert bp.cheapest(1242, n, d, ["torch"]) == "torch"
    assert bp.cheapest(500, n, d, BOTH) is None  # 3.344 s (torch) against 1.92 s
    assert bp.cheapest(20_000, n, d, BOTH) == "torch"  # 40.8 s against 76.8 s
    # Imported but without its copy: 1.344 s against 1.92 s.
    assert bp.cheapest(500, n, d, BOTH, imported={"torch"}) == "torch"


def test_an_imported_product_wins_a_search_too_small_for_another_import(round_costs):
    n, d = 300_000, 128
    # 500 queries, TensorFlow imported: 0.384 + 1.28 = 1.664 s against float32's 1.92 s
    # and a cold PyTorch's 3.344 s.
    assert bp.cheapest(500, n, d, BOTH, imported={"tensorflow"}) == "tensorflow"
    # 20,000 queries repay PyTorch's import: 40.8 s against TensorFlow's 51.6 s.
    assert bp.cheapest(20_000, n, d, BOTH, imported={"tensorflow"}) == "torch"
    # 150 queries (5.76e9 multiply-adds, above 2^32): 0.384 + 0.384 s for TensorFlow
    # against 0.576 s in float32.
    assert bp.cheapest(150, n, d, BOTH, imported={"tensorflow"}) is None


def test_a_searcher_holding_its_copy_pays_no_one_off_cost(round_costs):
    n, d = 300_000, 128
    # 150 queries: 0.288 s with the copy held against 0.576 s in float32, though
    # neither a cold PyTorch (2.672 s) nor a new copy (0.672 s) would pay.
    assert bp.cheapest(150, n, d, BOTH, held="torch") == "torch"
    assert bp.cheapest(150, n, d, BOTH, imported={"torch"}) is None
    # A TensorFlow copy held: 0.384 s; PyTorch imported but without a copy: 0.672 s.
    assert bp.cheapest(150, n, d, BOTH, imported={"torch"}, held="tensorflow") == \
        "tensorflow"
    # Too small (< 2^32 multiply-adds: 100 queries) or too narrow (D < 32), whatever
    # the costs.
    assert bp.cheapest(100, n, d, BOTH, held="torch") is None
    assert bp.cheapest(150, n, 31, BOTH, held="torch") is None


def _torch_product():
    why = bp._product_support("torch")
    return pytest.mark.skipif(why is not None, reason=str(why))


@_torch_product()
def test_the_searcher_takes_the_path_resolved_prefilter_reports(monkeypatch):
    """The product's state is the decision's input (`_imported`), not unloaded torch.
    Costs: float32 1e7 multiply-adds/s, PyTorch 2x, its import 2 s, the copy of
    4,096 x 64 at 1e6 elements/s 0.262 s. 64 queries (1.68e7 multiply-adds): float32
    1.68 s, PyTorch 0.84 s + the copy + the import if cold; 16 queries: 0.42 s, 0.21 s."""
    monkeypatch.setattr(bp, "_cpu_has_bfloat16_units", lambda: True)
    monkeypatch.setattr(bp, "MIN_WORK", 0)
    monkeypatch.setattr(bp, "FLOAT32_RATE", 1e7)
    monkeypatch.setattr(bp, "PREFILTER_SPEEDUP", {"torch": 2.0, "tensorflow": 1.0})
    monkeypatch.setattr(bp, "IMPORT_SECONDS", {"torch": 2.0, "tensorflow": 7.0})
    monkeypatch.setattr(bp, "COPY_RATE", 1e6)
    imported = set()
    monkeypatch.setattr(bp, "_imported", lambda name: name in imported)
    taken = []
    real = bp.exact_topk
    monkeypatch.setattr(bp, "exact_topk",
                        lambda q, prepared, *a, **kw: taken.append(prepared.product.name)
                        or real(q, prepared, *a, **kw))
    rng = np.random.default_rng(13)
    db, q = _clustered(rng, 4096, 64, 64)
    want = fp32_topk(q, db, 10)

    def search(searcher, queries):
        resolved = searcher.resolved_prefilter(len(queries))
        taken.clear()
        idx, scores = searcher.search(queries, 10)
        assert taken == ([] if resolved is None else [resolved] * len(taken)), resolved
        assert bool(taken) == (resolved is not None)
        _assert_same_topk((scores, idx), tuple(w[:len(queries)] for w in want))
        return resolved

    searcher = ExactSearcher(db)
    assert search(searcher, q) is None  # cold: 3.1 s against 1.68 s
    assert searcher._prepared is None
    imported.add("torch")
    assert search(searcher, q[:16]) is None  # no copy: 0.47 s against 0.42 s
    assert search(searcher, q) == "torch"  # 1.1 s against 1.68 s: the copy is made
    imported.clear()  # a searcher holding its copy has its product imported
    assert search(searcher, q[:16]) == "torch"  # 0.21 s against 0.42 s


@_torch_product()
def test_the_copy_is_the_same_made_in_one_thread_or_two():
    rng = np.random.default_rng(17)
    db, _ = _strained_data(rng, 5000, 40, 8)
    one = bp.PreparedDatabase(db, "torch", database_block=512, threads=1)
    two = bp.PreparedDatabase(db, "torch", database_block=512, threads=2)
    assert (one.max_dx, one.max_x, one.max_xr) == (two.max_dx, two.max_x, two.max_xr)
    assert one.max_x == pytest.approx(np.linalg.norm(db.astype(np.float64), axis=1).max())
    bits = np.concatenate([b.view(one.product.torch.int16).numpy() for b in two.blocks])
    np.testing.assert_array_equal(bits, bp.round_to_bfloat16(db))
