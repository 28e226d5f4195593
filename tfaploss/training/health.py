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
when the embeddings stay collapsed, the loss stays flat or, after half the run, many
queries still rank at chance, naming the usual causes, and can stop the run.
``tfaploss train`` uses both (``training.health`` in the config).

How long is "stays"? Patience is counted in training images, as a share of the run,
not in consecutive steps: a run of 100 steps of 920 images must be judged as early as
one of 10,000 steps of 64, and a collapsed run whose cosine dips below the threshold
now and then is still collapsed. The rule (see :class:`TrainingHealthMonitor`):

    collapse reported after step t  <=>  sum_{s in W_t} b_s [emb_cos_s >= c]  >=  f · sum_{s in W_t} b_s

where ``b_s`` is the batch size of step ``s``, ``W_t`` the latest steps holding at least
``max(min_window_images, window_share · N)`` images (``N``: the run's images), ``c`` =
``collapse_cosine`` and ``f`` = ``collapse_fraction``; the flat-loss check uses the same
window. Defaults: c = 0.99, f = 0.8, 10 % of the run, at least 8,192 images. A collapse
that still holds over a longer window (``stop_share`` of the run; 25 % in ``tfaploss
train``), counting only the steps whose queries also rank no better than chance
(``chance_ap`` >= 0.5), stops the run. The class docstring gives the measurements
behind these numbers. Non-finite values are not this module's business: a non-finite
loss or weight stops ``tfaploss train`` with its own error
(:mod:`tfaploss.training.guards`).

Cost per step: with ``Q = min(B, max_queries)`` query rows, one Q x B x d matrix
product per metric and, for ``chance_ap``, a Q x B sort (O(Q·B·log B)); O(Q·B) memory.
No O(B³) tensor. The monitor adds O(1) amortised Python work per step and keeps one
``(images, value)`` pair per step of its longest window (a few thousand at most).
"""

from __future__ import annotations

import math
import types
import warnings
from collections import deque

import keras
from keras import ops

DEFAULT_MAX_QUERIES = 256
# Cosines are in [-1, 1]: a positive tied with a negative is ranked below it.
_TIE_EPS = 1e-6


class TrainingHealthWarning(UserWarning):
    """Training is running but not learning: collapsed embeddings, a flat loss, or
    queries still ranked at chance late in the run."""


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
    """One batch-health statistic (see the module docstring), averaged over the epoch;
    ``last`` holds the latest batch's value and ``images`` its size (what
    :class:`TrainingHealthMonitor` counts patience in). Neither is saved with a model.

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

    def reset_state(self):
        for v in (self.total, self.count, self.last, self.images):
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
    try:
        return float(x)  # a scalar tensor or variable of any backend, a numpy value
    except (TypeError, ValueError):
        pass
    read = getattr(x, "numpy", None)  # tf.distribute's variables (read aggregated)
    return float(read() if callable(read) else keras.ops.convert_to_numpy(x))


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

STALL_CAUSES = (
    "Usual causes: (1) the learning rate is too high or too low (compare runs at 10x "
    "each way); (2) too few positives per batch: a class-balanced sampler "
    "(sampler: m_per_class) with at least 2 images per class, and a batch of many "
    "classes; (3) a loss whose positives barely count at this batch size: at B=2048 "
    "with 4 images per class, ContrastiveLoss(averaging='pairs') spread every "
    "embedding apart (emb_cos near 0) while 29-61% of queries stayed at chance "
    "(test MAP@R 3.5 after 96 updates), where averaging='per_query' reached 41.6 and "
    "APLoss 94.6 (docs/batch_sweep/first_sweep.md).")


