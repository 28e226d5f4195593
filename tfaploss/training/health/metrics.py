"""Batch health as Keras metrics: three cheap statistics of the training batch that
show a run which has collapsed or stopped learning.

* ``emb_cos``: mean cosine between the embeddings of different images of the batch
  (1 = every image at the same point; a trained model sits far below);
* ``emb_cos_std``: their spread (0 = no structure left to rank by);
* ``chance_ap``: fraction of queries (with a positive) whose AP does not beat the
  expected AP of a random ranking of the batch; ties count against the query, so
  identical embeddings give 1, random ones about one half, a trained model near 0.

``compile(metrics=health_metrics())`` logs them, in plain ``model.fit`` and in
:class:`~tfaploss.training.MultiStageModel`. Cost per step: with ``Q = min(B,
max_queries)`` query rows, one Q x B x d product per metric and, for ``chance_ap``, a
Q x B sort; O(Q·B) memory.
"""

from __future__ import annotations

import math

import keras
from keras import ops

__all__ = ["BatchHealthMetric", "batch_health", "chance_ap_fraction", "cosine_stats",
           "health_metrics", "random_ranking_ap"]

DEFAULT_MAX_QUERIES = 256
# Cosines are in [-1, 1]: a positive tied with a negative is ranked below it.
_TIE_EPS = 1e-6


def _scores(embeddings, labels, max_queries):
    """Cosines of the first ``max_queries`` rows against the batch, and the masks."""
    e = ops.cast(embeddings, "float32")
    e = e / ops.sqrt(ops.maximum(ops.sum(e * e, axis=-1, keepdims=True), 1e-24))
    if len(labels.shape) == 2 and labels.shape[-1] not in (None, 1):
        labels = labels[:, 0]  # (B, levels) labels (HAPLoss): the finest level
    labels = ops.reshape(labels, (-1,))
    q, q_labels = e[:max_queries], labels[:max_queries]
    scores = ops.matmul(q, ops.transpose(e))
    rows = ops.arange(ops.shape(scores)[0])
    cols = ops.arange(ops.shape(scores)[1])
    others = ops.not_equal(ops.expand_dims(rows, 1), ops.expand_dims(cols, 0))
    positives = ops.logical_and(
        ops.equal(ops.expand_dims(q_labels, 1), ops.expand_dims(labels, 0)), others)
    return scores, others, positives


def cosine_stats(embeddings, labels=None, max_queries=DEFAULT_MAX_QUERIES):
    """(mean, std) of the cosine between different images of the batch (0, 0 if B < 2)."""
    if labels is None:
        labels = ops.zeros(ops.shape(embeddings)[:1], "int32")
    scores, others, _ = _scores(embeddings, labels, max_queries)
    w = ops.cast(others, "float32")
    n = ops.maximum(ops.sum(w), 1.0)
    mean = ops.sum(scores * w) / n
    var = ops.sum(ops.square(scores - mean) * w) / n
    return mean, ops.sqrt(ops.maximum(var, 0.0))


def random_ranking_ap(num_candidates, num_positives):
    """Expected AP of a uniformly random ranking of N candidates holding P positives:

        E[AP] = (H_N + (P - 1) / (N - 1) * (N - H_N)) / N,   H_N = sum_{k<=N} 1/k

    (precision at the rank of a positive, averaged over the random position of each
    positive). ``num_positives`` may be a tensor; N = 1 gives 1.
    """
    n = ops.cast(num_candidates, "float32")
    p = ops.cast(num_positives, "float32")
    if isinstance(num_candidates, int):  # a static batch size (always under JAX)
        harmonic = math.fsum(1.0 / k for k in range(1, num_candidates + 1))
    else:
        harmonic = ops.sum(1.0 / ops.arange(1, num_candidates + 1, dtype="float32"))
    slope = ops.where(n > 1, (p - 1.0) / ops.maximum(n - 1.0, 1.0), 0.0)
    return (harmonic + slope * (n - harmonic)) / n


