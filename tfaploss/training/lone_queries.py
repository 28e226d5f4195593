"""Lone queries (no other item of the batch shares their label) counted by a Keras
metric from ``y_true`` inside the compiled step, and the callback that warns when most
are; docs/losses.md has the rules and a plain-Keras example."""

from __future__ import annotations

import logging
import threading

import keras
from keras import ops

from tfaploss._keras_compat import in_symbolic_scope
from tfaploss.losses.lone_queries import WINDOW_STEPS, LoneQueryTracker
from tfaploss.ops import distribute
from tfaploss.training.compiled_metrics import compiled_metrics, scalar

__all__ = ["LONE_KEY", "QUERY_KEY", "SHARE_KEY", "LoneQueryMonitor", "LoneQueryShare",
           "lone_query_counts"]

LOG = logging.getLogger(__name__)

SHARE_KEY, LONE_KEY, QUERY_KEY = "lone_query_share", "lone_query_count", "query_count"


def _alone_sorted(column):
    """``(order, alone)``: the permutation sorting ``column`` (B,) and, in that order,
    whether each item is the only one of its label. Cost: one sort, O(B log B)."""
    order = ops.argsort(column)
    ranked = ops.take(column, order)
    new = ops.not_equal(ranked[1:], ranked[:-1])  # item k+1 starts a new label
    edge = ops.ones_like(ranked[:1], dtype="bool")  # empty for an empty batch
    alone = ops.logical_and(ops.concatenate([edge, new], axis=0),
                            ops.concatenate([new, edge], axis=0))
    return order, alone


def lone_query_counts(labels, sample_weight=None, rows=None):
    """``(lone, queries)``: int32 scalars counting the lone queries and all queries.

    A query is an item of weight > 0 (every item without ``sample_weight``); it is lone
    when no other item of the batch shares its label (for (B, L) labels: no level),
    so that a :class:`~tfaploss.losses.RetrievalLoss` finds no positive for it.
    ``rows``: ``(start, stop)``, count only these rows' queries (this replica's).
    Cost: one sort per level, O(L·B log B) time, O(B) memory.
    """
    labels = ops.convert_to_tensor(labels)
    if len(labels.shape) == 1:
        labels = ops.expand_dims(labels, 1)
    if len(labels.shape) != 2 or labels.shape[-1] is None:
        raise ValueError("lone_query_counts: labels must have shape (batch,) or (batch, "
                         f"levels); received shape {tuple(labels.shape)}.")
    levels = int(labels.shape[-1])
    if levels == 1 and rows is None:
        order, lone = _alone_sorted(labels[:, 0])
    else:
        order, lone = None, None
        for level in range(levels):  # L: a static handful
            level_order, alone = _alone_sorted(labels[:, level])
            alone = ops.take(alone, ops.argsort(level_order))  # back to the batch's order
            lone = alone if lone is None else ops.logical_and(lone, alone)
    if sample_weight is None:
        query = None
        queries = ops.shape(lone)[0]
    else:
        weight = ops.reshape(ops.convert_to_tensor(sample_weight), (-1,))
        query = ops.broadcast_to(weight > 0, ops.shape(lone))
        if order is not None:
            query = ops.take(query, order)
    if rows is not None:
        lone = lone[rows[0]:rows[1]]
        query = None if query is None else query[rows[0]:rows[1]]
        queries = ops.shape(lone)[0]
    if query is not None:
        lone = ops.logical_and(lone, query)
        queries = ops.sum(ops.cast(query, "int32"))
    return ops.sum(ops.cast(lone, "int32")), ops.cast(queries, "int32")


