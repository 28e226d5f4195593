"""Pair and triplet baselines, ``ContrastiveLoss`` and ``TripletLoss``: TensorFlow
Addons' definitions (which no longer import with Keras 3), without (B, B, B) tensors."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses._checks import integer, one_of
from tfaploss.losses.base import RetrievalLoss
from tfaploss.ops.masks import masked_mean, safe_normalize
from tfaploss.ops.triplet_mining import hinge_sums, semihard_gaps

_MINING = ("semihard", "hard", "all")


def _distances(neg_sq_distances):
    """Euclidean distances from minus the squared distances, with a finite gradient at 0."""
    sq = ops.maximum(-neg_sq_distances, 0.0)
    positive = sq > 0
    return ops.where(positive, ops.sqrt(ops.where(positive, sq, ops.ones_like(sq))),
                     ops.zeros_like(sq))


class _DistanceLoss(RetrievalLoss):
    """Losses on Euclidean distances: ``pairwise`` returns minus the squared distance."""

    def pairwise(self, queries, database):
        if self.normalize:
            queries = safe_normalize(queries)
            database = safe_normalize(database)
        sq_q = ops.sum(ops.square(queries), axis=-1, keepdims=True)
        sq_d = ops.sum(ops.square(database), axis=-1, keepdims=True)
        sq = sq_q + ops.transpose(sq_d) - 2.0 * ops.matmul(queries, ops.transpose(database))
        return -ops.maximum(sq, 0.0)


@keras.saving.register_keras_serializable(package="tfaploss")
class ContrastiveLoss(_DistanceLoss):
    """Contrastive loss (Hadsell, Chopra, LeCun, "Dimensionality Reduction by Learning an
    Invariant Mapping", CVPR 2006), as TF Addons defines it. Over the ordered pairs
    (i, j), j != i, of the batch with Euclidean distance ``d_ij`` between the
    (L2-normalised) embeddings::

        l_ij = d_ij²                      if y_i = y_j
        l_ij = max(margin - d_ij, 0)²     otherwise

    averaged (``averaging``) as

    * ``"pairs"`` (default): the mean of ``l_ij`` over all pairs whose query i has a
      positive (TF Addons' mean). Positive pairs then weigh (m - 1) / (B - 1) of the
      loss with m images per class: 0.15 % at B=2048, m=4
      (``docs/batch_sweep/first_sweep.md``).
    * ``"per_query"``: per query, the mean of ``l_ij`` over its positives plus the
      mean over its negatives, averaged over the queries with a positive: the balance
      does not change with B.

    Cost: O(B²·D) for the distances, O(B²) time and memory.

    Args:
        margin: distance below which negative pairs are penalised.
        averaging: ``"pairs"`` or ``"per_query"``, as above.
{shared_args}
    """

    AVERAGING = ("pairs", "per_query")
    unused_args = ("drop_lone_queries",)  # a lone query forms no pair

    def __init__(self, margin=1.0, averaging="pairs", *, name="contrastive_loss", **kwargs):
        super().__init__(name=name, **kwargs)
        self.averaging = one_of("ContrastiveLoss", "averaging", averaging, self.AVERAGING)
        self.margin = float(margin)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        d = _distances(scores)
        pair = ops.where(positives, ops.square(d), ops.square(ops.relu(self.margin - d)))
        has_positive = ops.cast(self.other_positive_counts(positives, self_pairs) > 0, d.dtype)
        if self.averaging == "per_query":
            # a query is not its own positive pair
            pos = ops.logical_and(self.without_self_pairs(positives, self_pairs), candidates)
            neg = ops.logical_and(candidates, ops.logical_not(positives))
            values = masked_mean(pair, pos, axis=-1) + masked_mean(pair, neg, axis=-1)
            return values, has_positive
        values = masked_mean(pair, candidates, axis=-1)
        return values, ops.sum(ops.cast(candidates, d.dtype), axis=-1) * has_positive


@keras.saving.register_keras_serializable(package="tfaploss")
class TripletLoss(_DistanceLoss):
    """Triplet margin loss (Schroff, Kalenichenko, Philbin, "FaceNet", CVPR 2015) with
    batch mining. With Euclidean distances ``d`` between the (L2-normalised) embeddings and
    ``l(a, p, n) = max(d_ap - d_an + margin, 0)``:

    * ``mining="semihard"`` (TF Addons ``triplet_semihard_loss``): for every positive
      pair (a, p), n is the closest negative FARTHER than p (``d_an > d_ap``); if
      there is none, the farthest negative (TF Addons' choice). Mean over positive
      pairs.
    * ``mining="hard"`` (TF Addons ``triplet_hard_loss``, ``soft=False``): per
      anchor, the farthest positive and the closest negative; mean over anchors.
      Cost: O(B²) time and memory.
    * ``mining="all"``: mean of ``l`` over every valid triplet (a, p, n) ("batch
      all", Hermans et al. 2017, zero-loss triplets included).

    Semihard and all mine over the positive pairs in blocks
    (:mod:`tfaploss.ops.triplet_mining`), never the (B, B, B) tensor: O(B·m·B) time
    (m = largest class in the batch), O(pairs_per_block·B + B²) memory.

    Anchors without a positive or a negative are left out (TF Addons keeps them).

    Args:
        margin: the triplet margin (TF Addons' default 1.0).
        mining: ``"semihard"``, ``"hard"`` or ``"all"``.
        pairs_per_block: positive pairs mined per loop step (None: about 4M / B).
{shared_args}
    """

    unused_args = ("drop_lone_queries",)  # a lone query forms no triplet

    def __init__(self, margin=1.0, mining="semihard", pairs_per_block=None, *,
                 name="triplet_loss", **kwargs):
        super().__init__(name=name, **kwargs)
        self.mining = one_of("TripletLoss", "mining", mining, _MINING)
        self.margin = float(margin)
        self.pairs_per_block = integer("TripletLoss", "pairs_per_block", pairs_per_block,
                                       optional=True)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        d = _distances(scores)
        dtype = d.dtype
        negatives = ops.logical_and(candidates, ops.logical_not(positives))
        # A query ranked against itself is no positive of its own triplets.
        positives = self.without_self_pairs(positives, self_pairs)
        n_pos = ops.sum(ops.cast(positives, dtype), axis=-1)
        n_neg = ops.sum(ops.cast(negatives, dtype), axis=-1)
        valid = ops.cast(ops.logical_and(n_pos > 0, n_neg > 0), dtype)

        if self.mining == "hard":
            inf = ops.full_like(d, float("inf"))
            hardest_pos = ops.max(ops.where(positives, d, -inf), axis=-1)
            hardest_neg = ops.min(ops.where(negatives, d, inf), axis=-1)
            ok = valid > 0
            gap = ops.where(ok, hardest_pos - hardest_neg, ops.zeros_like(hardest_pos))
            return ops.where(ok, ops.relu(gap + self.margin), 0.0), valid

        if self.mining == "all":
            per_pos = hinge_sums(d, positives, negatives, self.margin, self.pairs_per_block)
            n_triplets = n_pos * n_neg
            values = ops.sum(per_pos, axis=-1) / ops.maximum(n_triplets, 1.0)
            return values, n_triplets * valid

        gaps = semihard_gaps(d, positives, negatives, self.pairs_per_block)
        pair_loss = ops.where(positives, ops.relu(self.margin - gaps), ops.zeros_like(d))
        values = ops.sum(pair_loss, axis=-1) / ops.maximum(n_pos, 1.0)
        return values, n_pos * valid
