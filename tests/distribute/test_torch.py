"""Ranking losses under ``torch.distributed``: 4 ranks give the steps of one process.

The layout of tests/distribute/test_tf.py: 64 items, 16 classes, each of 4 ranks'
shards holds one item of every class, so ranking each shard on its own gives loss 0.
This process computes the one-process references first; then one launch of 4 local
processes (gloo on 127.0.0.1), forked from it so that none imports Keras or warms it up
again, runs every scenario and saves its results, and the tests compare them:

* a DistributedDataParallel loop (torch.optim.SGD) around a Keras model;
* ``MultiStageModel.fit`` on each rank's shard;
* the all-gather's gradient, and the loss's value and gradient on unequal shards for
  every reduction;
* a loss that cannot gather raises.

The ranks start from different weights: rank 0's reach the others by DDP's broadcast
and MultiStageModel's, which the equality with one process then checks too.

PyTorch backend only (``make test-torch``).
"""

import multiprocessing
import socket
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import keras
import numpy as np
import pytest

if keras.backend.backend() != "torch":
    pytest.skip("torch.distributed: KERAS_BACKEND=torch only", allow_module_level=True)

import torch
import torch.distributed as dist

from tests.support.shard_layout import CLASSES, DIM, dense_model, layout
from tfaploss.losses import APLoss, HAPLoss, ProxyAnchorLoss, SmoothAPLoss
from tfaploss.ops import distribute_torch
from tfaploss.training import MultiStageModel

RANKS = 4
BATCH = RANKS * CLASSES
STEPS = 3
# Shards of the loss-level scenario: unequal, so the gather pads.
BOUNDS = [0, 17, 33, 49, BATCH]
REDUCTIONS = ["sum_over_batch_size", "mean_with_sample_weight", "sum", "none"]
LOSSES = {"ap": APLoss, "smooth_ap": SmoothAPLoss}
# Multi-stage scenarios: loss, reduction, with sample_weight.
MULTISTAGE = {"ap": ("ap", "sum_over_batch_size", False),
              "smooth_ap": ("smooth_ap", "sum_over_batch_size", False),
              "smooth_ap_sum_weighted": ("smooth_ap", "sum", True),
              # the proxies: a layer of every rank's model, averaged like any weight
              "proxy_anchor_weighted": ("proxy_anchor", "sum_over_batch_size", True)}
WORKER_TIMEOUT_S = 120


def _data(seed=0):
    return layout(RANKS, seed)  # rank r: rows 16r..16r+15


def _weight():
    return np.linspace(0.2, 2.0, BATCH).astype("float32")


_model = dense_model


def _shard(array, rank):
    return array[rank * CLASSES:(rank + 1) * CLASSES]


def _ddp_steps(loss, x, y, ddp=False, seed=1):
    """Per-step losses and final weights of STEPS torch.optim.SGD steps."""
    model = _model(seed)
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        value = loss(y, net(x))
        value.backward()
        optimizer.step()
        losses.append(float(value.detach()))
    return np.array(losses), model.get_weights()


def _multistage_fit(name, x, y, sample_weight=None, seed=1):
    loss_name, reduction, _ = MULTISTAGE[name]
    learning_rate = 0.5 / BATCH if reduction == "sum" else 0.5
    model = _model(seed)
    if loss_name == "proxy_anchor":
        loss = ProxyAnchorLoss(CLASSES, alpha=8.0, reduction=reduction)
        model = loss.with_proxies(model)
        # different on every rank: rank 0's reach the others by the first broadcast
        model.get_layer("class_proxies").set_proxies(
            np.random.default_rng(seed).normal(size=(CLASSES, DIM)))
    else:
        loss = LOSSES[loss_name](reduction=reduction)
    trainer = MultiStageModel(model, chunk_size=8)
    trainer.compile(optimizer=keras.optimizers.SGD(learning_rate), loss=loss)
    history = trainer.fit(x, y, sample_weight=sample_weight, batch_size=len(x),
                          epochs=STEPS, shuffle=False, verbose=0)
    return np.array(history.history["loss"]), model.get_weights()


def _loss_value_and_grad(reduction, labels, embeddings, weight):
    """Value and embedding gradient of APLoss (a sum of the terms for "none")."""
    embeddings = torch.tensor(embeddings, requires_grad=True)
    value = APLoss(reduction=reduction)(labels, embeddings, sample_weight=weight)
    (value.sum() if reduction == "none" else value).backward()
    return value.detach().numpy(), embeddings.grad.numpy()


