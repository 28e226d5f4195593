"""The base class every ranking loss builds on: checks, scores, masks and reduction."""

from __future__ import annotations

import inspect
import warnings

import keras
from keras import ops

from tfaploss._keras_compat import in_symbolic_scope
from tfaploss.losses._checks import (
    NARROW_FLOATS,
    check_labels,
    check_sizes,
    concrete,
    finite_or_zero,
    nan_unless,
)
from tfaploss.losses._reduction import KerasReduction, with_mask
from tfaploss.losses._shared_args import fill_shared_args, forwarded_signature
from tfaploss.losses.lone_queries import LoneQueryTracker
from tfaploss.ops import distribute
from tfaploss.ops.backend import tf_kernels
from tfaploss.ops.masks import label_masks, pairwise_scores, self_pair_mask

_warned_no_positives = False


def _warn_once_without_positives(has_positive_pair):
    """Warn (once per process) that a batch had no positive pair at all."""
    global _warned_no_positives
    message = (
        "tfaploss: a batch had no pair of items with the same label (for TripletLoss: "
        "no anchor with both a positive and a negative), so every query was left out "
        "and the loss is 0 with zero gradient. Use a class-balanced "
        "sampler (tfaploss.data, e.g. sampler='m_per_class') so that each batch holds "
        "at least two images per class."
    )
    known = concrete(has_positive_pair)
    if known is not None:
        if not _warned_no_positives and not bool(known):
            _warned_no_positives = True
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return has_positive_pair
    kernels = tf_kernels()
    if kernels is None or kernels.in_xla_context():
        return has_positive_pair  # a traced JAX/XLA step cannot warn; the 0 says it
    return kernels.warn_unless(has_positive_pair, message)


_MISSING = object()


