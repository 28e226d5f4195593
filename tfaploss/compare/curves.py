"""The image tier's convergence curve, measured after precise BN.

``tfaploss train``'s own evaluation during training scores the network with the
BatchNorm statistics it has then, the moving averages, which trail the weights: a run
at B=512 ended its curve at 55.1 where the same model scored 91.2 once its statistics
were re-estimated. :class:`PreciseBNCurve` re-estimates them first (``precise BN``,
:func:`tfaploss.run.build.precise_batch_norm`, on the run's ``model.precise_bn_images``
training images), then evaluates, so every point of the curve is what the model at
that step scores.

Re-estimating in place does not change the run: training-mode passes normalise with
the batch's own statistics and never read the moving ones, and the precise BN at the
end of ``tfaploss train`` replaces them whole (its first batch has weight 1). With
frozen BatchNorm there is nothing to re-estimate and it is the plain evaluation.

The image runner (:mod:`tfaploss.compare.images`) names it in the run's
``training.callbacks``, by import path, so ``tfaploss train`` builds it.
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
