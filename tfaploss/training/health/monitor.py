"""The batch-health callback: :class:`TrainingHealthMonitor` judges the statistics of
:mod:`tfaploss.training.health.metrics` and the loss at every step by the rules of
:mod:`tfaploss.training.health.rules`, warns with what to try, and optionally stops
the run (non-finite values are :mod:`tfaploss.training.guards`'s). Why an AP loss
needs it, and the measurements behind the defaults: ``docs/health.md``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import deque

import keras

from tfaploss.config.health import HealthThresholds
from tfaploss.training.compiled_metrics import compiled_metrics, scalar
from tfaploss.training.health.metrics import BatchHealthMetric, batch_health
from tfaploss.training.health.rules import RULES, Step

__all__ = ["TrainingHealthMonitor", "TrainingHealthWarning"]

# Images per step when nothing tells the monitor the training batch size.
_ASSUMED_BATCH = 128
_RULES = {rule.name: rule for rule in RULES}


class TrainingHealthWarning(UserWarning):
    """Training is running but not learning: collapsed embeddings, a flat loss, or
    queries still ranked at chance late in the run."""


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

    Patience is counted in training images, as a share of the run, not in steps: a
    run of 100 steps of 920 images is judged as early as one of 10,000 steps of 64.
    Each rule (:data:`~tfaploss.training.health.rules.RULES`, docs/health.md) keeps a
    trailing window of at least ``W = max(min_window_images, share · N)`` images (``N``:
    the run's, from Keras's ``params`` or ``total_images``) and is reported when at
    least ``collapse_fraction`` of the window's images count; once, and again only
    after it cleared. Nothing is stopped at the run's last step (it is reported).

    The cosine comes from the compiled :func:`~tfaploss.training.health_metrics`; a
    model compiled without them can pass ``data=(images, labels)``: a held batch
    embedded every ``every`` steps, standing for the steps since the previous one.
    Without either, only the loss is checked. The per-step loss is recovered from
    Keras's running epoch mean (equal batch sizes assumed).

    Cost: O(1) amortised per step; memory, one pair per step of the longest window and
    one small dict per step of the ``trace``.

    Args:
        thresholds: a :class:`~tfaploss.config.health.HealthThresholds` (default: its
            defaults, which only warn); ``**overrides`` replace its fields.
        data, every: an optional held batch ``(images, labels)``, embedded every
            ``every`` steps.
        action: ``"warn"`` (a :class:`TrainingHealthWarning`) or ``"stop"`` (warn,
            then set ``model.stop_training``) at the first report.
        total_images: the run's images when Keras's ``params`` do not tell (without
            either: ``min_window_images / window_share``).
        batch_size: images per step when the compiled metrics do not tell (default the
            held batch's size, else 128).

    ``events`` lists what was reported as ``(step, kind, message)``; ``records`` the
    same as dicts (with the window's ``images`` and ``steps``, ``share_of_run``,
    ``stop``), and ``stopped`` the record that stopped training, or None. ``trace``
    holds what each step gave the rules (``epoch``, ``images``, ``emb_cos``,
    ``chance_ap``, ``loss``): ``tfaploss train`` logs it per epoch, and
    :func:`~tfaploss.training.health.replay` runs other thresholds over such a log.

    Example:

    >>> model.compile(optimizer="adam", loss=SupAPLoss(), metrics=health_metrics())
    >>> model.fit(dataset, epochs=10, callbacks=[TrainingHealthMonitor(stop_share=0.25)])
    """

    def __init__(self, thresholds=None, *, data=None, every=50, action="warn",
                 total_images=None, batch_size=None, **overrides):
        super().__init__()
        thresholds = HealthThresholds() if thresholds is None else thresholds
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(thresholds)})
        if unknown:
            raise TypeError(f"TrainingHealthMonitor: unknown argument(s) {unknown}; the "
                            f"thresholds are the fields of HealthThresholds")
        try:
            self.thresholds = dataclasses.replace(thresholds, **overrides)
        except ValueError as e:
            raise ValueError(f"TrainingHealthMonitor: {e}") from None
        for arg, value, low, optional in (("every", every, 0, False),
                                          ("total_images", total_images, 1, True),
                                          ("batch_size", batch_size, 1, True)):
            if optional and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"TrainingHealthMonitor: {arg} must be an int >= {low}"
                                 f"{' or None' if optional else ''}, received "
                                 f"{arg}={value!r}")
        if action not in ("warn", "stop"):
            raise ValueError("TrainingHealthMonitor: action must be 'warn' or 'stop', "
                             f"received action={action!r}")
        if self.thresholds.stop_share is not None and action == "stop":
            raise ValueError(
                "TrainingHealthMonitor: stop_share is only used with action='warn' "
                "(action='stop' stops at the first report); received "
                f"stop_share={self.thresholds.stop_share!r} with action='stop'")
        self.total_images, self.batch_size = total_images, batch_size
        self.data, self.every, self.action = data, max(every, 1), action
        self.events, self.records, self.stopped, self.trace = [], [], None, []

    # -- state ----------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._metrics = None  # compiled metrics are built by the first step: look then
        self._step = 0
        self._epoch = 0
        self.first_cos = None
        self._warned = {rule.name: False for rule in RULES}
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
        running = scalar(logs["loss"]) if "loss" in logs else None
        loss = self._step_loss(running)
        self.trace.append({"epoch": self._epoch + 1, "images": images,
                           "emb_cos": None if health is None else health[0],
                           "chance_ap": None if health is None else health[2],
                           "loss": loss})
        cos = std = chance = None
        weight = images
        if health is not None:
            cos, std, chance, steps = health
            weight = steps * images
            if math.isfinite(cos):  # non-finite embeddings are the guards' to report
                if self.first_cos is None:
                    self.first_cos = cos
                self._seen += weight
        self._judge(Step(cos, std, chance, weight, images, loss, running,
                         self._epoch_step, self._past))

    def _judge(self, step):
        """Add the step to each rule's window, then report the rules that fire."""
        t, windows, added = self.thresholds, self._windows, []
        for rule in RULES:
            value = self._counts(rule, step) if rule.name in windows else None
            if value is None:
                continue
            weight = step.images if rule.reads == "health" else step.batch
            windows[rule.name].add(weight, float(value))
            added.append(rule)
        judged = [rule for rule in added if rule.action != "tally"
                  and all(self._ready(windows[n]) for n in (rule.name, *rule.needs))]
        for rule in judged:
            if rule.action == "warn" and rule.clears(t, windows[rule.name], step):
                self._warned[rule.name] = False
        for rule in judged:
            window = windows[rule.name]
            if not rule.fires(t, window, step):
                continue
            if rule.action == "warn" and (self._warned[rule.name] or any(
                    self._warned[name] or _RULES[name].fires(t, windows[name], step)
                    for name in rule.yields_to)):
                continue
            self._report(rule.reports or rule.name, rule.message(self, window, step),
                         window, rule.action == "stop" or self.action == "stop")

    def _counts(self, rule, step):
        """What ``step`` adds to ``rule``'s window, or None."""
        if rule.reads == "health" and (step.cos is None or not math.isfinite(step.cos)):
            return None
        if rule.reads == "loss" and (step.loss is None or not math.isfinite(step.loss)):
            return None
        if rule.start is not None and not self._past(rule.start(self.thresholds)):
            return None  # only the steps after the rule's start are judged
        return rule.counts(self.thresholds, step)

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
        """One window per rule that is on: ``share`` of the run, at least
        ``min_window_images``, at most what is left of the run after its start."""
        t, total = self.thresholds, self._run_images(images)
        windows = {}
        for rule in RULES:
            share = rule.share(t)
            if share is None:
                continue
            if total is None:
                scale = share / t.window_share if t.window_share > 0 else 1.0
                windows[rule.name] = _Trailing(
                    math.ceil(t.min_window_images * max(scale, 1.0)))
                continue
            size = max(t.min_window_images, math.ceil(share * total))
            # A run whose rest is shorter than the window is judged on all of it, at
            # its last step.
            start = 0.0 if rule.start is None else rule.start(t)
            rest = total - math.floor(start * total)
            windows[rule.name] = (_Trailing(max(rest, 1), capped=True) if size >= rest
                                  else _Trailing(size))
        self._total = total
        return windows

    def _batch_images(self):
        """Images of this step: the compiled metrics' batch, else ``batch_size``, else
        the held batch's size, else 128."""
        for m in (self._metrics or {}).values():
            b = scalar(m.images)
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

    def _past(self, share):
        """Whether the run is past its first ``share`` of images
        (``min_window_images`` when the run's length is unknown)."""
        return self._seen > (share * self._total if self._total
                             else self.thresholds.min_window_images)

    def window(self, name):
        """The trailing window of the rule ``name``."""
        return self._windows[name]

    def span(self, window):
        """'the last 9,200 training images (10 steps, 10% of the run's 92,000)'"""
        text = (f"the last {window.images:,} training images ({len(window.steps)} "
                f"step{'s' if len(window.steps) != 1 else ''}")
        if self._total:
            text += f", {window.images / self._total:.0%} of the run's {self._total:,}"
        return text + ")"

    # -- reading the step ------------------------------------------------------------

    def _health(self):
        """(cos_mean, cos_std, chance_ap, steps covered) of this step, or None."""
        if self._metrics is None:
            self._metrics = _find_metrics(self.model)
        if "emb_cos" in self._metrics:
            last = {k: scalar(m.last) for k, m in self._metrics.items()}
            return last["emb_cos"], last.get("emb_cos_std"), last.get("chance_ap"), 1
        if self.data is not None and (self._step == 1 or self._step % self.every == 0):
            images, labels = self.data
            h = batch_health(self.model(images, training=False), labels)
            # One held-batch check stands for the steps since the previous one.
            steps = 1 if self._step == 1 else self.every
            return scalar(h["cos_mean"]), scalar(h["cos_std"]), scalar(h["chance_ap"]), steps
        return None

    def _step_loss(self, running_mean):
        """This step's loss, recovered from Keras's running epoch mean (None when it
        cannot be: no loss logged, or the previous step's mean is missing)."""
        k = self._epoch_step
        previous = self._previous_mean
        self._previous_mean = running_mean
        if running_mean is None or (k > 1 and previous is None):
            return None
        return running_mean if k == 1 else k * running_mean - (k - 1) * previous

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


def _find_metrics(model) -> dict:
    """The compiled health metrics of ``model`` by statistic (searched recursively)."""
    found = {}
    for m in compiled_metrics(model):
        if isinstance(m, BatchHealthMetric):
            found.setdefault(m.statistic, m)
    return found