def chance_ap_fraction(embeddings, labels, max_queries=DEFAULT_MAX_QUERIES):
    """Fraction of queries with a positive whose AP <= a random ranking's expected AP.

    AP is exact (sorted), each image queries the rest of the batch, ties count against
    the query. 0 when no query of the first ``max_queries`` has a positive.
    """
    scores, others, positives = _scores(embeddings, labels, max_queries)
    pos = ops.cast(positives, "float32")
    # The query itself sinks to the end (below any cosine), where it adds nothing.
    ranked = ops.where(others, scores - _TIE_EPS * pos, -3.0)
    order = ops.argsort(-ranked, axis=-1)
    rel = ops.take_along_axis(pos, order, axis=-1)
    ranks = ops.cast(ops.arange(1, ops.shape(rel)[-1] + 1), "float32")
    num_pos = ops.sum(pos, axis=-1)
    ap = ops.sum(rel * ops.cumsum(rel, axis=-1) / ranks, axis=-1) / ops.maximum(num_pos, 1.0)
    chance = random_ranking_ap(ops.shape(scores)[1] - 1, num_pos)
    has_pos = ops.cast(num_pos > 0, "float32")
    at_chance = ops.cast(ap <= chance + 1e-6, "float32") * has_pos
    return ops.sum(at_chance) / ops.maximum(ops.sum(has_pos), 1.0)


def batch_health(embeddings, labels, max_queries=DEFAULT_MAX_QUERIES) -> dict:
    """``{"cos_mean", "cos_std", "chance_ap"}`` of one batch (scalar tensors)."""
    mean, std = cosine_stats(embeddings, labels, max_queries)
    return {"cos_mean": mean, "cos_std": std,
            "chance_ap": chance_ap_fraction(embeddings, labels, max_queries)}


# The statistics a BatchHealthMetric can track, by metric name.
STATISTICS = {
    "emb_cos": lambda e, y, q: cosine_stats(e, y, q)[0],
    "emb_cos_std": lambda e, y, q: cosine_stats(e, y, q)[1],
    "chance_ap": chance_ap_fraction,
}


@keras.saving.register_keras_serializable(package="tfaploss")
class BatchHealthMetric(keras.metrics.Metric):
    """One batch-health ``statistic`` (``"emb_cos"``, ``"emb_cos_std"`` or
    ``"chance_ap"``, see the module docstring) averaged over the epoch; ``last`` holds
    the latest batch's value and ``images`` its size (what the monitor counts patience
    in), neither saved with a model. ``y_true``: integer labels, ``y_pred``:
    embeddings. ``max_queries``: rows used as queries (cost O(max_queries·B·d)).
    """

    def __init__(self, statistic="emb_cos", max_queries=DEFAULT_MAX_QUERIES, name=None,
                 dtype=None):
        if statistic not in STATISTICS:
            raise ValueError(f"BatchHealthMetric: statistic must be one of "
                             f"{sorted(STATISTICS)}, received statistic={statistic!r}")
        if not isinstance(max_queries, int) or isinstance(max_queries, bool) or max_queries < 2:
            raise ValueError("BatchHealthMetric: max_queries must be an int >= 2, "
                             f"received max_queries={max_queries!r}")
        super().__init__(name=name or statistic, dtype=dtype)
        self.statistic, self.max_queries = statistic, max_queries
        self.total = self.add_variable((), initializer="zeros", name="total")
        self.count = self.add_variable((), initializer="zeros", name="count")
        # Under tf.distribute each replica measures its own shard: reading the latest
        # value averages the replicas' values, the images add up to the global batch.
        self.last = self.add_variable((), initializer="zeros", name="last",
                                      aggregation="mean")
        self.images = self.add_variable((), initializer="zeros", name="images")

    def update_state(self, y_true, y_pred, sample_weight=None):
        v = STATISTICS[self.statistic](y_pred, y_true, self.max_queries)
        v = ops.cast(v, self.dtype)
        self.total.assign_add(v)
        self.count.assign_add(ops.cast(1.0, self.dtype))
        self.last.assign(v)
        self.images.assign(ops.cast(ops.shape(y_pred)[0], self.dtype))

    def result(self):
        return self.total / ops.maximum(self.count, 1.0)

    def get_config(self):
        return {**super().get_config(), "statistic": self.statistic,
                "max_queries": self.max_queries}


def health_metrics(max_queries=DEFAULT_MAX_QUERIES):
    """The three batch-health metrics, for ``model.compile(metrics=...)``."""
    return [BatchHealthMetric(s, max_queries) for s in STATISTICS]
