"""The image tier's convergence curve, measured after precise BN.

``tfaploss train``'s own evaluation scores the moving BatchNorm averages, which trail the
weights (55.1 where the same model scored 91.2 after re-estimating them, at B=512).
:class:`PreciseBNCurve` re-estimates them first
(:func:`tfaploss.run.build.precise_batch_norm`, on ``model.precise_bn_images`` images),
which does not change the run: training passes use batch statistics, and the final
precise BN replaces the averages whole. The image runner names it in the run's
``training.callbacks`` by import path.
"""

from __future__ import annotations

from tfaploss.training.callbacks import RetrievalEvaluation


class PreciseBNCurve(RetrievalEvaluation):
    """``val_*`` logs every ``every_n_epochs`` epochs, after precise BN.

    Args:
        config_file: the run's ``config.yaml`` (``tfaploss train`` writes it before the
            first step; read at the first evaluation).
        split: the folder of the split to evaluate.
        max_images: images of the split evaluated (None: all).
        every_n_epochs: evaluate after every this many epochs.
    """

    def __init__(self, config_file: str, split: str, max_images: int | None = None,
                 every_n_epochs: int = 1):
        super().__init__(evaluate_fn=self._precise, every_n_epochs=every_n_epochs)
        self.config_file, self.split, self.max_images = config_file, split, max_images
        self._cfg = None

    def _precise(self, model) -> dict:
        from tfaploss.config import load_config
        from tfaploss.run.build import precise_batch_norm
        from tfaploss.run.trainer import evaluate_split

        if self._cfg is None:
            self._cfg = load_config(self.config_file, warn=False)
        embedding_model = getattr(model, "embedding_model", model)
        precise_batch_norm(embedding_model, self._cfg)
        return evaluate_split(embedding_model, self._cfg, self.split, self.max_images)
