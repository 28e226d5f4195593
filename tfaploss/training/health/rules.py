"""The rules of the batch-health check, as data (:class:`Rule`: which steps count, over
which window, from when, and what a report does).
:class:`~tfaploss.training.TrainingHealthMonitor` keeps one window per rule and judges
them all alike, with the thresholds of :class:`tfaploss.config.health.HealthThresholds`.
To add a rule, add a :class:`Rule` to :data:`RULES` with its message.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from tfaploss.config.health import HealthThresholds

__all__ = ["COLLAPSE_CAUSES", "FLAT_CAUSES", "RULES", "STALL_CAUSES", "Rule", "Step"]

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


class Step(NamedTuple):
    """What one training step gives the rules."""

    cos: float | None       # emb_cos (None: no health value this step)
    std: float | None       # emb_cos_std
    chance: float | None    # chance_ap
    images: int             # images the health values stand for (a held batch: several steps)
    batch: int              # images of this step
    loss: float | None      # this step's loss
    running: float | None   # Keras's running epoch mean of the loss
    epoch_step: int
    past: Callable[[float], bool]  # whether the run is past its first share


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def _most(t: HealthThresholds, window, step) -> bool:
    return window.share >= t.collapse_fraction


def _under_half(t: HealthThresholds, window, step) -> bool:
    return window.share < t.collapse_fraction / 2


@dataclass(frozen=True)
class Rule:
    """One health rule.

    Args:
        name: its window's name, and the kind it reports unless ``reports`` says.
        counts: ``(thresholds, step) -> bool or value``, what the step adds to the
            window (weighted by its images), or None to add nothing.
        share: ``thresholds -> share of the run`` the window covers (None: rule off).
        start: ``thresholds -> share of the run`` before which the rule counts nothing
            (its window then covers at most the rest of the run); None: from the
            first step.
        action: ``"warn"`` (once, again after it ``clears``; a stop under
            ``action="stop"``), ``"stop"`` (stop the run) or ``"tally"`` (never
            reported: read by other rules' messages).
        reads: ``"health"`` (steps with a finite ``emb_cos``) or ``"loss"`` (steps with
            a finite loss).
        fires, clears: ``(thresholds, window, step) -> bool``: reported when it fires,
            re-armed when it clears.
        yields_to: rules whose report, or firing window, silences this one.
        needs: rules whose windows must be ready for this one to be judged.
        message: ``(monitor, window, step) -> str``.
    """

    name: str
    counts: Callable
    share: Callable
    start: Callable | None = None
    action: str = "warn"
    reports: str | None = None
    reads: str = "health"
    fires: Callable = _most
    clears: Callable = _under_half
    yields_to: tuple = ()
    needs: tuple = ()
    message: Callable | None = None


# -- predicates ---------------------------------------------------------------------

def _collapsed(t, s):
    return s.cos >= t.collapse_cosine


def _collapsed_at_chance(t, s):
    """Collapsed, with the queries also ranked no better than chance (when known)."""
    return _collapsed(t, s) and (t.stop_chance_ap == 0 or not _finite(s.chance)
                                 or s.chance >= t.stop_chance_ap)


def _stalled_in_cone(t, s):
    """After the run's first ``stop_share``, in a cone wider than a collapse, at chance."""
    return (t.cone_cosine is not None and t.stop_share is not None and _finite(s.chance)
            and s.past(t.stop_share) and s.cos >= t.cone_cosine
            and s.chance >= t.cone_chance_ap)


def _stalled(t, s):
    return s.chance >= t.stall_chance_ap if _finite(s.chance) else None


def _flat(t, window, s):
    lo, hi = window.range
    level = max(abs(lo), abs(hi))
    # Relative to the window's own level (a converged loss near 0 varies a lot
    # relative to itself), plus the per-step loss's float32 recovery from the running
    # mean, relative to the mean.
    tolerance = t.flat_rtol * level + 4 * s.epoch_step * 2.0 ** -24 * abs(s.running)
    # A loss at 0 (every batch ranked perfectly) has converged, not stalled.
    return level > 1e-6 and hi - lo <= tolerance


# -- messages -----------------------------------------------------------------------

def _collapse_message(m, window, s, stop=False):
    t = m.thresholds
    detail = f"spread {s.std:.2g}" if s.std is not None else ""
    if s.chance is not None:
        detail += f"{', ' if detail else ''}{s.chance:.0%} of queries at chance AP"
    also = (f" and at least {t.stop_chance_ap:.0%} of queries ranked no better "
            f"than chance (chance_ap)" if stop and t.stop_chance_ap else "")
    message = (
        f"the embeddings have collapsed: over {m.span(window)}, {window.share:.0%} "
        f"(threshold {t.collapse_fraction:.0%}) of the images came from batches whose "
        f"mean cosine between different images (emb_cos) was >= {t.collapse_cosine:g}"
        f"{also} (now {s.cos:.4f}{'; ' + detail if detail else ''}; it was "
        f"{m.first_cos:.4f} at the first step). ")
    at_chance_share = m.window("collapse_chance").share
    if stop or at_chance_share >= t.collapse_fraction:
        message += ("Every image sits at nearly the same point, so retrieval is close "
                    "to chance. ")
    else:
        message += (
            f"Yet most queries still rank better than chance (only "
            f"{at_chance_share:.0%} of these images came from batches with chance_ap "
            f">= {t.stop_chance_ap:g}): the model may still be learning inside a "
            f"narrow cone, as runs at too high a learning rate sometimes do before "
            f"they escape. ")
    message += COLLAPSE_CAUSES
    if not stop and t.stop_share is not None:
        message += (f" Training will be stopped if the collapse, with retrieval at "
                    f"chance, holds over {t.stop_share:.0%} of the run (stop_share).")
    return message


def _stop_message(m, window, s):
    t = m.thresholds
    if m.window("collapse").share >= t.collapse_fraction:
        return _collapse_message(m, window, s, stop=True)
    return (
        f"the embeddings have stalled in a narrow cone: after the run's first "
        f"{t.stop_share:.0%}, over {m.span(window)}, {window.share:.0%} of the "
        f"images came from batches whose mean cosine between different images "
        f"(emb_cos) was >= {t.cone_cosine:g} with at least "
        f"{t.cone_chance_ap:.0%} of queries ranked no better than chance "
        f"(chance_ap) (now {s.cos:.4f}, {s.chance:.0%} at chance; it was "
        f"{m.first_cos:.4f} at the first step). Runs that learn leave the cone "
        f"early: on the glyph sweep, every run that learned was at emb_cos <= 0.66 "
        f"from its second quarter on. " + COLLAPSE_CAUSES)


def _stall_message(m, window, s):
    t = m.thresholds
    return (
        f"training is not learning to rank: after the run's first "
        f"{t.stall_after:.0%}, over {m.span(window)}, {window.share:.0%} of "
        f"the images came from batches in which at least {t.stall_chance_ap:.0%} "
        f"of queries ranked their positives no better than chance (chance_ap) (now "
        f"{s.chance:.0%} at chance, emb_cos {s.cos:.4f}). Runs that learn are far "
        f"below by then: on the glyph sweep, each of the 98 that learned had at most "
        f"20% of its queries at chance in its second half, 83 of them at most 1.5%. " +
        STALL_CAUSES)


def _flat_message(m, window, s):
    lo, hi = window.range
    return (
        f"the training loss has not moved over {m.span(window)}: every batch "
        f"gave {lo:.6g} to {hi:.6g}, a relative range under {m.thresholds.flat_rtol:g}. "
        f"Batches differ, so a learning model's loss varies from batch to batch; a "
        f"constant one means a degenerate state (though runs at too high a learning "
        f"rate have escaped one). " + FLAT_CAUSES)


# -- the rules, judged in this order at each step -------------------------------------

RULES = (
    # A collapse, with retrieval at chance, or a stall in a wide cone, that holds over
    # stop_share of the run: stopped (first, so that its report replaces the warning).
    Rule("collapse_stop", reports="collapse", action="stop", needs=("collapse",),
         counts=lambda t, s: _collapsed_at_chance(t, s) or _stalled_in_cone(t, s),
         share=lambda t: t.stop_share, message=_stop_message),
    Rule("collapse", counts=_collapsed, share=lambda t: t.window_share,
         message=_collapse_message),
    # The collapse's steps at chance: what its message says about retrieval.
    Rule("collapse_chance", action="tally", counts=_collapsed_at_chance,
         share=lambda t: t.window_share),
    # Queries still at chance late in the run, whatever the cosine (a collapse says so
    # itself).
    Rule("stall", counts=_stalled, start=lambda t: t.stall_after, yields_to=("collapse",),
         share=lambda t: None if t.stall_chance_ap is None else t.window_share,
         message=_stall_message),
    # A loss that does not move from batch to batch.
    Rule("flat", reads="loss", counts=lambda t, s: s.loss, fires=_flat,
         clears=lambda t, w, s: not _flat(t, w, s),
         share=lambda t: None if t.flat_rtol is None else t.window_share,
         message=_flat_message),
)
