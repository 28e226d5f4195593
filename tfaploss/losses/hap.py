"""H-AP / HAPPIER (Ramzi et al., "Hierarchical Average Precision Training for Pertinent
Image Retrieval", ECCV 2022): AP with graded relevance from multi-level labels; the
kernels are in :mod:`tfaploss.ops.hap`."""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from tfaploss.losses._checks import check, check_labels, dtype_name, finite_or_zero, number
from tfaploss.losses.base import RetrievalLoss
from tfaploss.losses.proxies import ClusterProxies, ProxiesOwner
from tfaploss.losses.smooth_ap import UpperStepArgs
from tfaploss.ops.hap import hap_per_query, hierarchy_levels, pop_relevance
from tfaploss.ops.masks import safe_normalize, self_pair_mask


def _check_level_labels(owner, y_true):
    """Labels as a (B, L) tensor: (B,) and (B, 1) give L = 1."""
    if not hasattr(y_true, "shape"):
        y_true = np.asarray(y_true)
    shape = tuple(y_true.shape)
    if len(shape) == 2 and shape[-1] is not None and int(shape[-1]) > 1:
        check_labels(y_true[:, 0])  # the dtype checks and their messages, before a cast
        return ops.convert_to_tensor(y_true)
    if len(shape) not in (1, 2):
        raise ValueError(
            f"{owner} expects y_true of shape (batch,) or (batch, levels) holding integer "
            f"labels, finest level first; received y_true of shape {shape} (dtype "
            f"{dtype_name(y_true)}).")
    return ops.expand_dims(check_labels(y_true), 1)


