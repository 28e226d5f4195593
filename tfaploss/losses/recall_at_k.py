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
    Large Batches and Similarity Mixup", CVPR 2022), optionally with SiMix.

    For query i, each positive p (the query itself is never its own positive) and
    ``s`` the cosine scores:

        rank(i,p) = 1 + sum_{j in C_i, j != p} sig(s_ij - s_ip ; tau1)
        R@k_i     = min(k, sum_{p in P_i} sig(k - rank(i,p) ; tau2_k)) / min(k, |P_i|)
        l_i       = 1 - mean_{k in K} R@k_i,      L = mean_i l_i

    with ``sig(t; tau) = sigmoid(clip(t / tau, -50, 50))`` (the authors' clipped
    sigmoid) and ``K = k`` (paper: {1, 2, 4, 8, 16}). ``C_i`` holds every item of the
    batch, the query itself included (``include_self=True``, default): the authors'
    code ranks each positive against all B items, so the query's own score
    ``s_ii`` counts in its positives' ranks (about +1 with normalised embeddings);
    ``include_self=False`` leaves the query out (the rest of the batch is its
    database). Each ``k`` is
    clipped to the batch size (``min(k, B)``) and the numerator is capped at ``k``,
    not at 1, as in the code.

    Matches the authors' ``RecallatK`` (github.com/yash0307/RecallatK_surrogate,
    ``src/losses.py``, commit ed05202 of 2024-11-04), in float64 to 1e-9 (loss and
    gradient, ``tests/goldens/recall_at_k.json``). Differences: their code needs
    contiguous equal-size class blocks (``samples_per_class``); here labels may come in
    any order and classes in any size. A query without another item of its class gives
    0/0 = NaN there; here it is left out of the mean (weight 0). Their loop divides each
    query's term by B and sums: the default reduction's mean over the queries.

    ``tau2=1.0`` (default) is the paper's and the current code's setting;
    ``tau2=[1, 2, 4, 8, 16]`` reproduces the 2022-2024 code (``docs/losses.md``).

    SiMix (``simix=True``; the authors' ``src/mixup.py`` ``pos_mixup``
    and its use in ``src/main.py``): after L2 normalisation, for every pair (a, b) of
    same-class items ``alpha · x_a + (1 - alpha) · x_b`` with ``alpha ~ U(0, 1)`` drawn
    per pair is appended to the batch, with their class's label, NOT re-normalised.
    Mixed items are both database items and queries (the authors loop over every row of
    the mixed batch; each row is a query, a positive of its class and a negative of the
    others); the loss is the mean over all B + F queries. Pairs: the items are sorted by
    label and cut into groups of ``simix_group`` (the authors' m = 4 images per class:
    each class is one group, and its 6 pairs are the authors' 6); each group contributes
    all its g(g-1)/2 pairs, so F = ceil(B/g)·g(g-1)/2 (1.5·B for g = 4). A group that
    straddles two classes keeps only its same-class pairs. The authors draw ``alpha``
    with ``np.random.uniform``; here it is a stateless hash of ``seed``, the pair and
    the batch (:func:`tfaploss.ops.recall_rank.simix_coefficients`), the same on every
    backend and trainer (Keras's JAX ``fit`` carries no loss state; a ``SeedGenerator``
    would repeat its first draw there), new at every step as the batch or the network
    changes, and the same for the same seed and batch (:meth:`simix_coefficients`
    returns them). Rounding the embeddings to a grid makes a chunked forward pass
    (:class:`~tfaploss.training.MultiStageModel`) draw what a single pass draws unless
    an embedding lies within rounding error of a grid line (likely only once B·D is in
    the millions; the step then uses other, equally random coefficients, its gradient
    exact for them). :meth:`mixed_loss` takes explicit coefficients. The mixing is on the
    embeddings, so :class:`~tfaploss.training.MultiStageModel` backpropagates it exactly.
    ``sample_weight`` (B,) is extended to the mixed items as the mean of their two
    sources' weights; ``reduction="none"`` returns B + F terms.

    Cost: O(B·m·B) time (m = largest class; only positive pairs are ranked, in blocks,
    with a hand-written gradient, :mod:`tfaploss.ops.recall_rank`; the K values of k add
    O(K·B²)) and O(pairs_per_block·B + B²) memory; never a B×B×B tensor. The B² part is
    the score matrix and the block bookkeeping, ~0.1 KB per pair (i, j) at its peak.
    SiMix multiplies B by 1 + (g-1)/2 (2.5 for g = 4), so memory by ~6.
    ``docs/losses.md`` has measured times and memory.

    Args:
        k: the k values, positive ints (paper: (1, 2, 4, 8, 16)).
        tau1: temperature of the rank sigmoid (paper: 0.01).
        tau2: temperature of the "rank <= k" sigmoid: one number for every k
            (paper, current code: 1.0) or one per k (2022-2024 code: equal to k).
        include_self: the query counts in its positives' ranks (authors' code, default);
            never as its own positive.
        normalize: L2-normalise the embeddings first (the authors' network does).
        simix: add SiMix's mixed embeddings (above) to every call.
        simix_group: items per SiMix group (the sampler's images per class; >= 2).
        seed: int folded into the SiMix coefficients' hash (None: a random one, from
            Python's ``random``, which ``keras.utils.set_random_seed`` seeds).
{shared_args}

    Example:

    ```python
    loss = tfaploss.losses.RecallAtKLoss(k=(1, 2, 4, 8, 16), simix=True)
    model.compile(optimizer="adam", loss=loss)  # batches of 4 images per class
    ```
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
        # seed=None: a random one, from Python's generator (keras.utils.set_random_seed
        # seeds it).
        self._simix_seed = self.seed if self.seed is not None else random.getrandbits(32)

    # -- the loss ---------------------------------------------------------------------

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
        """The reduced loss on the batch plus its SiMix embeddings.

        ``alphas`` (F,): the mixing coefficients (None: the loss's own,
        :func:`tfaploss.ops.recall_rank.simix_coefficients` of its seed and the batch). ``first``, ``second`` (F,): the batch indices of each pair (None:
        the loss's own pairs, :func:`tfaploss.ops.recall_rank.simix_pairs`); a pair of
        two classes is left out. Works whatever ``simix`` is. Cost: that of the loss on
        B + F items.
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
        finite, (y_pred,) = finite_or_zero(y_pred)
        x = safe_normalize(y_pred) if self.normalize else y_pred
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

    def simix_coefficients(self, y_true, y_pred):
        """The coefficients (F,) that a call on this batch mixes its pairs with (pair f
        of :func:`tfaploss.ops.recall_rank.simix_pairs` weighs its first item by the
        f-th), whatever ``simix`` is. Cost: O(B·D)."""
        labels, y_pred = self._rows(check_labels(y_true), y_pred)
        if labels.shape[0] is None:
            raise ValueError(f"{type(self).__name__}: SiMix needs a batch of static size.")
        first, _, _ = simix_pairs(labels, self.simix_group)
        _, (y_pred,) = finite_or_zero(y_pred)
        x = safe_normalize(y_pred) if self.normalize else y_pred
        return simix_coefficients(x, labels, int(first.shape[0]), self._simix_seed, x.dtype)
