"""The training run: what ``tfaploss train`` does with a validated config. ``build``
turns a :class:`~tfaploss.config.Config` into Keras objects (importable, so a notebook
can start from a recipe and change one thing), ``trainer`` runs it from run directory
to saved model and summary, resumably; ``resume`` decides whether a run directory
holds this config's run. :mod:`tfaploss.config` only describes a run; this package
carries it out.
"""

from tfaploss.run.trainer import embed_split, evaluate_split, initial_model, train

__all__ = ["embed_split", "evaluate_split", "initial_model", "train"]
