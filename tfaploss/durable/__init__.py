"""Crash safety: what a kill at any moment leaves on disk is recovered from, and what no
kill leaves is refused, never worked around.

- :mod:`tfaploss.durable.atomic`: files that are whole or absent (temporary name,
  fsync, rename, folder sync).
- :mod:`tfaploss.durable.checkpoints`: a training run's per-epoch backup
  (:class:`RunBackup`) and :class:`DamagedRunError`.
- :mod:`tfaploss.durable.run_dir`: every file of a run directory checked before a run
  trusts it, and ``--restart``'s moving aside.
- :mod:`tfaploss.durable.locks`: one writer per run directory or job output.
- :mod:`tfaploss.durable.faults`: the fault points the crash tests kill a process at.

Nothing here imports another tfaploss package (or Keras, or TensorFlow), so training,
the run and the Beam jobs all use it; the one rule that needs the config schema,
whether a run directory holds this config's run, is :mod:`tfaploss.run.resume`.
:mod:`tfaploss.durable.locks` also loads alone, from its file (the lock tests' racing
processes do).
"""

from tfaploss.durable.checkpoints import DamagedRunError, RunBackup
from tfaploss.durable.locks import LockError, LockHeldError

__all__ = ["DamagedRunError", "LockError", "LockHeldError", "RunBackup"]