@keras.saving.register_keras_serializable(package="tfaploss")
class RetrievalLoss(keras.losses.Loss):
    """Base class of the ranking losses: integer labels in, one term per query out.

    Each item of the batch is a query ranked against the whole batch. :meth:`call`
    returns one term per query, shape (B,): the query's loss from :meth:`per_query`
    (e.g. ``1 - AP_i``) where it has positives, else 0 under a Keras mask. Keras's
    ``Loss.__call__`` then applies ``sample_weight`` and ``reduction``; the mask makes
    the means divide by the number of queries with positives::

        loss = sum_i s_i · l_i / #{i: query i has a positive}     (the default)

    ``sample_weight`` scales each query's term, never the rankings. Under
    ``tf.distribute`` and ``torch.distributed`` a call ranks the global batch.
    ``docs/losses.md`` has every reduction, the built-in query weights, the
    multi-device contract and how lone queries are counted (``LoneQueryShare``).

    Subclasses override :meth:`per_query` (and :meth:`pairwise` for distances), take
    their own arguments and forward the rest (``**kwargs``) here; ``get_config``
    writes every argument of the resulting signature, and the shared arguments'
    docs come from :data:`tfaploss.losses._shared_args.ARGS_DOC`.

    Args:
{shared_args}

    Example:

    ```python
    loss = tfaploss.losses.APLoss()
    labels = np.array([0, 0, 1, 1])
    embeddings = np.random.normal(size=(4, 8)).astype("float32")
    loss(labels, embeddings)                                    # a scalar
    tfaploss.losses.APLoss(reduction="none")(labels, embeddings)  # shape (4,)
    model.compile(optimizer="adam", loss=loss)
    ```
    """

    #: Whether a call under several replicas gathers the global batch; a loss that
    #: cannot sets False and is refused there rather than rank one shard.
    gathers_global_batch = True
    #: The shared arguments this loss has no use for: left out of its signature and
    #: config, and refused unless left at their default.
    unused_args: tuple[str, ...] = ()

    def __init__(self, normalize: bool = True, include_self: bool = False,
                 reduction="sum_over_batch_size", name=None, dtype=None,
                 drop_lone_queries: bool = False):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        owner = type(self).__name__
        if self.dtype in NARROW_FLOATS:
            raise ValueError(f"{owner}: dtype={self.dtype!r} cannot represent label "
                             "ids exactly and loses ranking precision; use 'float32' (mixed "
                             "precision models still compute the loss in float32) or "
                             "'float64'.")
        for arg, value in (("include_self", include_self),
                           ("drop_lone_queries", drop_lone_queries)):
            if arg in self.unused_args and value:
                raise ValueError(f"{owner} takes no {arg} (it has no use for it); "
                                 f"received {arg}={value!r}.")
        self.normalize = bool(normalize)
        self.include_self = bool(include_self)
        self.drop_lone_queries = bool(drop_lone_queries)
        #: Fed by ``tfaploss.training.LoneQueryMonitor``; the loss counts nothing itself
        #: (no host call in the step).
        self.lone_queries = LoneQueryTracker(warn=not self.drop_lone_queries)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__.__signature__ = forwarded_signature(cls)
        fill_shared_args(cls)

    def get_config(self):
        """``name``, ``reduction``, ``dtype`` and every argument of the constructor's
        signature, read from the attribute of its name (tuples as lists)."""
        config = {**super().get_config(), "dtype": self.dtype}
        for arg in inspect.signature(type(self)).parameters:
            value = getattr(self, arg, _MISSING)
            if arg not in config and value is not _MISSING:
                config[arg] = list(value) if isinstance(value, tuple) else value
        return config

    # -- Keras entry points -------------------------------------------------------

    def __call__(self, y_true, y_pred, sample_weight=None):
        """The reduced loss; :meth:`call` sees the labels uncast (class docstring)."""
        if self.gathers_global_batch:
            replicas = distribute.replicas_to_gather(type(self).__name__,
                                                     shapes_only=in_symbolic_scope())
            if replicas > 1:
                return self._global_batch_call(y_true, y_pred, sample_weight, replicas)
        with keras.name_scope(self.name):
            terms, sample_weight = self._weighted_terms(self._query_labels(y_true), y_pred,
                                                        sample_weight)
        # A loss that gathers found no shard to refuse above; one that does not is
        # refused here when it would rank one replica's shard.
        return self._reduce(terms, sample_weight, per_replica=self.gathers_global_batch)

    def _query_labels(self, y_true):
        """``y_true`` checked as this loss's labels (class ids, shape (B,))."""
        return check_labels(y_true)

    def _weighted_terms(self, labels, embeddings, sample_weight):
        """The terms Keras reduces and their checked ``sample_weight`` (every entry
        point goes through this hook)."""
        terms = self.call(labels, embeddings)
        return terms, self._check_sample_weight(sample_weight, terms)

    def _global_batch_call(self, y_true, y_pred, sample_weight, replicas):
        """``__call__`` on one of several replicas: this replica's share of the loss."""
        with keras.name_scope(self.name):
            labels, embeddings = self._rows(self._query_labels(y_true), y_pred, cast=False)
            return self._rank_global_batch(labels, embeddings, sample_weight, replicas,
                                           self._reduced_loss)

    def _reduced_loss(self, labels, embeddings, sample_weight):
        return self._reduce(*self._weighted_terms(labels, embeddings, sample_weight))

    def _rank_global_batch(self, labels, embeddings, sample_weight, replicas, reduced):
        """``reduced(labels, embeddings, sample_weight)`` of the global batch, as this
        replica's share; ``labels`` and ``embeddings`` are this replica's, checked."""
        # One weight per local row, so that the weights line up with the gathered rows.
        sample_weight = self._row_weights(sample_weight, labels)
        return distribute.global_batch_loss(reduced, labels, embeddings, sample_weight,
                                            self.reduction, replicas)

    def call(self, y_true, y_pred):
        """Per-query terms, shape (B,), masked where a query has no positive."""
        labels, y_pred = self._rows(check_labels(y_true), y_pred)
        finite, (y_pred,) = finite_or_zero(y_pred)
        scores = self.pairwise(y_pred, y_pred)
        positives, candidates = label_masks(labels, labels, exclude_self=not self.include_self)
        self_pairs = self_pair_mask(ops.shape(labels)[0]) if self.include_self else None
        return self._query_terms(finite, scores, positives, candidates, self_pairs)

    def _rows(self, labels, embeddings, names=("y_true", "y_pred"), cast=True):
        """``(labels, embeddings)`` checked as one label per (batch, dim) embedding row,
        the embeddings cast to this loss's dtype if ``cast``."""
        embeddings = ops.convert_to_tensor(embeddings, dtype=self.dtype if cast else None)
        if len(embeddings.shape) != 2:
            raise ValueError(
                f"{type(self).__name__} expects {names[1]} of shape (batch, dim) holding "
                f"embeddings; received shape {tuple(embeddings.shape)}."
            )
        return check_sizes(type(self).__name__, labels, embeddings, *names), embeddings

    def _row_weights(self, sample_weight, labels, per="query"):
        """``sample_weight`` (checked) as one weight per row of ``labels``, shape (B,);
        None stays None."""
        if sample_weight is None:
            return None
        rows = ops.zeros_like(labels, dtype=self.dtype)
        weights = self._check_sample_weight(sample_weight, rows, per)
        return ops.reshape(ops.cast(weights, self.dtype), (-1,))

    def _check_sample_weight(self, sample_weight, terms, per="query"):
        """``sample_weight`` as a tensor, refused unless one weight per row of ``terms``."""
        if sample_weight is None:
            return None
        sample_weight = ops.convert_to_tensor(sample_weight)
        shape, queries = tuple(sample_weight.shape), terms.shape[0]
        per_query = len(shape) in (1, 2) and (len(shape) == 1 or shape[1] == 1) and (
            shape[0] is None or queries is None or int(shape[0]) == int(queries))
        if shape != () and not per_query:
            n = "B" if queries is None else int(queries)
            raise ValueError(
                f"{type(self).__name__}: sample_weight must hold one weight per {per}, "
                f"shape ({n},) or ({n}, 1), or be a scalar; received sample_weight of "
                f"shape {shape}. It scales each query's term; the "
                "rankings always use the whole batch."
            )
        if shape == ():
            # Keras multiplies a scalar weight by the mask in place, which PyTorch
            # refuses on a broadcast view: materialise one weight per query.
            sample_weight = ops.ones_like(terms) * ops.cast(sample_weight, terms.dtype)
        return sample_weight

    def _reduce(self, terms, sample_weight=None, per_replica=False):
        """Keras's reduction of the masked per-query ``terms``; refused where they would
        rank one replica's shard, unless ``per_replica`` (meant per replica)."""
        if not per_replica:
            distribute.refuse_per_replica(
                type(self).__name__,
                "its own __call__ path, which does not gather the replicas' rows,",
                shapes_only=in_symbolic_scope())
        reduction = KerasReduction(name=self.name, reduction=self.reduction,
                                   dtype=self.dtype)
        return reduction(terms, terms, sample_weight)

    def query_database_loss(self, query_labels, query_embeddings, db_labels, db_embeddings,
                            candidates=None, sample_weight=None):
        """Loss of queries ranked against a separate database (e.g. a memory bank).

        Every database item is ranked unless ``candidates`` (bool (Q, N)) says
        otherwise; none is the query itself. Reduced as ``__call__`` reduces
        (``sample_weight``: (Q,)). The gradient flows into both inputs (stop it on the
        database side for a detached memory bank). Cost: that of the loss on (Q, N).
        """
        query_labels, query_embeddings = self._rows(
            check_labels(query_labels), query_embeddings, ("query_labels", "query_embeddings"))
        db_labels, db_embeddings = self._rows(check_labels(db_labels), db_embeddings,
                                              ("db_labels", "db_embeddings"))
        finite, (query_embeddings, db_embeddings) = finite_or_zero(query_embeddings,
                                                                   db_embeddings)
        scores = self.pairwise(query_embeddings, db_embeddings)
        positives, all_items = label_masks(query_labels, db_labels)
        if candidates is not None:
            candidates = ops.convert_to_tensor(candidates, dtype="bool")
            positives = ops.logical_and(positives, candidates)
        else:
            candidates = all_items
        terms = self._query_terms(finite, scores, positives, candidates)
        # The caller chose the database: each replica ranks its own queries against it.
        return self._reduce(terms, self._check_sample_weight(sample_weight, terms),
                            per_replica=True)

    def _query_terms(self, finite, scores, positives, candidates, self_pairs=None):
        """Masked per-query terms (Q,) from a (Q, N) score matrix and its bool masks;
        ``self_pairs``: the diagonal when queries are ranked against themselves. All NaN
        unless ``finite``."""
        values, weights = self.per_query(scores, positives, candidates, self_pairs)
        weights = ops.cast(weights, values.dtype)
        # A query with a positive other than itself makes the batch informative; a
        # batch with none (every class alone) gives 0 whatever `drop_lone_queries`.
        informative = self.other_positive_counts(positives, self_pairs) > 0
        if self.drop_lone_queries:
            weights = ops.where(informative, weights, ops.zeros_like(weights))
        weights = ops.where(ops.any(informative), weights, ops.zeros_like(weights))
        valid = weights > 0
        valid = ops.logical_and(valid, _warn_once_without_positives(ops.any(valid)))
        # Built-in query weights relative to their mean over the valid queries, so
        # that the mean of the terms is the weighted mean of the values (exactly 1
        # for 0/1 weights). The `where`s keep 0/0 out of the value and gradient.
        count = ops.sum(ops.cast(valid, values.dtype))
        total = ops.sum(weights)
        relative = weights * count / ops.where(total > 0, total, ops.ones_like(total))
        terms = ops.where(valid, values * relative, ops.zeros_like(values))
        return with_mask(nan_unless(finite, terms), valid)

    # -- what subclasses implement --------------------------------------------------

    def pairwise(self, queries, database):
        """The (Q, N) matrix the loss ranks by (higher = closer): cosine scores."""
        return pairwise_scores(queries, database, normalize=self.normalize)

    @staticmethod
    def without_self_pairs(mask, self_pairs=None):
        """A (Q, N) ``mask`` without each query's pairing with itself (when it is ranked)."""
        if self_pairs is None:
            return mask
        return ops.logical_and(mask, ops.logical_not(self_pairs))

    @staticmethod
    def other_positive_counts(positives, self_pairs=None):
        """Per query, the number of positives other than the query itself, shape (Q,)
        (> 0: the query is not lone)."""
        others = RetrievalLoss.without_self_pairs(positives, self_pairs)
        return ops.sum(ops.cast(others, "int32"), axis=-1)

    def per_query(self, scores, positives, candidates, self_pairs=None):
        """Per-query loss values (Q,) and weights (Q,); weight 0 leaves a query out
        (``docs/losses.md``, "Reductions and weights")."""
        raise NotImplementedError(f"{type(self).__name__} must implement per_query")


fill_shared_args(RetrievalLoss)
