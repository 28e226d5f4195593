"""Keras callbacks for training retrieval models, to add to any ``model.fit``:
:class:`RetrievalEvaluation` (Recall@K, MAP@R of a held-out split as ``val_*`` logs),
:class:`TrainingHealthMonitor` (collapse, flat loss), :class:`LoneQueryMonitor` (queries
without a positive in their batch), :class:`EmbeddingProjector`, :func:`export_projector`
and :func:`umap_figure` (``viz`` extra).

```python
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