@keras.saving.register_keras_serializable(package="tfaploss")
class LoneQueryShare(keras.metrics.Metric):
    """The share of the epoch's queries that had no other item of their label in
    their batch (:func:`lone_query_counts` of ``y_true``), logged as
    ``lone_query_share`` (NaN when nothing was counted) with ``lone_query_count`` and
    ``query_count``. Across replicas it gathers the labels, as the loss does. Cost per
    step: :func:`lone_query_counts` inside the compiled step; no host call.
    """

    def __init__(self, name=SHARE_KEY, dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.lone = self.add_variable((), initializer="zeros", dtype="int32", name="lone")
        self.queries = self.add_variable((), initializer="zeros", dtype="int32",
                                         name="queries")

    def update_state(self, y_true, y_pred=None, sample_weight=None):
        rows = None
        replicas = distribute.replicas_to_gather(type(self).__name__,
                                                 shapes_only=in_symbolic_scope())
        if replicas > 1:
            # The labels stand in for the embeddings: only the rows' count is read.
            y_true, _, sample_weight, rows = distribute.gather_replicas(
                y_true, y_true, sample_weight)
        lone, queries = lone_query_counts(y_true, sample_weight, rows)
        self.lone.assign_add(lone)
        self.queries.assign_add(queries)

    def result(self):
        # 0 / 0: NaN, nothing counted
        share = ops.cast(self.lone, "float32") / ops.cast(self.queries, "float32")
        return {SHARE_KEY: share, LONE_KEY: ops.convert_to_tensor(self.lone),
                QUERY_KEY: ops.convert_to_tensor(self.queries)}


class LoneQueryMonitor(keras.callbacks.Callback):
    """Hands the :class:`LoneQueryShare` counts to :attr:`tracker` (the loss's
    :class:`~tfaploss.losses.lone_queries.LoneQueryTracker`, else the monitor's own),
    which warns once per ``fit`` when most queries of the recent steps were lone.

    The counts are read every ``every`` steps and at each epoch's end, from the
    metric's variables (they sum the replicas', where the logs average them), or on
    JAX, which writes them back only at the epoch's end, from the step's logs. Cost
    with the default ``every`` (20): within 2 % of a B=256 ``SmoothAPLoss`` step on a
    CPU (``benchmarks/lone_queries.py``).
    """

    async_safe = True  # JAX: on_train_batch_end runs in Keras's callback thread

    def __init__(self, every: int = WINDOW_STEPS):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"LoneQueryMonitor: every must be an int >= 1; received "
                             f"every={every!r}.")
        self.every = every
        self.tracker = None
        self._lock = threading.Lock()  # JAX: batch ends may run in several threads
        self._from_step_logs = keras.backend.backend() == "jax"

    def on_train_begin(self, logs=None):
        tracker = getattr(getattr(self.model, "loss", None), "lone_queries", None)
        self.tracker = tracker if isinstance(tracker, LoneQueryTracker) else LoneQueryTracker()
        self.tracker.start_run()
        self._metric = None  # Keras builds the compiled metrics at the first step
        self._said_missing = False

    def on_epoch_begin(self, epoch, logs=None):
        self._read = (0, 0, 0)  # (steps, lone, queries) of this epoch handed over
        self._begun = 0  # steps of this epoch started

    def on_train_batch_begin(self, batch, logs=None):
        self._begun = batch + 1
        if self._from_step_logs or batch - self._read[0] < self.every:
            return
        # TensorFlow, PyTorch: the metric's variables hold the `batch` steps done.
        self._metric = self._metric or next(
            (m for m in compiled_metrics(self.model) if isinstance(m, LoneQueryShare)), None)
        if self._metric is None:
            self._missing()
            return
        counts = self._metric.result()
        self._observe(batch, counts[LONE_KEY], counts[QUERY_KEY])

    def on_train_batch_end(self, batch, logs=None):
        if self._from_step_logs and batch + 1 - self._read[0] >= self.every:
            self._from_logs(batch + 1, logs)

    def on_epoch_end(self, epoch, logs=None):
        # The epoch's steps: the last execution started, of steps_per_execution steps.
        done = self._begun + max(int(getattr(self.model, "steps_per_execution", 1) or 1), 1) - 1
        steps = (self.params or {}).get("steps")
        self._from_logs(done if not steps else min(done, steps), logs)

    def _from_logs(self, steps, logs):
        logs = logs or {}
        if LONE_KEY not in logs or QUERY_KEY not in logs:
            self._missing()
            return
        self._observe(steps, logs[LONE_KEY], logs[QUERY_KEY])

    def _observe(self, steps, lone, queries):
        """Hand over the counts since the previous read (``lone``, ``queries``: the
        epoch's after ``steps`` steps)."""
        lone, queries = int(scalar(lone)), int(scalar(queries))
        with self._lock:
            done, read_lone, read_queries = self._read
            if steps <= done or queries < read_queries:
                return  # a late read (JAX's callback threads) or nothing new
            self._read = (steps, lone, queries)
            self.tracker.update(lone - read_lone, queries - read_queries, steps - done)

    def _missing(self):
        if not self._said_missing:
            self._said_missing = True
            LOG.warning("LoneQueryMonitor: the model was compiled without "
                        "tfaploss.training.LoneQueryShare (metrics=[LoneQueryShare()]), so "
                        "no lone query is counted and nothing is checked.")