# Defaults of the patience rule (TrainingHealthMonitor's docstring says why).
DEFAULT_COLLAPSE_COSINE = 0.99
DEFAULT_COLLAPSE_FRACTION = 0.8
DEFAULT_WINDOW_SHARE = 0.1
DEFAULT_MIN_WINDOW_IMAGES = 8192
DEFAULT_STOP_SHARE = 0.25  # tfaploss train's; the callback itself never stops by default
DEFAULT_STOP_CHANCE_AP = 0.5
# A run that stays in a wide cone with many queries at chance after its first
# stop_share: on the glyph sweep at B=2048 (docs/batch_sweep/first_sweep.md), ROADMAP at every rate
# and PNP-Dq at 1.6e-2, 9 runs of 24 and 96 updates, sat at emb_cos 0.95-0.99 with
# 33-76 % of queries at chance (epoch means) in every epoch after the first
# (validation MAP@R 0.3-5 %), below the 0.99 collapse line. Every run of the sweep
# that learned (validation MAP@R 10-99 %, 65 runs) was at emb_cos <= 0.66 from its
# second epoch (of 4) on, so the cosine separates them; the chance condition only
# keeps a run that ranks inside the cone (digits at lr 1e-2, see the class docstring)
# going. It was 0.35 until ROADMAP at 4e-3 with 96 updates (B=2048) slipped under it:
# 39, 35 and 33 % at chance in its last three epochs at emb_cos 0.97-0.95, trained to
# the end at validation MAP@R 2.3 without a word. 0.25 leaves a margin of 0.08 below
# the lowest stalled epoch.
DEFAULT_CONE_COSINE = 0.95
DEFAULT_CONE_CHANCE_AP = 0.25
# A run whose queries still rank no better than chance after half of it, whatever its
# cosine, is warned about (tfaploss train never stops it for that). On the glyph sweep
# (docs/batch_sweep/first_sweep.md; epoch means of its 116 runs of 4 epochs), each of the 98 runs
# that learned (validation MAP@R 15-99 %) had at most 20 % of its queries at chance in
# each epoch of its second half (83 of them at most 1.5 %). Of the 18 that did not
# (0.3-9.6 %), 14 were at 29-74 % there, among them runs the cone rule cannot see: the
# all-pairs ContrastiveLoss at B=2048, spread apart (emb_cos 0.00-0.22) at 29-61 %, the
# per-query one at lr 1.6e-2 (emb_cos 0.80-0.83, 44-46 %) and PNP-Dq at 1e-3 (emb_cos
# 0.28-0.31, 31-37 %); the other 4 (4-26 %) are not caught. 0.3 sits 0.1 above the
# learners.
DEFAULT_STALL_CHANCE_AP = 0.3
DEFAULT_STALL_AFTER = 0.5
DEFAULT_FLAT_RTOL = 1e-3
# Images per step when nothing tells the monitor the training batch size.
_ASSUMED_BATCH = 128


class _Trailing:
    """The latest steps holding at least ``size`` images: ``(images, value)`` per step,
    with the image-weighted sum of the values and, for the flat check, their range
    (monotonic queues: O(1) amortised per step)."""

    def __init__(self, size, capped=False):
        self.size = max(int(size), 1)
        self.capped = capped  # the size is the whole run: judged at its last step
        self.steps = deque()
        self.images = 0
        self.weighted = 0.0
        self._added = 0
        self._lo, self._hi = deque(), deque()

    def add(self, images, value):
        index, self._added = self._added, self._added + 1
        self.steps.append((images, value))
        self.images += images
        self.weighted += images * value
        while self._lo and self._lo[-1][1] >= value:
            self._lo.pop()
        self._lo.append((index, value))
        while self._hi and self._hi[-1][1] <= value:
            self._hi.pop()
        self._hi.append((index, value))
        while self.images - self.steps[0][0] >= self.size:
            old_images, old_value = self.steps.popleft()
            self.images -= old_images
            self.weighted -= old_images * old_value
        first = self._added - len(self.steps)
        for queue in (self._lo, self._hi):
            while queue[0][0] < first:
                queue.popleft()

    @property
    def full(self) -> bool:
        return self.images >= self.size

    @property
    def share(self) -> float:
        """Image-weighted mean of the values (the collapsed share for 0/1 values)."""
        return self.weighted / max(self.images, 1)

    @property
    def range(self) -> tuple[float, float]:
        return self._lo[0][1], self._hi[0][1]