@keras.saving.register_keras_serializable(package="tfaploss")
class HAPLoss(ProxiesOwner, UpperStepArgs, RetrievalLoss):
    """HAPPIER's H-AP surrogate (Ramzi, Audebert, Thome, Rambour, Bitot, "Hierarchical
    Average Precision Training for Pertinent Image Retrieval", ECCV 2022), optionally
    with its clustering term (the paper's full objective). Labels: ``y_true`` of shape
    (B, L), integer ids, **column 0 the finest level** (SOP: ``[class, super_class]``),
    the authors' order. ``level(i, j)`` counts the columns i and j share (0..L). Labels
    (B,) or (B, 1) are one level: the loss is then :class:`~tfaploss.losses.SupAPLoss`
    with the same constants.

    Relevance (the authors' default ``pop``): ``rel(i, j) = w[l] / n_i(l)`` with
    ``l = level(i, j)``, ``w[l] = (l / (L - 1)) ** alpha`` and ``n_i(l)`` the items at
    level ``l`` among those query i is ranked against (the query itself at level L
    with ``include_self=True``). "Positives" are the pairs with relevance > 0.

    For query i and each relevant j (the query itself included, as in their code):

        rank(i, j)   = 1 + sum_{k != j} (H-(s_ik - s_ij) if level_ik < level_ij
                                         else [s_ik >= s_ij])
        H-rank(i, j) = rel_ij + sum_{k != j} [s_ik >= s_ij] · min(rel_ik, rel_ij)
        H-AP_i = sum_j H-rank(i, j) / rank(i, j) / sum_j rel_ij,   L_HAP = 1 - H-AP_i

    ``H-`` is ROADMAP's upper step (:class:`~tfaploss.losses.SupAPLoss`) on the less
    relevant items; everything else is the true step without gradient (their
    ``with_hrank: False``). Defaults: their SOP config; iNaturalist uses ``start=0.0,
    offset=1.0``.

    Full objective (``clustering_weight > 0``): ``(1 - w) · L_HAP + w · L_cluster``,
    the authors' ``ClusterLoss``: cross-entropy of ``cos(e_i, p_c) /
    cluster_temperature`` over one proxy ``p_c`` per finest-level class (their configs:
    ``w = 0.1``). The proxies are a :class:`ClusterProxies` layer the model must
    contain: ``model = loss.with_proxies(embedder)`` (:mod:`tfaploss.losses.proxies`);
    column 0 of the labels must then be class ids in ``0..num_classes-1``. The model's
    optimizer trains them (the authors use their own Adam, lr 10): use a learning-rate
    multiplier (``model.proxy_lr_multiplier`` in a config).

    Cost: O(B·P·B) time with P the most relevant items of a query (up to B/2 with the
    authors' two-super-classes-per-batch sampler) and O(pairs_per_block·B + B²)
    memory; never a B×B×B tensor (``docs/losses.md`` has measurements). An eager
    ``tf.GradientTape`` keeps every block (~17 GB at B=1024): use ``tf.function``.

    Args:
        tau, rho, delta, start, offset: the upper step (``offset=None``: continuous,
            ``start + sigmoid(delta / tau)``).
        alpha: exponent of the level weights (> 0).
        clustering_weight: weight ``w`` of the clustering term, in [0, 1) (0: H-AP only).
        num_classes: number of finest-level classes (proxies); needed when
            ``clustering_weight > 0``.
        cluster_temperature: the clustering term's softmax temperature.
        proxies_key: pairs the loss with its proxies layer across a save and load; set
            by the loss itself.
        drop_lone_queries: see ``RetrievalLoss``; a query is lone when no other item
            of the batch is relevant to it (shares no level).
{shared_args}

    Example:

    ```python
    loss = tfaploss.losses.HAPLoss()
    labels = np.array([[0, 0], [0, 0], [1, 0], [2, 1]])  # [class, super-class]
    loss(labels, embeddings)                               # embeddings (4, D)
    ```
    """

    proxies_layer_class = ClusterProxies
    @classmethod
    def uses_proxies(cls, kwargs: dict) -> bool:
        return kwargs.get("clustering_weight", 0.0) > 0  # the clustering term only

    def __init__(self, tau=0.01, rho=100.0, delta=0.05, start=0.5, offset=1.44, alpha=1.0,
                 clustering_weight=0.0, num_classes=None, cluster_temperature=0.05,
                 include_self=True, pairs_per_block=None, *, name="hap_loss", proxies_key=None,
                 **kwargs):
        super().__init__(include_self=include_self, name=name, **kwargs)
        owner = "HAPLoss"
        self._upper = self._keep_upper_step(tau, rho, delta, start, offset, pairs_per_block,
                                            temperature_name="tau")
        self.alpha = number(owner, "alpha", alpha, low=0, open_low=True)
        self.clustering_weight = number(owner, "clustering_weight", clustering_weight, low=0,
                                        high=1, open_high=True)
        check(owner, "num_classes", num_classes, self.clustering_weight == 0 or (
            isinstance(num_classes, int) and num_classes > 0),
            "a positive int when clustering_weight > 0")
        self.num_classes = num_classes
        self.cluster_temperature = number(owner, "cluster_temperature", cluster_temperature,
                                          low=0, open_low=True)
        self._levels = None
        self._init_proxies(num_classes, proxies_key)

    # Its (B, L) labels are not gathered: MultiStageModel gathers (docs/losses.md).
    gathers_global_batch = False

    def _query_labels(self, y_true):
        return _check_level_labels(type(self).__name__, y_true)

    def call(self, y_true, y_pred):
        """Per-query terms, shape (B,), masked where a query has no relevant item."""
        labels, y_pred = self._rows(self._query_labels(y_true), y_pred)
        finite, (y_pred,) = finite_or_zero(y_pred)
        scores = self.pairwise(y_pred, y_pred)
        level = hierarchy_levels(labels, labels)
        n = ops.shape(labels)[0]
        self_pairs = self_pair_mask(n) if self.include_self else None
        candidates = (ops.ones_like(level, dtype="bool") if self.include_self
                      else ops.logical_not(self_pair_mask(n)))
        positives = ops.logical_and(level > 0, candidates)
        self._levels = (level, int(labels.shape[-1]), labels[:, 0], y_pred)
        try:
            return self._query_terms(finite, scores, positives, candidates, self_pairs)
        finally:
            self._levels = None

    def per_query(self, scores, positives, candidates, self_pairs=None):
        if self._levels is None:  # one level (e.g. query_database_loss): the masks say all
            level, num_levels = ops.cast(positives, "int32"), 1
            fine, embeddings = None, None
        else:
            level, num_levels, fine, embeddings = self._levels
        relevance = pop_relevance(level, candidates, num_levels, self.alpha, scores.dtype)
        hap, counts = hap_per_query(scores, level, relevance, candidates, self._upper,
                                    self.pairs_per_block)
        values = 1.0 - hap
        if self.clustering_weight > 0:
            if fine is None:
                raise ValueError("HAPLoss: the clustering term needs the batch's own "
                                 "labels; query_database_loss supports clustering_weight=0 "
                                 f"only; received clustering_weight={self.clustering_weight}.")
            cluster = self.cluster_loss(embeddings, fine)
            values = (1.0 - self.clustering_weight) * values + self.clustering_weight * cluster
        return values, ops.cast(counts > 0, values.dtype)

    def cluster_loss(self, embeddings, labels):
        """The authors' ``ClusterLoss`` (class docstring): one batch-level value."""
        proxies = safe_normalize(self.proxies_for(embeddings))
        if self.normalize:
            embeddings = safe_normalize(embeddings)
        logits = ops.matmul(embeddings, ops.transpose(proxies)) / self.cluster_temperature
        labels = ops.cast(labels, "int32")
        ce = ops.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        return ops.mean(ce)
