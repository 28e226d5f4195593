"""Crash safety: whole-or-absent files (``atomic``), a run's backup (``checkpoints``),
the checks of a run directory (``run_dir``), one writer per folder (``locks``) and the
crash tests' fault points (``faults``). Imports no other tfaploss package, nor Keras."""

from tfaploss.durable.checkpoints import DamagedRunError, RunBackup
from tfaploss.durable.locks import LockError, LockHeldError

__all__ = ["DamagedRunError", "LockError", "LockHeldError", "RunBackup"]
