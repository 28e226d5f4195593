"""Batch health: notice a run that has collapsed or stopped learning, and say why.

An AP surrogate can sit at chance for a whole budget without an error: every
embedding driven to one point (a network trained from scratch starts with all
embeddings in a narrow cone, and ROADMAP's calibration term can hold them there), or a
loss pinned at a degenerate value (``APLoss`` at ``1 - 1/(B-1)`` after too large a
learning rate). Three cheap statistics of the training batch show it:

* ``emb_cos``: mean cosine between the embeddings of different images of the batch
  (1 = every image at the same point; a trained model sits far below);
* ``emb_cos_std``: their spread (0 = no structure left to rank by);
* ``chance_ap``: fraction of queries (with a positive) whose AP does not beat the
  expected AP of a random ranking of the batch; ties count against the query, so
  identical embeddings give 1, random ones about one half, a trained model near 0.

:func:`health_metrics` gives them as Keras metrics: ``compile(metrics=health_metrics())``
logs them to the progress bar and TensorBoard, in plain ``model.fit`` and in
:class:`~tfaploss.training.MultiStageModel` (whose ``train_step`` hands the compiled
metrics the batch labels and embeddings). :class:`TrainingHealthMonitor` is the
callback that reads them, and the loss, and warns (:class:`TrainingHealthWarning`)
when the embeddings stay collapsed or the loss stays flat, naming the usual causes.
``tfaploss train`` uses both.

Cost per step: with ``Q = min(B, max_queries)`` query rows, one Q x B x d matrix
product per metric and, for ``chance_ap``, a Q x B sort (O(Q·B·log B)); O(Q·B) memory.
No O(B³) tensor.
"""

from __future__ import annotations

import math
import warnings
from collections import deque

import keras
from keras import ops

DEFAULT_MAX_QUERIES = 256
# Cosines are in [-1, 1]: a positive tied with a negative is ranked below it.
_TIE_EPS = 1e-6


class TrainingHealthWarning(UserWarning):
    """Training is running but not learning: collapsed embeddings or a flat loss."""


