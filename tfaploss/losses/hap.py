"""H-AP / HAPPIER (Ramzi et al., "Hierarchical Average Precision Training for Pertinent
Image Retrieval", ECCV 2022): AP with graded relevance from multi-level labels.

The loss ranks every *relevant* pair (relevance > 0) of a query with ROADMAP's smoothed
upper step; its kernels are in :mod:`tfaploss.ops.hap`.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from tfaploss.losses._checks import check, check_labels, dtype_name, finite_or_zero, number
from tfaploss.losses.base import RetrievalLoss
from tfaploss.losses.proxies import ClusterProxies, ProxiesOwner
from tfaploss.ops.hap import hap_per_query, hierarchy_levels, pop_relevance
from tfaploss.ops.masks import safe_normalize, self_pair_mask
from tfaploss.ops.smooth_rank import SupAPUpperStep


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
class HAPLoss(ProxiesOwner, RetrievalLoss):
    """HAPPIER's H-AP surrogate (Ramzi, Audebert, Thome, Rambour, Bitot, "Hierarchical
    Average Precision Training for Pertinent Image Retrieval", ECCV 2022), optionally
    with its clustering term (the paper's full objective).

    Labels: ``y_true`` of shape (B, L), integer ids, **column 0 the finest level**
    (SOP: ``[class, super_class]``; iNaturalist: ``[species, genus, ..., kingdom]``, or
    ``[species, supercategory]`` as ``tfaploss.data`` writes it), the authors' order.
    ``level(i, j)`` counts the columns i and j share (0..L; the query itself: L). A
    label vector (B,) or (B, 1) is one level: H-AP is then SupAP's AP and the loss is
    :class:`~tfaploss.losses.SupAPLoss` with the same constants.

    Relevance (the authors' default, ``relevance_type: pop``, their config's
    ``alpha: 1.0``): ``rel(i, j) = w[l] / n_i(l)`` with ``l = level(i, j)``,
    ``w[l] = (l / (L - 1)) ** alpha`` and ``n_i(l)`` the number of items of the batch
    at level ``l`` from query i among the items it is ranked against (with
    ``include_self=True``, the default and the authors' code, the query itself counts at
    level L). Unrelated items have relevance 0; "positives" are the pairs with
    relevance > 0.

    For query i and each relevant j (the query itself included, as in their code):

        rank(i, j)   = 1 + sum_{k != j} (H-(s_ik - s_ij) if level_ik < level_ij
                                         else [s_ik >= s_ij])
        H-rank(i, j) = rel_ij + sum_{k != j} [s_ik >= s_ij] · min(rel_ik, rel_ij)
        H-AP_i = sum_j H-rank(i, j) / rank(i, j) / sum_j rel_ij,   L_HAP = 1 - H-AP_i

    ``H-`` is ROADMAP's upper step on the less relevant items (sigmoid of temperature
    ``tau`` for t <= 0, ``start + sigmoid`` on (0, delta], ``rho·(t - delta) +
    offset`` beyond; see :class:`~tfaploss.losses.SupAPLoss`); everything else is the
    true step without gradient (``with_hrank: False`` in every config of theirs but
    ``HAPPIER_5_SOP``; the smoothed H-rank is not implemented). Defaults are their
    ``HAPLoss`` defaults and SOP config: ``tau=0.01, rho=100, delta=0.05, start=0.5,
    offset=1.44``; their iNaturalist config uses ``start=0.0, offset=1.0``.

    Full objective (``clustering_weight > 0``): ``(1 - w) · L_HAP + w · L_cluster`` with
    the authors' ``ClusterLoss``: cross-entropy of ``cos(e_i, p_c) / cluster_temperature``
    over one learnable proxy ``p_c`` per finest-level class (``num_classes`` of them),
    temperature 0.05, ``w = 0.1`` in their SOP and iNaturalist configs (HAP weight
    ``1 - 0.1``). The proxies are the variable of a :class:`ClusterProxies` layer
    that the loss owns (``loss.proxies_layer``) and the model must contain, so that the
    optimizer trains them and ``model.save`` keeps them: ``model =
    loss.with_proxies(embedder)`` (see :mod:`tfaploss.losses.proxies`); a ``.keras``
    file restores the loss bound to them, and ``tfaploss train`` builds them from the
    training manifest. Column 0 of the labels must then be class ids in
    ``0..num_classes-1``. The authors train the proxies with their own Adam (lr 10,
    cosine-annealed to 0.1); here the model's optimizer trains them, faster with a
    learning-rate multiplier (``model.proxy_lr_multiplier`` in a config).

    Cost: O(B·P·B) time with P the most relevant items of a query (the query's whole
    coarsest common group, e.g. its super-class: up to B/2 with the authors'
    two-super-classes-per-batch sampler) and O(chunk·B + B²) memory with chunk =
    ``pairs_per_block``; never a B×B×B tensor.
    ``docs/losses.md`` has measured times and memory. Under an eager ``tf.GradientTape`` the tape keeps every block's intermediates
    (O(P·B) memory, as for the other smooth-rank losses: ~17 GB at B=1024, SupAP ~7 GB):
    train under ``tf.function`` (Keras's ``fit`` does).

    Args:
        tau, rho, delta, start, offset: the upper step (``offset=None``: continuous,
            ``start + sigmoid(delta / tau)``).
        alpha: exponent of the level weights (> 0).
        clustering_weight: weight ``w`` of the clustering term, in [0, 1) (0: H-AP only).
        num_classes: number of finest-level classes (proxies); needed when
            ``clustering_weight > 0``.
        cluster_temperature: the clustering term's softmax temperature.
        include_self: rank the query against itself (the authors' code does).
        normalize: L2-normalise embeddings first (the authors' network outputs
            normalised embeddings; their loss does not normalise again).
        pairs_per_block: relevant pairs ranked per loop step (``None``: about 4M / B).
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
        try:
            self._upper = SupAPUpperStep(tau, rho, delta, start, offset)
        except ValueError as err:
            message = str(err).replace("temperature must", "tau must")
            raise ValueError(f"{owner}: {message}") from None
        upper = self._upper
        self.tau, self.rho, self.delta, self.start = (upper.temperature, upper.rho,
                                                      upper.delta, upper.start)
        self.offset = None if offset is None else upper.offset
        self.alpha = number(owner, "alpha", alpha, low=0, open_low=True)
        self.clustering_weight = number(owner, "clustering_weight", clustering_weight, low=0,
                                        high=1, open_high=True)
        check(owner, "num_classes", num_classes, self.clustering_weight == 0 or (
            isinstance(num_classes, int) and num_classes > 0),
            "a positive int when clustering_weight > 0")
        self.num_classes = num_classes
        self.cluster_temperature = number(owner, "cluster_temperature", cluster_temperature,
                                          low=0, open_low=True)
        self.pairs_per_block = pairs_per_block
        self._levels = None
        self._init_proxies(num_classes, proxies_key)

    # Ranks per call: its (B, L) labels are not gathered across replicas; under a
    # strategy MultiStageModel gathers the batch itself (docs/losses.md, "Several devices").
    gathers_global_batch = False

    # -- Keras entry points -------------------------------------------------------------

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

    # -- the clustering term --------------------------------------------------------------

    def cluster_loss(self, embeddings, labels):
        """The authors' ``ClusterLoss``: mean cross-entropy of the finest labels against
        ``cos(e_i, p_c) / cluster_temperature`` (batch-level, one value)."""
        proxies = safe_normalize(self.proxies_for(embeddings))
        if self.normalize:
            embeddings = safe_normalize(embeddings)
        logits = ops.matmul(embeddings, ops.transpose(proxies)) / self.cluster_temperature
        labels = ops.cast(labels, "int32")
        ce = ops.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        return ops.mean(ce)
