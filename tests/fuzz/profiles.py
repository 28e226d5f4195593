"""Hypothesis profiles of the fuzz tests.

* ``ci`` (the default here, what ``make test`` runs): a short slice, 3 to 6 examples
  per test (a few dozen to ~90 per target, 201 cases, under a minute), derandomised (the
  same examples on every run, so a failure in CI is one anyone can rerun) and without a
  failure database;
* ``fuzz`` (``make fuzz``: ``--hypothesis-profile=fuzz --hypothesis-seed=N``): 6,690
  cases in ~7 minutes, the seed given, and failures kept in ``.cache/hypothesis/``
  (ignored by git), which hypothesis replays first on the next run until they pass.

A test asks :func:`examples` for its own count, since a case costs from a millisecond
(a config) to a fraction of a second (a damaged split read through ``tf.data``).
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

DATABASE = Path(__file__).resolve().parents[2] / ".cache" / "hypothesis"

# Examples per test of each target (loss: per loss class; config: per recipe; records:
# per layout; serving: per image format).
_EXAMPLES = {
    "ci": {"losses": 3, "config": 4, "config_text": 2, "records": 6, "serving": 6},
    "fuzz": {"losses": 60, "config": 150, "config_text": 40, "records": 80,
             "serving": 200},
}

# The cases are slow for hypothesis's taste (a TensorFlow call each); a fixture shared
# by every example (the pristine split, the exported model) is meant to be shared.
_SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                 HealthCheck.differing_executors]

# Hypothesis's "explain" phase re-runs a failing case under a line tracer: minutes for
# a case that calls TensorFlow. The shrunk case and its reproduce blob say enough.
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]

settings.register_profile("ci", deadline=None, phases=_PHASES, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=_SLOW_IS_FINE)
settings.register_profile("fuzz", deadline=None, phases=_PHASES, print_blob=True,
                          database=DirectoryBasedExampleDatabase(str(DATABASE)),
                          suppress_health_check=_SLOW_IS_FINE)
if settings.get_current_profile_name() == "default":
    settings.load_profile("ci")


def examples(target: str) -> int:
    """The examples a test of ``target`` runs under the current profile."""
    profile = settings.get_current_profile_name()
    return _EXAMPLES.get(profile, _EXAMPLES["ci"])[target]

