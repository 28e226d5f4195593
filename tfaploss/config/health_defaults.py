"""The batch-health check's default thresholds, in one place for the callback
(:class:`tfaploss.training.TrainingHealthMonitor`) and the run configuration
(``training.health``, :class:`tfaploss.config.HealthConfig`). Plain numbers, so that
:mod:`tfaploss.config` can use them without importing Keras. The callback's docstring
gives the measurements behind them.
"""

# Defaults of the patience rule (TrainingHealthMonitor's docstring says why).
DEFAULT_COLLAPSE_COSINE = 0.99
DEFAULT_COLLAPSE_FRACTION = 0.8
DEFAULT_WINDOW_SHARE = 0.1
DEFAULT_MIN_WINDOW_IMAGES = 8192
DEFAULT_STOP_SHARE = 0.25  # tfaploss train's; the callback itself never stops by default
DEFAULT_STOP_CHANCE_AP = 0.5
# A run that stays in a wide cone with many queries at chance after its first
# stop_share: on the glyph sweep at B=2048 (docs/batch_sweep.md), ROADMAP at every rate
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
DEFAULT_FLAT_RTOL = 1e-3
