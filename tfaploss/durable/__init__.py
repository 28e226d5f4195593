"""Crash safety: what a kill at any moment leaves on disk is recovered from, and what no
kill leaves is refused, never worked around: whole-or-absent files (``atomic``), a
run's per-epoch backup (``checkpoints``), the checks of a run directory (``run_dir``),
one writer per folder (``locks``) and the crash tests' fault points (``faults``).

Nothing here imports another tfaploss package, Keras or TensorFlow, so training, the
run and the Beam jobs all use it (the one rule that needs the config schema lives in
:mod:`tfaploss.run.resume`).
"""

from tfaploss.durable.checkpoints import DamagedRunError, RunBackup
from tfaploss.durable.locks import LockError, LockHeldError

__all__ = ["DamagedRunError", "LockError", "LockHeldError", "RunBackup"]
