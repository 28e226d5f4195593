"""AP-surrogate losses as ``keras.losses.Loss`` subclasses.

Use integer class labels as ``y_true`` and embeddings as ``y_pred``::

    model.compile(optimizer="adam", loss=tfaploss.losses.APLoss())
"""

from tfaploss.losses.base import RetrievalLoss

__all__ = ["RetrievalLoss"]