def _scores(embeddings, labels, max_queries):
    """Cosines of the first ``max_queries`` rows against the batch, and the masks."""
    e = ops.cast(embeddings, "float32")
    e = e / ops.sqrt(ops.maximum(ops.sum(e * e, axis=-1, keepdims=True), 1e-24))
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
    """One batch-health statistic (see the module docstring), averaged over the epoch;
    ``last`` holds the latest batch's value.

    ``y_true`` = integer labels, ``y_pred`` = embeddings, as the tfaploss losses take.

    Args:
        statistic: ``"emb_cos"`` (mean off-diagonal cosine), ``"emb_cos_std"`` (their
            spread) or ``"chance_ap"`` (fraction of queries at chance AP).
        max_queries: rows of the batch used as queries (cost O(max_queries·B·d)).
        name: metric name (default: ``statistic``).
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
        self.last = self.add_variable((), initializer="zeros", name="last")

    def update_state(self, y_true, y_pred, sample_weight=None):
        v = STATISTICS[self.statistic](y_pred, y_true, self.max_queries)
        v = ops.cast(v, self.dtype)
        self.total.assign_add(v)
        self.count.assign_add(ops.cast(1.0, self.dtype))
        self.last.assign(v)

    def result(self):
        return self.total / ops.maximum(self.count, 1.0)

    def reset_state(self):
        for v in (self.total, self.count, self.last):
            v.assign(ops.zeros((), v.dtype))

    def get_config(self):
        return {**super().get_config(), "statistic": self.statistic,
                "max_queries": self.max_queries}


def health_metrics(max_queries=DEFAULT_MAX_QUERIES):
    """The three batch-health metrics, for ``model.compile(metrics=...)``."""
    return [BatchHealthMetric(s, max_queries) for s in STATISTICS]


def _find_metrics(model) -> dict:
    """The compiled health metrics of ``model`` by statistic (searched recursively)."""
    found, stack, seen = {}, list(getattr(model, "metrics", [])), set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if isinstance(m, BatchHealthMetric):
            found.setdefault(m.statistic, m)
        stack.extend(getattr(m, "metrics", []) or [])
    return found


def _float(x) -> float:
    if isinstance(x, keras.Variable):
        x = x.value
    return float(keras.ops.convert_to_numpy(x))


COLLAPSE_CAUSES = (
    "Usual causes: (1) the learning rate is too high (try it 10x lower; from scratch "
    "keep it at 1e-3 or below); (2) a near-collinear start: a network trained from "
    "scratch puts every embedding in a narrow cone (non-negative ReLU features), which "
    "SupAPLoss escapes but a calibration term can close; start from pretrained weights "
    "(model.weights: imagenet) or train with SupAPLoss first; (3) the calibration "
    "weight: CalibrationLoss alone, or ROADMAPLoss with a large lambda_, pushes every "
    "pair towards its margins; lower loss.lambda_ (e.g. 0.1). See the ROADMAPLoss "
    "docstring for measurements.")
FLAT_CAUSES = (
    "Usual causes: (1) the learning rate is too high and the model jumped to a "
    "degenerate solution (APLoss at 1 - 1/(B-1): every similarity in one histogram bin), "
    "or too low / decayed to 0; (2) collapsed embeddings (see emb_cos); (3) a near-"
    "collinear start from a network trained from scratch, or a calibration weight "
    "(ROADMAPLoss lambda_) that keeps it there.")


class TrainingHealthMonitor(keras.callbacks.Callback):
    """Warn when training has collapsed or stalled, and say what to try.

    Two checks, each warned once (again only after the condition cleared):

    * collapse: the batch's mean off-diagonal cosine (``emb_cos``) has been
      >= ``collapse_cosine`` for ``patience`` consecutive steps;
    * flat loss: the training loss of the last ``flat_steps`` steps varied by less
      than ``flat_rtol`` of its value. Real batches differ, so a healthy loss moves
      from batch to batch even on a plateau; a constant one means a degenerate state.
      A loss at 0 (every batch ranked perfectly) is converged and not reported.

    The per-step loss is recovered from Keras's running epoch mean (equal batch sizes
    assumed); its float32 rounding, about ``k * 6e-8`` relative at step ``k`` of an
    epoch, is added to the tolerance.

    The cosine comes from the compiled :func:`health_metrics` (their latest batch). A
    model compiled without them can pass ``data=(images, labels)``: a held batch
    embedded every ``every`` steps (inference mode) instead. Without either, only
    the loss is checked.

    Args:
        patience: consecutive collapsed steps before warning.
        collapse_cosine: mean cosine at or above which a batch counts as collapsed.
        flat_steps: window of the flat-loss check (0 turns it off).
        flat_rtol: relative range of the loss under which the window is flat.
        data: optional held batch ``(images, labels)``.
        every: steps between two held-batch evaluations.
        action: ``"warn"`` (a :class:`TrainingHealthWarning`) or ``"stop"`` (warn,
            then set ``model.stop_training``).

    ``events`` lists what was reported as ``(step, kind, message)``.
    """

    def __init__(self, patience=200, collapse_cosine=0.99, flat_steps=200, flat_rtol=1e-3,
                 data=None, every=50, action="warn"):
        super().__init__()
        for arg, value in (("patience", patience), ("flat_steps", flat_steps),
                           ("every", every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TrainingHealthMonitor: {arg} must be an int >= 0, "
                                 f"received {arg}={value!r}")
        if not -1.0 < collapse_cosine <= 1.0:
            raise ValueError("TrainingHealthMonitor: collapse_cosine must be in (-1, 1], "
                             f"received collapse_cosine={collapse_cosine!r}")
        if action not in ("warn", "stop"):
            raise ValueError("TrainingHealthMonitor: action must be 'warn' or 'stop', "
                             f"received action={action!r}")
        self.patience, self.collapse_cosine = max(patience, 1), float(collapse_cosine)
        self.flat_steps, self.flat_rtol = flat_steps, float(flat_rtol)
        self.data, self.every, self.action = data, max(every, 1), action
        self.events = []

    # -- state ----------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._metrics = None  # compiled metrics are built by the first step: look then
        self._step = 0
        self._collapsed_for = 0
        self._first_cos = None
        self._warned = {"collapse": False, "flat": False}
        self._losses = deque(maxlen=max(self.flat_steps, 1))
        self.on_epoch_begin(0)

    def on_epoch_begin(self, epoch, logs=None):
        self._previous_mean = None
        self._epoch_step = 0

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        self._epoch_step += 1
        logs = logs or {}
        if self.flat_steps and "loss" in logs:
            self._check_flat(_float(logs["loss"]))
        health = self._health()
        if health is not None:
            self._check_collapse(*health)

    # -- checks ---------------------------------------------------------------------

    def _health(self):
        """(cos_mean, cos_std, chance_ap, steps covered) of this step, or None."""
        if self._metrics is None:
            self._metrics = _find_metrics(self.model)
        if "emb_cos" in self._metrics:
            last = {k: _float(m.last) for k, m in self._metrics.items()}
            return last["emb_cos"], last.get("emb_cos_std"), last.get("chance_ap"), 1
        if self.data is not None and (self._step == 1 or self._step % self.every == 0):
            images, labels = self.data
            h = batch_health(self.model(images, training=False), labels)
            # One held-batch check stands for the steps since the previous one.
            steps = 1 if self._step == 1 else self.every
            return _float(h["cos_mean"]), _float(h["cos_std"]), _float(h["chance_ap"]), steps
        return None

    def _check_collapse(self, cos_mean, cos_std, chance, steps=1):
        if not math.isfinite(cos_mean):
            return  # non-finite embeddings are not a collapse; the loss reports them
        if self._first_cos is None:
            self._first_cos = cos_mean
        if cos_mean < self.collapse_cosine:
            self._collapsed_for = 0
            self._warned["collapse"] = False
            return
        self._collapsed_for += steps
        if self._collapsed_for < self.patience or self._warned["collapse"]:
            return
        detail = f"spread {cos_std:.2g}" if cos_std is not None else ""
        if chance is not None:
            detail += f"{', ' if detail else ''}{chance:.0%} of queries at chance AP"
        message = (
            f"tfaploss: the embeddings have collapsed: for {self._collapsed_for} steps the "
            f"mean cosine between different images of a batch has been >= "
            f"{self.collapse_cosine:g} (now {cos_mean:.4f}{'; ' + detail if detail else ''}; "
            f"it was {self._first_cos:.4f} at the first step). Every image sits at nearly "
            f"the same point, so retrieval is close to chance. " + COLLAPSE_CAUSES)
        self._report("collapse", message)

    def _check_flat(self, running_mean):
        k = self._epoch_step
        previous = self._previous_mean
        self._previous_mean = running_mean
        if k == 1:
            loss = running_mean
        elif previous is None:
            return
        else:
            loss = k * running_mean - (k - 1) * previous
        if not math.isfinite(loss):
            return
        self._losses.append(loss)
        if len(self._losses) < self.flat_steps:
            return
        lo, hi = min(self._losses), max(self._losses)
        if max(abs(lo), abs(hi)) <= 1e-6:
            return  # a loss at 0 (every batch ranked perfectly) has converged, not stalled
        scale = max(abs(running_mean), 1e-12)
        tolerance = self.flat_rtol * scale + 4 * k * 2.0 ** -24 * scale
        if hi - lo > tolerance:
            self._warned["flat"] = False
            return
        if self._warned["flat"]:
            return
        message = (
            f"tfaploss: the training loss has not moved for {self.flat_steps} steps "
            f"(every batch gave {lo:.6g} to {hi:.6g}, a relative range under "
            f"{self.flat_rtol:g}). Batches differ, so a learning model's loss varies "
            f"from batch to batch; a constant one means a degenerate state. " + FLAT_CAUSES)
        self._report("flat", message)

    def _report(self, kind, message):
        self._warned[kind] = True
        self.events.append((self._step, kind, message))
        warnings.warn(message, TrainingHealthWarning, stacklevel=2)
        if self.action == "stop":
            self.model.stop_training = True