def _loss_inputs():
    _, y = _data(seed=3)
    embeddings = np.random.default_rng(4).normal(size=(BATCH, DIM)).astype("float32")
    return y, embeddings, np.linspace(0.5, 1.5, BATCH).astype("float32")


def _gather_coefficients(rank):
    return np.random.default_rng(10 + rank).normal(size=(BATCH, DIM)).astype("float32")


# -- the ranks ---------------------------------------------------------------------


def _rank_scenarios(rank):
    out = {}
    x, y = _data()
    seed = 1 + 100 * rank  # rank 0's initial weights must reach every rank
    for name, loss in LOSSES.items():
        losses, weights = _ddp_steps(loss(), _shard(x, rank), _shard(y, rank), ddp=True,
                                     seed=seed)
        out[f"ddp_{name}_losses"] = losses
        out.update({f"ddp_{name}_w{i}": w for i, w in enumerate(weights)})
    for name, (_, _, weighted) in MULTISTAGE.items():
        weight = _shard(_weight(), rank) if weighted else None
        losses, weights = _multistage_fit(name, _shard(x, rank), _shard(y, rank), weight,
                                          seed=seed)
        out[f"multistage_{name}_losses"] = losses
        out.update({f"multistage_{name}_w{i}": w for i, w in enumerate(weights)})

    a, b = BOUNDS[rank], BOUNDS[rank + 1]
    rows = torch.tensor(_loss_inputs()[1][a:b], requires_grad=True)
    gathered = distribute_torch.gather_rows(rows)
    # A different function of the gathered rows on every rank: the rows' gradient is
    # the sum over ranks of theirs.
    torch.sum(gathered * torch.tensor(_gather_coefficients(rank))).backward()
    out["gather_value"] = gathered.detach().numpy()
    out["gather_grad"] = rows.grad.numpy()

    labels, embeddings, weight = _loss_inputs()
    for reduction in REDUCTIONS:
        value, grad = _loss_value_and_grad(reduction, labels[a:b], embeddings[a:b],
                                           weight[a:b])
        out[f"loss_{reduction}_value"], out[f"loss_{reduction}_grad"] = value, grad

    hierarchy = np.stack([y, y // 4], axis=1)
    try:
        HAPLoss()(_shard(hierarchy, rank), _shard(x, rank)[:, :DIM])
        out["unsupported_error"] = np.array("no error")
    except ValueError as error:
        out["unsupported_error"] = np.array(str(error))
    return out


def _rank_main(rank, port, folder):
    """One rank: every scenario, results saved to ``folder``/rank<r>.npz (or .error)."""
    folder = Path(folder)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=RANKS, timeout=timedelta(seconds=WORKER_TIMEOUT_S))
        try:
            np.savez(folder / f"rank{rank}.npz", **_rank_scenarios(rank))
        finally:
            dist.destroy_process_group()
    except BaseException:
        (folder / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the one-process references and the comparisons ----------------------------------


def _references():
    out = {}
    x, y = _data()
    for name, loss in LOSSES.items():
        out[f"ddp_{name}"] = _ddp_steps(loss(), x, y)
    for name, (_, _, weighted) in MULTISTAGE.items():
        out[f"multistage_{name}"] = _multistage_fit(name, x, y, _weight() if weighted else None)
    labels, embeddings, weight = _loss_inputs()
    out["loss"] = {r: _loss_value_and_grad(r, labels, embeddings, weight) for r in REDUCTIONS}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "no positive pair": expected
        out["shard_losses"] = [float(APLoss()(_shard(y, r), _model()(_shard(x, r))))
                               for r in range(RANKS)]
        out["unweighted_sum"] = float(SmoothAPLoss(reduction="sum")(y, _model()(x)))
    return out


@pytest.fixture(scope="module")
def runs():
    """(per-rank results, one-process references), from one launch of RANKS processes."""
    assert not dist.is_initialized()
    context = multiprocessing.get_context("fork")
    threads = torch.get_num_threads()
    # One intra-op thread here and in the ranks: no thread pool for a fork to break, and
    # five processes share the cores anyway.
    torch.set_num_threads(1)
    try:
        # First, so that the forked ranks inherit a warmed-up Keras (seconds per rank).
        references = _references()
    finally:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as folder:
        port = _free_port()
        ranks = [context.Process(target=_rank_main, args=(r, port, folder), daemon=True)
                 for r in range(RANKS)]
        try:
            for process in ranks:
                process.start()
            deadline = time.monotonic() + WORKER_TIMEOUT_S
            # A rank that fails leaves the others waiting in a collective: stop them all.
            while (any(p.is_alive() for p in ranks) and time.monotonic() < deadline
                   and not any(p.exitcode for p in ranks)):
                time.sleep(0.05)
        finally:
            for process in ranks:
                if process.is_alive():
                    process.kill()
                    process.join(5)
        errors = sorted(Path(folder).glob("rank*.error"))
        if errors:
            pytest.fail("a rank failed:\n" + errors[0].read_text())
        results = []
        for r, process in enumerate(ranks):
            path = Path(folder) / f"rank{r}.npz"
            if not path.exists():
                pytest.fail(f"rank {r} left no results (exit code {process.exitcode}; "
                            f"killed after {WORKER_TIMEOUT_S} s if None or negative)")
            with np.load(path) as saved:
                results.append(dict(saved))
    return results, references


def _weights(saved, prefix):
    count = sum(1 for key in saved if key.startswith(f"{prefix}_w"))
    return [saved[f"{prefix}_w{i}"] for i in range(count)]


def test_no_shard_holds_a_positive_pair(runs):
    _, references = runs
    assert references["shard_losses"] == [0.0] * RANKS  # per-rank ranking: no loss
    assert references["ddp_ap"][0][0] > 0.1


def _assert_ranks_took_the_reference_steps(runs, key):
    """Every rank's losses and weights equal the one-process run ``key``, which trains."""
    results, references = runs
    expected_losses, expected = references[key]
    assert np.all(expected_losses > 0.05)
    initial = _model().get_weights()
    assert max(np.abs(e - i).max() for e, i in zip(expected, initial)) > 1e-3  # it trains
    for saved in results:
        assert len(_weights(saved, key)) == len(expected)
        np.testing.assert_allclose(saved[f"{key}_losses"], expected_losses, rtol=1e-5)
        for w, e in zip(_weights(saved, key), expected):
            np.testing.assert_allclose(w, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_ddp_loop_gives_the_steps_of_one_process(loss_name, runs):
    _assert_ranks_took_the_reference_steps(runs, f"ddp_{loss_name}")


@pytest.mark.parametrize("name", list(MULTISTAGE))
def test_multistage_fit_on_shards_gives_the_steps_of_one_process(name, runs):
    _assert_ranks_took_the_reference_steps(runs, f"multistage_{name}")


def test_multistage_honours_sample_weight(runs):
    _, references = runs
    weighted, _ = references["multistage_smooth_ap_sum_weighted"]
    assert abs(references["unweighted_sum"] - weighted[0]) > 1e-2  # the weights count


def test_gather_sums_the_ranks_gradients_of_each_rows(runs):
    results, _ = runs
    embeddings = _loss_inputs()[1]
    expected_grad = sum(_gather_coefficients(r) for r in range(RANKS))
    for r, saved in enumerate(results):
        np.testing.assert_array_equal(saved["gather_value"], embeddings)
        a, b = BOUNDS[r], BOUNDS[r + 1]
        np.testing.assert_allclose(saved["gather_grad"], expected_grad[a:b], rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_unequal_shards_give_the_one_process_loss_and_gradient(reduction, runs):
    """Every rank returns the global loss and W times its rows' one-process gradient
    (which DDP's average of the parameter gradients divides by W); for "none" its rows
    of the terms, whose sum has the one-process gradient of the sum of the terms."""
    results, references = runs
    expected_value, expected_grad = references["loss"][reduction]
    assert np.abs(expected_grad).max() > 1e-3
    scale = 1 if reduction == "none" else RANKS
    for r, saved in enumerate(results):
        a, b = BOUNDS[r], BOUNDS[r + 1]
        value, grad = saved[f"loss_{reduction}_value"], saved[f"loss_{reduction}_grad"]
        if reduction == "none":
            np.testing.assert_allclose(value, expected_value[a:b], rtol=1e-5, atol=1e-7)
        else:
            assert float(expected_value) > 0.1
            np.testing.assert_allclose(value, expected_value, rtol=1e-5)
        np.testing.assert_allclose(grad, scale * expected_grad[a:b], rtol=1e-4, atol=1e-6)


def test_a_loss_with_its_own_call_refuses_to_rank_per_shard(runs):
    results, _ = runs
    for saved in results:
        message = str(saved["unsupported_error"])
        assert message.startswith("HAPLoss: its own __call__"), message
        assert "torch.distributed (4 ranks)" in message and "MultiStageModel" in message