class TrainingHealthMonitor(keras.callbacks.Callback):
    """Warn when training has collapsed or stalled, say what to try, and optionally stop.

    Patience is counted in training images, not in steps: each step adds its batch
    size ``b`` to a trailing window of the latest steps holding at least

        ``W = max(min_window_images, window_share · N)``   images   (at most ``N``)

    where ``N`` is the run's total (Keras's ``params``: ``epochs x steps`` x the batch
    size of the first step; else ``total_images``). Two checks use it:

    * collapse: a step counts as collapsed when its batch's mean off-diagonal cosine
      (``emb_cos``) is >= ``collapse_cosine``; reported when at least
      ``collapse_fraction`` of the window's images came from collapsed steps:
      ``sum b·[emb_cos >= c] >= f · sum b`` over the window. Dips below the threshold
      reset nothing: a run at >= 0.99 with one step in seven at 0.98 is 86 %
      collapsed and is reported; single-step spikes to 1 in a healthy run are not.
    * flat loss: the per-step training loss over the window varied by less than
      ``flat_rtol`` of its level. Real batches differ, so a healthy loss moves from
      batch to batch even on a plateau; a constant one means a degenerate state. A
      loss at 0 (every batch ranked perfectly) is converged and not reported.
    * stall at chance: after the run's first ``stall_after`` (half), at least
      ``collapse_fraction`` of the window's images came from batches in which at
      least ``stall_chance_ap`` of the queries rank no better than chance
      (``chance_ap``), whatever the cosine: a run spread apart, or in a cone, that
      does not rank (``DEFAULT_STALL_CHANCE_AP``'s comment gives the measurements).
      It needs the ``chance_ap`` metric.

    Each check is reported once, again only after it cleared (collapse and stall: the
    window's share fell below half of ``collapse_fraction``; flat: the range grew).
    ``action="stop"`` stops training at the first report of any check. With
    ``action="warn"``, ``stop_share`` stops a *collapse* that lasts: the same rule over
    a longer window, ``max(min_window_images, stop_share · N)`` images, where a step
    counts only if, besides its cosine, at least ``stop_chance_ap`` of its queries rank
    no better than chance (``chance_ap``, when compiled or held). A flat loss or a
    stall at chance alone never triggers that stop, and nothing is stopped at the run's
    last step (nothing is left to save: it is reported as a warning).

    Defaults and why. Measured with the digits benchmark of
    ``experiments/roadmap_start/roadmap_collinear_start.py`` (small_cnn from scratch, B = 96, 150
    steps, 4 losses x 3 seeds at lr 1e-3 and 1e-2, per-step statistics replayed through
    this callback) and the two reported runs:

    * ``collapse_cosine=0.99``: trained models sit far below (0.05-0.6); from scratch
      the first batches are at 0.94-0.96, and at lr 1e-3 one run (CalibrationLoss)
      passed through >= 0.99 for 9 % of the run (to step 17, 1,600 images) and then
      trained normally (R@1 0.92).
    * ``window_share=0.1``: a run collapsed from its start is reported after 10 % of it
      (the B = 920, 100-step APLoss run: at step 10) and 90 % can still be saved.
    * ``collapse_fraction=0.8``: the 690-step ROADMAP run that sat at >= 0.99 for ~400
      steps with dips is reported whatever its dips, as long as they are under 20 % of
      the steps; a start in the cone must last 8 % of the run and 6,554 images.
    * ``min_window_images=8192``: a report needs about 6,500 collapsed images (51 steps
      of 128), four times the longest healthy transient measured, and a short run is
      not judged on a handful of steps (with a 15-step window, the transient above
      would have been reported).
    * ``stop_share=None`` here (the callback only warns unless told), 0.25 in
      ``tfaploss train``: warned at 10 % of the run, stopped if it still holds over
      25 %: a collapsed run costs a quarter of its budget instead of all of it.
    * ``stop_chance_ap=0.5`` (random embeddings give about 0.5, a collapse to one point
      1, a trained model about 0): a cosine >= 0.99 does not always mean retrieval is
      lost. At lr 1e-2 all 12 digits runs sat at >= 0.99 for 19-99 % of their steps;
      some still ranked most queries better than chance there and went on to train
      (ROADMAP seed 1: 67 % of its steps at >= 0.99, R@1 0.80 untrained -> 0.93;
      APLoss seed 2: cosine 1.0000 and its loss pinned at 0.842 for its first 40
      steps, then R@1 0.89). Replayed with windows of 10 % and 25 % of the run, the
      cosine alone stops 11 of the 12; with this condition 8 are stopped (SupAP x 3,
      ROADMAP seed 2, APLoss seed 1, CalibrationLoss x 3: R@1 at or below the
      untrained model's, or far below the 0.93-0.95 of lr 1e-3) and ROADMAP seeds 0-1
      and APLoss seeds 0 and 2 train on. None of the 12 runs at lr 1e-3 is stopped.
      For the same reason a flat loss only warns: APLoss seed 2's was flat for 40
      steps before it escaped.

    The cosine comes from the compiled :func:`health_metrics` (their latest batch, and
    its size; :class:`~tfaploss.training.MultiStageModel`'s steps are whole batches). A
    model compiled without them can pass ``data=(images, labels)``: a held batch
    embedded every ``every`` steps (inference mode), standing for the steps since the
    previous one. Without either, only the loss is checked. The per-step loss is
    recovered from Keras's running epoch mean (equal batch sizes assumed); its float32
    rounding, about ``k * 6e-8`` of the mean at step ``k`` of an epoch, is added to the
    tolerance. Non-finite values are left to :mod:`tfaploss.training.guards`.

    Cost: O(1) amortised per step (a few Python operations and one read of the
    metrics' ``last`` and ``images`` variables); memory, one pair per step of the
    longest window, and one small dict per step of the ``trace``.

    Args:
        patience: deprecated; ``patience=k`` replaces the collapse rule by the old one,
            ``k`` consecutive collapsed steps (which a dip resets and a run of fewer
            than ``k`` large steps never reaches), with no chance_ap condition.
        collapse_cosine: mean cosine at or above which a batch counts as collapsed.
        flat_steps: deprecated; ``flat_steps=k`` gives the flat check a window of ``k``
            steps (0 turns it off, as ``flat_rtol=None`` does).
        flat_rtol: relative range of the loss under which the window is flat (None:
            no flat-loss check).
        data: optional held batch ``(images, labels)``.
        every: steps between two held-batch evaluations.
        action: ``"warn"`` (a :class:`TrainingHealthWarning`) or ``"stop"`` (warn,
            then set ``model.stop_training``) at the first report.
        window_share: share of the run's images the window covers (0: only
            ``min_window_images``).
        min_window_images: smallest window, in images.
        collapse_fraction: share of the window's images that must be collapsed.
        stop_share: with ``action="warn"``, stop when the collapse, with queries at
            chance, holds over this share of the run (>= ``window_share``); None
            never stops.
        stop_chance_ap: the ``chance_ap`` at or above which a collapsed step counts
            towards ``stop_share`` (0: the cosine alone).
        cone_cosine, cone_chance_ap: a step after the run's first ``stop_share`` also
            counts towards ``stop_share`` when its ``emb_cos`` is >= ``cone_cosine``
            and its ``chance_ap`` >= ``cone_chance_ap`` (a run stalled in a cone wider
            than ``collapse_cosine``: measured in ``DEFAULT_CONE_COSINE``'s comment).
            ``cone_cosine=None`` turns this off; it needs the ``chance_ap`` metric.
        stall_chance_ap: the ``chance_ap`` at or above which a step after the run's
            first ``stall_after`` counts as stalled at chance (None: no such check).
        stall_after: share of the run's images before the stall check starts (with
            no known run length, ``min_window_images``).
        total_images: the run's images when Keras's ``params`` do not tell (a dataset
            of unknown length). Without either, the run is taken to be
            ``min_window_images / window_share`` images long.
        batch_size: images per step when the compiled metrics do not tell (held-batch
            or loss-only monitoring); default the held batch's size, else 128.

    ``events`` lists what was reported as ``(step, kind, message)``, ``step`` counting
    the steps of this ``fit``; ``records`` the same as dicts (with ``epoch``,
    ``epoch_step``, ``images`` and ``steps`` of the window, ``run_images``,
    ``share_of_run``, ``stop``), and ``stopped`` the record that stopped training, or
    None. ``trace`` holds what each step of this ``fit`` gave the checks: a dict per
    step with ``epoch`` (from 1), ``images``, ``emb_cos``, ``chance_ap`` and the
    recovered ``loss`` (None where the step had none). ``tfaploss train`` logs it per
    epoch (``health_steps`` in ``epochs.jsonl``, :func:`trace_columns`), and
    :func:`replay` runs a monitor with other arguments over such a log.
    """

    def __init__(self, patience=None, collapse_cosine=DEFAULT_COLLAPSE_COSINE,
                 flat_steps=None, flat_rtol=DEFAULT_FLAT_RTOL, data=None, every=50,
                 action="warn", *, window_share=DEFAULT_WINDOW_SHARE,
                 min_window_images=DEFAULT_MIN_WINDOW_IMAGES,
                 collapse_fraction=DEFAULT_COLLAPSE_FRACTION, stop_share=None,
                 stop_chance_ap=DEFAULT_STOP_CHANCE_AP, cone_cosine=DEFAULT_CONE_COSINE,
                 cone_chance_ap=DEFAULT_CONE_CHANCE_AP,
                 stall_chance_ap=DEFAULT_STALL_CHANCE_AP, stall_after=DEFAULT_STALL_AFTER,
                 total_images=None, batch_size=None):
        super().__init__()

        def count(arg, value, low, optional):
            if optional and value is None:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"TrainingHealthMonitor: {arg} must be an int >= {low}"
                                 f"{' or None' if optional else ''}, received "
                                 f"{arg}={value!r}")

        def share(arg, value, low, high, optional=False, low_open=False):
            if optional and value is None:
                return
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and (low < value if low_open else low <= value) and value <= high)
            if not ok:
                raise ValueError(
                    f"TrainingHealthMonitor: {arg} must be a number in "
                    f"{'(' if low_open else '['}{low:g}, {high:g}]"
                    f"{' or None' if optional else ''}, received {arg}={value!r}")

        count("patience", patience, 0, True)
        count("flat_steps", flat_steps, 0, True)
        count("every", every, 0, False)
        count("min_window_images", min_window_images, 1, False)
        count("total_images", total_images, 1, True)
        count("batch_size", batch_size, 1, True)
        share("collapse_cosine", collapse_cosine, -1.0, 1.0, low_open=True)
        share("collapse_fraction", collapse_fraction, 0.0, 1.0, low_open=True)
        share("window_share", window_share, 0.0, 1.0)
        share("flat_rtol", flat_rtol, 0.0, math.inf, optional=True)
        share("stop_chance_ap", stop_chance_ap, 0.0, 1.0)
        share("cone_cosine", cone_cosine, -1.0, 1.0, optional=True, low_open=True)
        share("cone_chance_ap", cone_chance_ap, 0.0, 1.0)
        share("stall_chance_ap", stall_chance_ap, 0.0, 1.0, optional=True, low_open=True)
        share("stall_after", stall_after, 0.0, 1.0)
        if action not in ("warn", "stop"):
            raise ValueError("TrainingHealthMonitor: action must be 'warn' or 'stop', "
                             f"received action={action!r}")
        if stop_share is not None:
            share("stop_share", stop_share, window_share, 1.0)
            if action == "stop":
                raise ValueError(
                    "TrainingHealthMonitor: stop_share is only used with action='warn' "
                    "(action='stop' stops at the first report); received "
                    f"stop_share={stop_share!r} with action='stop'")
        for arg, value, new in (
                ("patience", patience, ("min_window_images, window_share and "
                                        "collapse_fraction (patience in images, as a "
                                        "share of the run)")),
                ("flat_steps", flat_steps, ("min_window_images and window_share "
                                            "(flat_rtol=None turns the flat check off)"))):
            if value is not None:
                warnings.warn(f"TrainingHealthMonitor: {arg} (consecutive steps) is "
                              f"deprecated; use {new}.", DeprecationWarning, stacklevel=2)
        self.patience = None if patience is None else max(patience, 1)
        self.flat_steps = flat_steps
        self.collapse_cosine = float(collapse_cosine)
        self.collapse_fraction = 1.0 if patience is not None else float(collapse_fraction)
        self.flat_rtol = None if flat_rtol is None or flat_steps == 0 else float(flat_rtol)
        self.window_share, self.min_window_images = float(window_share), min_window_images
        self.stop_share = None if stop_share is None else float(stop_share)
        # The deprecated rule stopped on the cosine alone.
        self.stop_chance_ap = 0.0 if patience is not None else float(stop_chance_ap)
        self.cone_cosine = (None if cone_cosine is None or patience is not None
                            else float(cone_cosine))
        self.cone_chance_ap = float(cone_chance_ap)
        self.stall_chance_ap = (None if stall_chance_ap is None or patience is not None
                                else float(stall_chance_ap))
        self.stall_after = float(stall_after)
        self.total_images, self.batch_size = total_images, batch_size
        self.data, self.every, self.action = data, max(every, 1), action
        self.events, self.records, self.stopped, self.trace = [], [], None, []

    # -- state ----------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._metrics = None  # compiled metrics are built by the first step: look then
        self._step = 0
        self._epoch = 0
        self._first_cos = None
        self._warned = {"collapse": False, "flat": False, "stall": False}
        self._windows = None  # sized at the first step, when the batch size is known
        self._total = None
        self._seen = 0
        self.stopped = None
        self.trace = []
        self.on_epoch_begin(0)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._previous_mean = None
        self._epoch_step = 0

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        self._epoch_step += 1
        if self.stopped is not None:
            return
        logs = logs or {}
        health = self._health()
        images = self._batch_images()
        if self._windows is None:
            self._windows = self._make_windows(images)
        running = _float(logs["loss"]) if "loss" in logs else None
        loss = self._step_loss(running)
        self.trace.append({"epoch": self._epoch + 1, "images": images,
                           "emb_cos": None if health is None else health[0],
                           "chance_ap": None if health is None else health[2],
                           "loss": loss})
        if health is not None:
            cos_mean, cos_std, chance, steps = health
            self._check_collapse(cos_mean, cos_std, chance, steps * images)
            self._check_stall(cos_mean, chance, steps * images)
        if self.flat_rtol is not None and loss is not None:
            self._check_flat(loss, running, images)

    # -- windows --------------------------------------------------------------------

    def _run_steps(self):
        params = self.params or {}
        epochs, steps = params.get("epochs"), params.get("steps")
        if isinstance(epochs, int) and isinstance(steps, int) and epochs > 0 and steps > 0:
            return epochs, steps
        return None

    def _run_images(self, images):
        """The run's training images (None when unknown)."""
        run = self._run_steps()
        if run is not None:
            return run[0] * run[1] * images
        return self.total_images

    def _make_windows(self, images):
        total = self._run_images(images)

        def window(share, legacy_steps):
            if legacy_steps is not None:  # the deprecated consecutive-step rules
                return _Trailing(legacy_steps * images)
            if total is None:
                scale = share / self.window_share if self.window_share > 0 else 1.0
                return _Trailing(math.ceil(self.min_window_images * max(scale, 1.0)))
            size = max(self.min_window_images, math.ceil(share * total))
            return _Trailing(min(size, total), capped=size >= total)

        windows = {"collapse": window(self.window_share, self.patience),
                   "flat": window(self.window_share, self.flat_steps),
                   # The warning's window, counting the steps also at chance.
                   "collapse_chance": window(self.window_share, self.patience)}
        if self.stop_share is not None:
            windows["collapse_stop"] = window(self.stop_share, self.patience)
        if self.stall_chance_ap is not None:
            stall = window(self.window_share, None)
            if total is not None:
                # Only the steps after the grace are judged: a run whose rest is shorter
                # than the window is judged on all of it, at its last step.
                rest = total - math.floor(self.stall_after * total)
                if stall.size >= rest:
                    stall = _Trailing(max(rest, 1), capped=True)
            windows["stall"] = stall
        self._total = total
        return windows

    def _batch_images(self):
        """Images of this step: the compiled metrics' batch, else ``batch_size``, else
        the held batch's size, else 128."""
        for m in (self._metrics or {}).values():
            b = _float(m.images)
            if b >= 1:
                return round(b)
        if self.batch_size is not None:
            return self.batch_size
        if self.data is not None:
            return len(self.data[1])
        return _ASSUMED_BATCH

    def _last_step(self):
        """True at the run's last step (nothing left for a stop to save)."""
        run = self._run_steps()
        return run is not None and self._epoch == run[0] - 1 and self._epoch_step >= run[1]

    def _ready(self, window):
        """Whether ``window`` holds enough images to be judged. A window as long as
        the run (a run shorter than ``min_window_images``) is judged at its last step,
        whatever its last batch held."""
        return window is not None and (window.full or (window.capped and self._last_step()))

    def _grace(self, share):
        """Images of the run's first ``share``, before which a rule does not judge
        (``min_window_images`` when the run's length is unknown)."""
        return share * self._total if self._total else self.min_window_images

    def _span(self, window):
        """'the last 9,200 training images (10 steps, 10% of the run's 92,000)'"""
        text = (f"the last {window.images:,} training images ({len(window.steps)} "
                f"step{'s' if len(window.steps) != 1 else ''}")
        if self._total:
            text += f", {window.images / self._total:.0%} of the run's {self._total:,}"
        return text + ")"

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

    def _stalled_in_cone(self, cos_mean, chance):
        """Whether this step counts towards a stop as stalled in a wide cone."""
        if (self.cone_cosine is None or self.stop_share is None or chance is None
                or not math.isfinite(chance)):
            return False
        return (self._seen > self._grace(self.stop_share) and cos_mean >= self.cone_cosine
                and chance >= self.cone_chance_ap)

    def _cone_message(self, window, cos_mean, chance):
        return (
            f"the embeddings have stalled in a narrow cone: after the run's first "
            f"{self.stop_share:.0%}, over {self._span(window)}, {window.share:.0%} of the "
            f"images came from batches whose mean cosine between different images "
            f"(emb_cos) was >= {self.cone_cosine:g} with at least "
            f"{self.cone_chance_ap:.0%} of queries ranked no better than chance "
            f"(chance_ap) (now {cos_mean:.4f}, {chance:.0%} at chance; it was "
            f"{self._first_cos:.4f} at the first step). Runs that learn leave the cone "
            f"early: on the glyph sweep, every run that learned was at emb_cos <= 0.66 "
            f"from its second quarter on. " + COLLAPSE_CAUSES)

    def _check_collapse(self, cos_mean, cos_std, chance, images):
        if not math.isfinite(cos_mean):
            return  # non-finite embeddings are not a collapse; the loss reports them
        if self._first_cos is None:
            self._first_cos = cos_mean
        collapsed = cos_mean >= self.collapse_cosine
        # Towards a stop, the queries must also rank no better than chance (when known).
        at_chance = collapsed and (
            self.stop_chance_ap == 0 or chance is None or not math.isfinite(chance)
            or chance >= self.stop_chance_ap)
        self._seen += images
        in_cone = self._stalled_in_cone(cos_mean, chance)
        w = self._windows
        w["collapse"].add(images, float(collapsed))
        w["collapse_chance"].add(images, float(at_chance))
        if "collapse_stop" in w:
            w["collapse_stop"].add(images, float(at_chance or in_cone))
        window = w["collapse"]
        if not self._ready(window):
            return
        # The deprecated rule re-arms at any clean step, the share rule below half of it.
        rearm = 1.0 if self.patience is not None else self.collapse_fraction / 2
        if window.share < rearm:
            self._warned["collapse"] = False
        stop_window = w.get("collapse_stop")
        stop = self._ready(stop_window) and stop_window.share >= self.collapse_fraction
        if stop and window.share < self.collapse_fraction:
            self._report("collapse", self._cone_message(stop_window, cos_mean, chance),
                         stop_window, True)
            return
        if stop:
            window = stop_window
        elif window.share < self.collapse_fraction or self._warned["collapse"]:
            return
        detail = f"spread {cos_std:.2g}" if cos_std is not None else ""
        if chance is not None:
            detail += f"{', ' if detail else ''}{chance:.0%} of queries at chance AP"
        rule = ("all" if self.patience is not None
                else f"{window.share:.0%} (threshold {self.collapse_fraction:.0%})")
        also = (f" and at least {self.stop_chance_ap:.0%} of queries ranked no better "
                f"than chance (chance_ap)" if stop and self.stop_chance_ap else "")
        message = (
            f"the embeddings have collapsed: over {self._span(window)}, {rule} of the "
            f"images came from batches whose mean cosine between different images "
            f"(emb_cos) was >= {self.collapse_cosine:g}{also} (now {cos_mean:.4f}"
            f"{'; ' + detail if detail else ''}; it was {self._first_cos:.4f} at the "
            f"first step). ")
        at_chance_share = w["collapse_chance"].share
        if stop or at_chance_share >= self.collapse_fraction:
            message += ("Every image sits at nearly the same point, so retrieval is close "
                        "to chance. ")
        else:
            message += (
                f"Yet most queries still rank better than chance (only "
                f"{at_chance_share:.0%} of these images came from batches with chance_ap "
                f">= {self.stop_chance_ap:g}): the model may still be learning inside a "
                f"narrow cone, as runs at too high a learning rate sometimes do before "
                f"they escape. ")
        message += COLLAPSE_CAUSES
        if not stop and self.stop_share is not None:
            message += (f" Training will be stopped if the collapse, with retrieval at "
                        f"chance, holds over {self.stop_share:.0%} of the run "
                        f"(stop_share).")
        self._report("collapse", message, window, stop or self.action == "stop")

    def _check_stall(self, cos_mean, chance, images):
        """Queries still ranked at chance after the run's first ``stall_after``."""
        if (self.stall_chance_ap is None or chance is None or not math.isfinite(chance)
                or not math.isfinite(cos_mean)):
            return
        if self._seen <= self._grace(self.stall_after):
            return  # only the steps after it are judged
        window = self._windows["stall"]
        window.add(images, float(chance >= self.stall_chance_ap))
        if not self._ready(window):
            return
        if window.share < self.collapse_fraction / 2:
            self._warned["stall"] = False
        # A collapse (reported and not cleared, or filling the collapse window now) is
        # the collapse check's to report, with its own causes.
        collapsing = (self._warned["collapse"]
                      or self._windows["collapse"].share >= self.collapse_fraction)
        if window.share < self.collapse_fraction or self._warned["stall"] or collapsing:
            return
        message = (
            f"training is not learning to rank: after the run's first "
            f"{self.stall_after:.0%}, over {self._span(window)}, {window.share:.0%} of "
            f"the images came from batches in which at least {self.stall_chance_ap:.0%} "
            f"of queries ranked their positives no better than chance (chance_ap) (now "
            f"{chance:.0%} at chance, emb_cos {cos_mean:.4f}). Runs that learn are far "
            f"below by then: on the glyph sweep, each of the 98 that learned had at most "
            f"20% of its queries at chance in its second half, 83 of them at most 1.5%. " +
            STALL_CAUSES)
        self._report("stall", message, window, self.action == "stop")

    def _step_loss(self, running_mean):
        """This step's loss, recovered from Keras's running epoch mean (None when it
        cannot be: no loss logged, or the previous step's mean is missing)."""
        k = self._epoch_step
        previous = self._previous_mean
        self._previous_mean = running_mean
        if running_mean is None or (k > 1 and previous is None):
            return None
        return running_mean if k == 1 else k * running_mean - (k - 1) * previous

    def _check_flat(self, loss, running_mean, images):
        k = self._epoch_step
        if not math.isfinite(loss):
            return
        window = self._windows["flat"]
        window.add(images, loss)
        if not self._ready(window):
            return
        lo, hi = window.range
        level = max(abs(lo), abs(hi))
        # Relative to the window's own level (a converged loss near 0 varies a lot
        # relative to itself), plus the recovery's rounding, relative to the mean.
        tolerance = self.flat_rtol * level + 4 * k * 2.0 ** -24 * abs(running_mean)
        # A loss at 0 (every batch ranked perfectly) has converged, not stalled.
        if level <= 1e-6 or hi - lo > tolerance:
            self._warned["flat"] = False
            return
        if self._warned["flat"]:
            return
        message = (
            f"the training loss has not moved over {self._span(window)}: every batch "
            f"gave {lo:.6g} to {hi:.6g}, a relative range under {self.flat_rtol:g}. "
            f"Batches differ, so a learning model's loss varies from batch to batch; a "
            f"constant one means a degenerate state (though runs at too high a learning "
            f"rate have escaped one). " + FLAT_CAUSES)
        self._report("flat", message, window, self.action == "stop")

    def _report(self, kind, message, window, stop=False):
        self._warned[kind] = True
        if self.stopped is not None:
            return  # stopped by the other check at this step: one reason is enough
        stop = stop and not self._last_step()
        message = ("tfaploss: training stopped: " if stop else "tfaploss: ") + message
        record = {"step": self._step, "epoch": self._epoch + 1,
                  "epoch_step": self._epoch_step, "kind": kind,
                  "stop": stop, "images": window.images, "steps": len(window.steps),
                  "run_images": self._total,
                  "share_of_run": (round(window.images / self._total, 4)
                                   if self._total else None),
                  "message": message}
        self.events.append((self._step, kind, message))
        self.records.append(record)
        warnings.warn(message, TrainingHealthWarning, stacklevel=2)
        if stop:
            self.stopped = record
            self.model.stop_training = True


