"""Keras callbacks for training retrieval models, to add to any ``model.fit``.

* :class:`RetrievalEvaluation`: Recall@K and MAP@R of a held-out split every few
  epochs, as ``val_*`` logs and TensorBoard scalars.
* :class:`TrainingHealthMonitor`: warns (or stops) when the embeddings collapse or
  the loss stops moving.
* :class:`LoneQueryMonitor`: warns when most queries have no positive in their batch
  (it reads the ``LoneQueryShare`` metric compiled with the model).
* :class:`EmbeddingProjector`, :func:`export_projector`, :func:`umap_figure`: a split's
  embeddings for TensorBoard's projector, or a UMAP plot (``viz`` extra).

Example:

```python
model.compile(optimizer="adam", loss=tfaploss.losses.SmoothAPLoss(),
              metrics=tfaploss.training.health_metrics())
model.fit(train_ds, epochs=20, callbacks=[
    tfaploss.callbacks.RetrievalEvaluation(test_ds, every_n_epochs=2, log_dir="logs"),
    tfaploss.callbacks.TrainingHealthMonitor(),
    keras.callbacks.EarlyStopping(monitor="val_map@r", mode="max", patience=3),
])
```
"""

from tfaploss.evaluation.projector import export_projector, umap_figure
from tfaploss.training.callbacks import EmbeddingProjector, RetrievalEvaluation
from tfaploss.training.health import TrainingHealthMonitor, TrainingHealthWarning
from tfaploss.training.lone_queries import LoneQueryMonitor

__all__ = ["EmbeddingProjector", "LoneQueryMonitor", "RetrievalEvaluation",
           "TrainingHealthMonitor", "TrainingHealthWarning", "export_projector",
           "umap_figure"]
