"""Retrieval models: backbones, pooling, heads and whitening.

``build_embedding_model`` is the entry point: raw images in [0, 255] -> L2-normalised
embeddings (the papers' architectures: ``PAPER_ARCHITECTURES``); backbones: the Keras
ResNets, a small CNN, keras-hub presets or a model file of the user's
(:mod:`tfaploss.models.hub`). Every layer is written with ``keras.ops`` only, so the
models build and train under the tensorflow, jax and torch backends.
"""

from tfaploss.models.backbones import build_backbone, resolve_imagenet_weights, small_cnn
from tfaploss.models.batch_norm import (
    FrozenBatchNormalization,
    freeze_batch_norm,
    has_training_batch_norm,
)
from tfaploss.models.embedding import PAPER_ARCHITECTURES, build_embedding_model, build_paper_model
from tfaploss.models.gem import GeM
from tfaploss.models.heads import L2Normalize, PoolingError, TokenPooling, build_head, build_pooling
from tfaploss.models.hub import is_hub_backbone, load_backbone_file, require_keras_hub
from tfaploss.models.lr_multipliers import LRMultiplierOptimizer, head_multipliers
from tfaploss.models.preprocessing import ImageNetNormalization, ImageRescaling
from tfaploss.models.whitening import PCAWhitening, fit_pca_whitening, with_whitening

__all__ = ["PAPER_ARCHITECTURES", "FrozenBatchNormalization", "GeM", "ImageNetNormalization",
           "ImageRescaling", "L2Normalize", "LRMultiplierOptimizer", "PCAWhitening", "PoolingError",
           "TokenPooling", "build_backbone", "build_embedding_model", "build_head",
           "build_paper_model", "build_pooling", "fit_pca_whitening", "freeze_batch_norm",
           "has_training_batch_norm", "head_multipliers", "is_hub_backbone", "load_backbone_file",
           "require_keras_hub", "resolve_imagenet_weights", "small_cnn", "with_whitening"]
