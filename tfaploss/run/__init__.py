"""The training run: what ``tfaploss train`` does with a validated config.

- :mod:`tfaploss.run.build`: a :class:`~tfaploss.config.Config` becomes Keras objects
  (model, loss, optimizer, datasets), importable so a notebook can start from a recipe
  and change one thing.
- :mod:`tfaploss.run.schedule`: the learning-rate schedules a config names.
- :mod:`tfaploss.run.trainer`: the run itself, from run directory to saved model,
  summary and final evaluation; resumable after a kill.
- :mod:`tfaploss.run.resume`: whether a run directory holds this config's run (over the
  file checks of :mod:`tfaploss.durable.run_dir`: what a kill leaves is recovered from,
  damage is refused).

:mod:`tfaploss.config` only describes a run (schema and YAML loading, no Keras); this
package carries it out. It sits above ``data``, ``models``, ``losses`` and ``training``
and below the command line.
"""

from tfaploss.run.trainer import embed_split, evaluate_split, initial_model, train

__all__ = ["embed_split", "evaluate_split", "initial_model", "train"]