# Columns of a step in ``TrainingHealthMonitor.trace`` and in epochs.jsonl's
# ``health_steps`` (what ``tfaploss train`` logs), in that order.
TRACE_COLUMNS = ("images", "emb_cos", "chance_ap", "loss")


def trace_columns(steps) -> dict:
    """Steps of :attr:`TrainingHealthMonitor.trace` as columns (``TRACE_COLUMNS``):
    ``{"images": [...], "emb_cos": [...], ...}``, one entry per step, values rounded
    to 6 decimals (None where the step had none)."""
    def cell(value):
        return value if value is None or isinstance(value, int) else round(value, 6)

    return {k: [cell(step[k]) for step in steps] for k in TRACE_COLUMNS}


def replay(epochs, *, total_epochs=None, steps_per_epoch=None,
           **kwargs) -> TrainingHealthMonitor:
    """Run a :class:`TrainingHealthMonitor` over a logged run, step by step as
    ``model.fit`` would have called it, and return it (``records``, ``stopped``,
    ``trace``): what a monitor with other arguments would have said about a real run.

    ``epochs``: one item per epoch, either a row of a run's ``epochs.jsonl`` (its
    ``health_steps``) or those columns themselves: ``emb_cos`` (required; None for a
    step without a value), and optionally ``images`` (default ``batch_size``, else
    128), ``chance_ap`` and ``loss`` (per step; an epoch with a missing loss is replayed
    without one). ``total_epochs`` and ``steps_per_epoch`` are the run's plan (Keras's
    ``params``; default: the epochs given, and the longest of them: a stopped run's
    last epoch is short). ``kwargs`` go to :class:`TrainingHealthMonitor`. Replay stops
    where the monitor stops training. Warnings are not raised (they are in
    ``records``). Cost: O(steps) Python work.
    """
    columns = []
    for number, row in enumerate(epochs, 1):
        if not isinstance(row, dict):
            raise TypeError(f"replay: epochs[{number - 1}] must be a dict (an "
                            f"epochs.jsonl row, or its health_steps columns); received "
                            f"{type(row).__name__}")
        steps = row.get("health_steps", row)
        if not isinstance(steps, dict) or not isinstance(steps.get("emb_cos"), list):
            raise ValueError(f"replay: epochs[{number - 1}] has no per-step emb_cos list "
                             f"(rows written before tfaploss logged health_steps have "
                             f"none); received {row!r:.200}")
        columns.append(steps)
    cosine, chance = BatchHealthMetric("emb_cos"), BatchHealthMetric("chance_ap")
    has_chance = any(any(v is not None for v in c.get("chance_ap") or []) for c in columns)
    model = types.SimpleNamespace(metrics=[cosine, chance] if has_chance else [cosine],
                                  stop_training=False)
    monitor = TrainingHealthMonitor(**kwargs)
    monitor.set_model(model)
    monitor.set_params({"epochs": total_epochs or len(columns), "verbose": 0,
                        "steps": steps_per_epoch or max(len(c["emb_cos"]) for c in columns)})
    default_images = kwargs.get("batch_size") or _ASSUMED_BATCH

    def value(x):
        return math.nan if x is None else float(x)

    monitor.on_train_begin()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainingHealthWarning)
        for epoch, c in enumerate(columns):
            monitor.on_epoch_begin(epoch)
            n = len(c["emb_cos"])
            images = c.get("images") or [default_images] * n
            chances = c.get("chance_ap") or [None] * n
            losses = c.get("loss") or []
            if len(losses) != n or any(x is None for x in losses):
                losses = None
            total = 0.0
            for k in range(n):
                cosine.last.assign(value(c["emb_cos"][k]))
                cosine.images.assign(images[k])
                if has_chance:
                    chance.last.assign(value(chances[k]))
                    chance.images.assign(images[k])
                logs = {}
                if losses is not None:
                    total += losses[k]
                    logs["loss"] = total / (k + 1)
                monitor.on_train_batch_end(k, logs)
                if model.stop_training:
                    return monitor
    return monitor
