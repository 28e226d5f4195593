"""Recall@k surrogate loss (RS@k) with Similarity Mixup (SiMix), after Patel, Tolias,
Matas, "Recall@k Surrogate Loss with Large Batches and Similarity Mixup", CVPR 2022."""

from __future__ import annotations

import random

import keras
from keras import ops

from tfaploss.losses._checks import (
    check,
    check_labels,
    finite_or_zero,
    integer,
    is_int,
    is_number,
    positive_ints,
    positive_number,
)
from tfaploss.losses.base import RetrievalLoss
from tfaploss.ops.masks import label_masks, safe_normalize, self_pair_mask
from tfaploss.ops.recall_rank import (
    recall_at_k_per_query,
    simix_coefficients,
    simix_mix,
    simix_pairs,
)


@keras.saving.register_keras_serializable(package="tfaploss")
class RecallAtKLoss(RetrievalLoss):
    """Recall@k surrogate RS@k (Patel, Tolias, Matas, "Recall@k Surrogate Loss with
    Large Batches and Similarity Mixup", CVPR 2022), optionally with SiMix. For query i,
    each positive p (the query itself is never its own positive) and
    ``s`` the cosine scores:

        rank(i,p) = 1 + sum_{j in C_i, j != p} sig(s_ij - s_ip ; tau1)
        R@k_i     = min(k, sum_{p in P_i} sig(k - rank(i,p) ; tau2_k)) / min(k, |P_i|)
        l_i       = 1 - mean_{k in K} R@k_i,      L = mean_i l_i

    with ``sig(t; tau) = sigmoid(clip(t / tau, -50, 50))`` and ``K = k``. ``C_i``
    holds every item of the batch, the query itself included with ``include_self=True``
    (default; the authors' code, so ``s_ii`` counts in its positives' ranks). Each ``k``
    is clipped to the batch size and the numerator is capped at ``k``, as in the code.

    Matches the authors' ``RecallatK`` (github.com/yash0307/RecallatK_surrogate,
    ``src/losses.py``, commit ed05202 of 2024-11-04) in float64 to 1e-9 (loss and
    gradient, ``tests/goldens/recall_at_k.json``), but labels may come in any order and
    classes in any size, and a query without another item of its class is left out
    (0/0 = NaN there). ``tau2=[1, 2, 4, 8, 16]`` reproduces the 2022-2024 code.

    SiMix (``simix=True``; the authors' ``pos_mixup``): after L2 normalisation, for
    every pair (a, b) of same-class items ``alpha · x_a + (1 - alpha) · x_b``,
    ``alpha ~ U(0, 1)`` per pair, is appended to the batch with their label, not
    re-normalised; mixed items are queries and database items, and the loss is the
    mean over all B + F queries. Pairs: every pair within each group of
    ``simix_group`` items in label order, F = ceil(B/g)·g(g-1)/2 (1.5·B for g = 4).
    ``alpha`` is a stateless hash of ``seed`` and the batch
    (:meth:`simix_coefficients`); :meth:`mixed_loss` takes explicit ones. A mixed
    item weighs its sources' mean ``sample_weight``; ``reduction="none"`` returns
    B + F terms. ``docs/losses.md`` ("SiMix") has the details.

    Cost: O(B·m·B) time (m = largest class; the K values of k add O(K·B²)) and
    O(pairs_per_block·B + B²) memory, ~0.1 KB per pair (i, j) at its peak; never a
    B×B×B tensor. SiMix multiplies B by 1 + (g-1)/2 (2.5 for g = 4), memory by ~6
    (measurements: ``docs/losses.md``).

    Args:
        k: the k values, positive ints (paper: (1, 2, 4, 8, 16)).
        tau1: temperature of the rank sigmoid (paper: 0.01).
        tau2: temperature of the "rank <= k" sigmoid: one number for every k
            (paper, current code: 1.0) or one per k (2022-2024 code: equal to k).
        include_self: the query counts in its positives' ranks (authors' code, default);
            never as its own positive.
        simix: add SiMix's mixed embeddings (above) to every call.
        simix_group: items per SiMix group (the sampler's images per class; >= 2).
        seed: int folded into the SiMix coefficients' hash (None: a random one, from
            Python's ``random``, which ``keras.utils.set_random_seed`` seeds).
{shared_args}
    """

    def __init__(self, k=(1, 2, 4, 8, 16), tau1=0.01, tau2=1.0, include_self=True,
                 simix=False, simix_group=4, seed=None, pairs_per_block=None,
                 *, name="recall_at_k_loss", **kwargs):
        super().__init__(include_self=include_self, name=name, **kwargs)
        owner = "RecallAtKLoss"
        self.k = positive_ints(owner, "k", k)
        self.tau1 = positive_number(owner, "tau1", tau1)
        per_k = isinstance(tau2, (list, tuple))
        temps = tuple(tau2) if per_k else (tau2,) * len(self.k)
        check(owner, "tau2", tau2, len(temps) == len(self.k) and all(
            is_number(t) and t > 0 for t in temps),
            f"a number > 0 or one number > 0 per k ({len(self.k)} of them)")
        self._tau2_per_k = tuple(float(t) for t in temps)
        self.tau2 = list(self._tau2_per_k) if per_k else float(tau2)
        self.simix = check(owner, "simix", simix, isinstance(simix, bool), "True or False")
        self.simix_group = integer(owner, "simix_group", simix_group, low=2)
        self.seed = None if seed is None else int(
            check(owner, "seed", seed, is_int(seed), "an int or None"))
        self.pairs_per_block = integer(owner, "pairs_per_block", pairs_per_block,
                                       optional=True)
        self._k_limit = None
        self._simix_seed = self.seed if self.seed is not None else random.getrandbits(32)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        positives = self.without_self_pairs(positives, self_pairs)
        recall, counts = recall_at_k_per_query(scores, positives, candidates, self.k,
                                               self.tau1, self._tau2_per_k, self._k_limit,
                                               self.pairs_per_block)
        return 1.0 - recall, ops.cast(counts > 0, recall.dtype)

    @property
    def gathers_global_batch(self):
        # SiMix's F mixed queries have no replica's rows to return ("none"); under a
        # strategy MultiStageModel gathers the batch itself.
        return not self.simix

    def _weighted_terms(self, labels, embeddings, sample_weight):
        if not self.simix:
            return super()._weighted_terms(labels, embeddings, sample_weight)
        return self._mixed_weighted_terms(labels, embeddings, sample_weight)

    def call(self, y_true, y_pred):
        if not self.simix:
            return super().call(y_true, y_pred)
        return self._mixed_terms(check_labels(y_true), y_pred)[0]

    def mixed_loss(self, y_true, y_pred, alphas=None, first=None, second=None,
                   sample_weight=None):
        """The reduced loss on the batch plus its SiMix embeddings, whatever ``simix``.

        ``alphas`` (F,): the mixing coefficients (None: the loss's own). ``first``,
        ``second`` (F,): the batch indices of each pair (None: the loss's own pairs,
        :func:`tfaploss.ops.recall_rank.simix_pairs`); a pair of two classes is left
        out. Cost: that of the loss on B + F items.
        """
        with keras.name_scope(self.name):
            terms, sample_weight = self._mixed_weighted_terms(
                check_labels(y_true), y_pred, sample_weight, alphas, first, second)
        return self._reduce(terms, sample_weight)

    def _mixed_weighted_terms(self, labels, y_pred, sample_weight, alphas=None,
                              first=None, second=None):
        """The B + F terms and their checked weights (sources' mean for mixed items)."""
        terms, first, second = self._mixed_terms(labels, y_pred, alphas, first, second)
        weights = self._row_weights(sample_weight, labels, "batch item")
        if weights is not None:  # a mixed item weighs its sources' mean
            weights = ops.concatenate([weights, 0.5 * (ops.take(weights, first, axis=0)
                                                       + ops.take(weights, second, axis=0))])
        return terms, self._check_sample_weight(weights, terms)

    def _mixed_terms(self, labels, y_pred, alphas=None, first=None, second=None):
        owner = type(self).__name__
        labels, y_pred = self._rows(labels, y_pred)
        n = labels.shape[0]
        if n is None:
            raise ValueError(f"{owner}: SiMix needs a batch of static size (the number of "
                             "mixed embeddings is fixed when the step is traced).")
        n = int(n)
        if first is None and second is None:
            first, second, valid = simix_pairs(labels, self.simix_group)
        elif first is None or second is None:
            raise ValueError(f"{owner}: pass both first and second (the pairs' batch "
                             f"indices) or neither; received first={first!r}, "
                             f"second={second!r}.")
        else:
            first = ops.convert_to_tensor(first, "int32")
            second = ops.convert_to_tensor(second, "int32")
            if len(first.shape) != 1 or tuple(first.shape) != tuple(second.shape):
                raise ValueError(f"{owner}: first and second must be 1-D index arrays of "
                                 f"one length; received shapes {tuple(first.shape)} and "
                                 f"{tuple(second.shape)}.")
            valid = ops.equal(ops.take(labels, first, axis=0),
                              ops.take(labels, second, axis=0))
        num_mixed = int(first.shape[0])
        finite, x = self._normalized(y_pred)
        if alphas is None:
            alphas = simix_coefficients(x, labels, num_mixed, self._simix_seed, x.dtype)
        else:
            alphas = ops.convert_to_tensor(alphas, self.dtype)
            if tuple(alphas.shape) != (num_mixed,):
                raise ValueError(f"{owner}: alphas must hold one coefficient per pair, "
                                 f"shape ({num_mixed},); received shape "
                                 f"{tuple(alphas.shape)}.")
        items = ops.concatenate([x, simix_mix(x, alphas, first, second)], axis=0)
        item_labels = ops.concatenate([labels, ops.take(labels, first, axis=0)], axis=0)
        # Mixed items are compared by dot products: re-normalising would undo SiMix.
        scores = ops.matmul(items, ops.transpose(items))
        positives, candidates = label_masks(item_labels, item_labels,
                                            exclude_self=not self.include_self)
        used = ops.concatenate([ops.ones((n,), "bool"), valid], axis=0)
        both = ops.logical_and(used[:, None], used[None, :])
        candidates = ops.logical_and(candidates, both)
        positives = ops.logical_and(positives, both)
        self_pairs = self_pair_mask(n + num_mixed) if self.include_self else None
        # The authors clip k to the real batch size, not the mixed one.
        self._k_limit = n
        try:
            terms = self._query_terms(finite, scores, positives, candidates, self_pairs)
        finally:
            self._k_limit = None
        return terms, first, second

    def _normalized(self, y_pred):
        finite, (y_pred,) = finite_or_zero(y_pred)
        return finite, safe_normalize(y_pred) if self.normalize else y_pred

    def simix_coefficients(self, y_true, y_pred):
        """The coefficients (F,) that a call on this batch mixes its pairs with (pair f
        of :func:`tfaploss.ops.recall_rank.simix_pairs` weighs its first item by the
        f-th). Cost: O(B·D)."""
        labels, y_pred = self._rows(check_labels(y_true), y_pred)
        if labels.shape[0] is None:
            raise ValueError(f"{type(self).__name__}: SiMix needs a batch of static size.")
        first, _, _ = simix_pairs(labels, self.simix_group)
        _, x = self._normalized(y_pred)
        return simix_coefficients(x, labels, int(first.shape[0]), self._simix_seed, x.dtype)
