"""Proxy-Anchor loss (Kim et al., CVPR 2020): the batch against one proxy per class."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.losses._checks import (
    check_labels,
    concrete,
    finite_or_zero,
    integer,
    nan_unless,
    number,
    positive_number,
)
from tfaploss.losses.base import RetrievalLoss
from tfaploss.losses.proxies import ProxiesOwner
from tfaploss.ops.masks import masked_logsumexp, pairwise_scores


@keras.saving.register_keras_serializable(package="tfaploss")
class ProxyAnchorLoss(ProxiesOwner, RetrievalLoss):
    """Proxy-Anchor loss (Kim, Kim, Cho, Kwak, "Proxy Anchor Loss for Deep Metric
    Learning", CVPR 2020), as pytorch-metric-learning computes it. With ``p_c`` one
    learnable proxy per class, ``s_ic = cos(e_i, p_c)``, margin ``delta`` and scale
    ``alpha``::

        pos_c = log(1 + sum_{i: y_i = c}  w_i · exp(-alpha · (s_ic - delta)))
        neg_c = log(1 + sum_{i: y_i != c} w_i · exp( alpha · (s_ic + delta)))
        L = 1/|P+| · sum_c pos_c + 1/C · sum_c neg_c

    with ``P+`` the proxies that have an item in the batch, ``C = num_classes`` and
    ``w_i`` the item's ``sample_weight`` (>= 0; 1 without one): weight 0 removes the
    item, a scalar ``w`` adds ``log w`` to each exponent. **Terms are per proxy:**
    ``call`` returns ``t_c = pos_c · C / |P+| + neg_c``, shape ``(num_classes,)``, so
    the default reduction is ``L`` (``"sum"``: ``C · L``).

    **The proxies** are a :class:`~tfaploss.losses.ClassProxies` layer that the model
    must contain: ``model = loss.with_proxies(embedder)``. The paper trains them 100x
    faster: ``LRMultiplierOptimizer(opt, tfaploss.losses.proxies_multipliers(100))``
    (``model.proxy_lr_multiplier`` in a config). Labels must be class ids in
    ``0..num_classes-1``: another label raises (eagerly) or makes the loss NaN (traced).
    Proxies start as pytorch-metric-learning's (normal, std ``sqrt(2 / num_classes)``);
    give values with ``loss.proxies_layer.set_proxies(values)``. Under a distribution
    strategy ``reduction="none"`` is refused (no replica owns a proxy's term). No
    query-vs-database form, so no cross-batch memory.

    Cost: O(B·C·D) time for the scores and O(B·C) memory, C = ``num_classes``.

    Args:
        num_classes: number of classes, one proxy each.
        margin: ``delta`` (pytorch-metric-learning's default 0.1).
        alpha: the scale (> 0; default 32).
        normalize: compare cosines (L2-normalise embeddings and proxies), as the paper.
        proxies_key: pairs the loss with its proxies layer across a save and load; set
            by the loss itself.
        reduction: as for ``RetrievalLoss``, of the per-proxy terms above.
{shared_args}
    """

    unused_args = ("include_self", "drop_lone_queries")  # it ranks against proxies

    def __init__(self, num_classes, margin=0.1, alpha=32.0, *, name="proxy_anchor_loss",
                 proxies_key=None, **kwargs):
        super().__init__(name=name, **kwargs)
        owner = type(self).__name__
        self.num_classes = integer(owner, "num_classes", num_classes)
        self.margin = number(owner, "margin", margin)
        self.alpha = positive_number(owner, "alpha", alpha)
        self._init_proxies(num_classes, proxies_key)
        # Every item has its class's proxy as a positive: no query is lone.
        self.lone_queries = None

    def _global_batch_call(self, y_true, y_pred, sample_weight, replicas):
        # Stays: per-proxy terms have no rows of one replica, so "none" has no share.
        if self.reduction in (None, "none"):
            owner = type(self).__name__
            raise ValueError(f"{owner}: reduction='none' gives one term per proxy, "
                             "which no replica owns; use a mean or 'sum' under a "
                             f"distribution strategy; received reduction={self.reduction!r}.")
        return super()._global_batch_call(y_true, y_pred, sample_weight, replicas)

    def _weighted_terms(self, labels, embeddings, sample_weight):
        # sample_weight weights items inside the proxies' sums, not the terms.
        return self.proxy_terms(labels, embeddings, sample_weight), None

    def call(self, y_true, y_pred):
        """Per-proxy terms, shape (num_classes,) (class docstring)."""
        return self.proxy_terms(y_true, y_pred)

    def query_database_loss(self, *args, **kwargs):
        raise ValueError(f"{type(self).__name__} scores items against its proxies and has "
                         "no query-vs-database form (cross-batch memory): train it "
                         "without xbm.")

    def proxy_terms(self, labels, embeddings, sample_weight=None):
        """The (C,) per-proxy terms ``t_c`` of the class docstring."""
        labels, embeddings = self._rows(check_labels(labels), embeddings)
        weights = self._item_weights(sample_weight, labels)
        finite, (embeddings,) = finite_or_zero(embeddings)
        proxies = self.proxies_for(embeddings)
        scores = pairwise_scores(embeddings, proxies, normalize=self.normalize)  # (B, C)
        classes = ops.arange(self.num_classes, dtype=labels.dtype)
        same = ops.equal(ops.expand_dims(labels, 1), ops.expand_dims(classes, 0))
        known = self._check_label_range(ops.all(ops.any(same, axis=1)), labels)
        taken = ops.expand_dims(weights > 0, 1)
        log_w = ops.expand_dims(ops.log(ops.where(weights > 0, weights,
                                                  ops.ones_like(weights))), 1)
        pos = ops.logical_and(same, taken)
        neg = ops.logical_and(ops.logical_not(same), taken)
        pos_terms = masked_logsumexp(-self.alpha * (scores - self.margin) + log_w, pos,
                                     axis=0, add_one=True)
        neg_terms = masked_logsumexp(self.alpha * (scores + self.margin) + log_w, neg,
                                     axis=0, add_one=True)
        with_items = ops.sum(ops.cast(ops.any(pos, axis=0), scores.dtype))
        terms = pos_terms * (self.num_classes / ops.maximum(with_items, 1.0)) + neg_terms
        return nan_unless(ops.logical_and(finite, known), terms)

    def _item_weights(self, sample_weight, labels):
        """``sample_weight`` as one weight per item, shape (B,) (ones without one)."""
        if sample_weight is None:
            return ops.ones_like(labels, dtype=self.dtype)
        weights = self._row_weights(sample_weight, labels)
        negative = concrete(ops.any(weights < 0))
        if negative is not None and bool(negative):
            raise ValueError(f"{type(self).__name__}: sample_weight weights items inside "
                             "the proxies' sums and must be >= 0; received a negative "
                             "weight.")
        return weights

    def _check_label_range(self, all_known, labels):
        """``all_known``, raising now when it is known to be False (eager)."""
        known = concrete(all_known)
        if known is not None and not bool(known):
            values = ops.convert_to_numpy(labels).reshape(-1)
            bad = sorted({v.item() for v in values
                          if not (0 <= v < self.num_classes and float(v).is_integer())})
            raise ValueError(
                f"{type(self).__name__}: labels must be class ids in 0..{self.num_classes - 1} "
                f"(num_classes={self.num_classes}, one proxy each); received labels "
                f"{bad[:10]}{' ...' if len(bad) > 10 else ''}.")
        return all_known
