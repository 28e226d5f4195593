"""The training run: ``build`` turns a :class:`~tfaploss.config.Config` into Keras
objects, ``trainer`` runs it to a saved model and summary, resumably."""

from tfaploss.run.trainer import embed_split, evaluate_split, initial_model, train

__all__ = ["embed_split", "evaluate_split", "initial_model", "train"]
