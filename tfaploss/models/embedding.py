"""``build_embedding_model``: raw images -> L2-normalised embeddings."""

from __future__ import annotations

import logging

import keras

from tfaploss.models.backbones import BACKBONES, build_backbone
from tfaploss.models.batch_norm import freeze_batch_norm
from tfaploss.models.heads import L2Normalize, build_head, build_pooling
from tfaploss.models.hub import (
    hub_backbone,
    hub_preset,
    hub_rescaling,
    is_hub_backbone,
    prefix_tokens,
    preset_layer_name,
)
from tfaploss.models.preprocessing import MODES, ImageNetNormalization, ImageRescaling

LOG = logging.getLogger(__name__)

# The papers' architectures, as keyword arguments of ``build_embedding_model``.
PAPER_ARCHITECTURES = {
    # Revaud et al. ICCV'19 (histogram AP, landmarks): ResNet-101, GeM (p learned,
    # init 3), FC 2048 -> 2048 with bias, L2.
    "revaud": {"backbone": "resnet101", "pooling": "gem", "embedding_dim": 2048, "head_bias": True},
    # Smooth-AP, PNP, ROADMAP on SOP / iNaturalist: ResNet-50, average pooling,
    # Dense 2048 -> 512, L2.
    "smooth_ap": {"backbone": "resnet50", "pooling": "avg", "embedding_dim": 512},
    "pnp": {"backbone": "resnet50", "pooling": "avg", "embedding_dim": 512},
    "roadmap_sop": {"backbone": "resnet50", "pooling": "avg", "embedding_dim": 512},
    # ROADMAP on CUB: ResNet-50, max pooling + LayerNorm without affine, Dense -> 512.
    "roadmap_cub": {"backbone": "resnet50", "pooling": "max_ln", "embedding_dim": 512},
    # FastAP: ResNet-50, average pooling, Dense -> 512.
    "fastap": {"backbone": "resnet50", "pooling": "avg", "embedding_dim": 512},
}

# The normalisation each backbone's pretrained weights expect.
DEFAULT_PREPROCESSING = {"resnet50": "caffe", "resnet101": "caffe", "small_cnn": "torch"}


def build_embedding_model(backbone="resnet50", pooling="gem", embedding_dim=512,
                          weights=None, input_shape=(224, 224, 3), head="linear",
                          head_bias=True, gem_p=3.0, gem_trainable_p=True, freeze_bn=False,
                          preprocessing="auto", backbone_kwargs=None, name=None):
    """Build an image-retrieval embedding model.

    ``images -> [normalisation] -> backbone -> pooling -> [head] -> L2``: raw RGB pixels
    in [0, 255] ``(B, H, W, 3)`` to L2-normalised float32 ``(B, embedding_dim)``.

    Args:
        backbone: ``"resnet50"``, ``"resnet101"`` (``keras.applications``),
            ``"small_cnn"`` (tests and demos; inputs down to 8x8),
            ``"keras_hub:<preset>"`` (``tfaploss.models.hub``; the ``hub`` extra) or a
            ``keras.Model`` of one image tensor (``load_backbone_file``), whose output
            is a feature map, tokens (pooled by ``TokenPooling``) or pooled features.
        pooling: ``"gem"`` (Revaud et al.), ``"avg"`` (Smooth-AP / PNP / ROADMAP-SOP /
            FastAP; for tokens the patch tokens' mean), ``"max_ln"`` (global max +
            LayerNorm without affine, ROADMAP-CUB) or ``"cls"`` (tokens only).
        embedding_dim: output units of the linear head.
        weights: ``None`` (random), ``"imagenet"`` (only from Keras's local cache) or a
            weights file; for a keras-hub backbone ``"preset"`` (downloaded by keras-hub).
        input_shape: ``(H, W, 3)``; ``(None, None, 3)`` accepts any size.
        head: ``"linear"`` (a ``Dense`` named ``"head"``) or ``"identity"`` (the pooled
            features are the embedding; ``embedding_dim`` None or their width).
        head_bias: whether the linear head has a bias (the papers' heads do).
        gem_p, gem_trainable_p: GeM's initial exponent (the papers: 3), and whether it
            is learned.
        freeze_bn: BatchNorm on its moving statistics (``freeze_batch_norm``).
        preprocessing: the input normalisation: ``"auto"`` (``"caffe"`` for the Keras
            ResNets, a keras-hub preset's own converter scale and offset, else
            ``"torch"``), ``"torch"`` (ImageNet mean/std on [0, 1] pixels), ``"caffe"``
            (BGR, mean subtracted) or ``None`` (inputs already normalised).
        backbone_kwargs: extra arguments of the backbone (``small_cnn``: ``widths``).
        name: model name (default ``"<backbone>_<pooling>_<embedding_dim>"``).

    Returns:
        A functional ``keras.Model`` whose layers are named ``"normalization"``, the
        backbone's, the pooling's, ``"head"`` and ``"l2_normalize"``.

    Example:

    >>> model = build_embedding_model("keras_hub:dinov2_small", weights="preset",
    ...                               pooling="cls", input_shape=(224, 224, 3))
    """
    if len(input_shape) != 3 or input_shape[-1] != 3:
        raise ValueError(
            f"`input_shape` must be (H, W, 3) (RGB, channels last); received {input_shape!r}"
        )
    if preprocessing not in (None, False, "auto") and preprocessing not in MODES:
        raise ValueError(
            f"`preprocessing` must be 'auto', one of {MODES}, or None; received "
            f"preprocessing={preprocessing!r}"
        )
    features, tokens, normalization, label = _backbone(
        backbone, input_shape, weights, preprocessing, backbone_kwargs)
    inputs = keras.Input(shape=input_shape, name="images")
    x = inputs
    if normalization is not None:
        x = normalization(x)
    x = features(x)
    rank = len(x.shape)
    if rank not in (2, 3, 4):
        raise ValueError(f"backbone {label!r} gives {tuple(x.shape)}; a backbone gives a "
                         "feature map (B, H, W, C), tokens (B, T, C) or features (B, C).")
    if rank == 2:
        # Pooled already (a model file saved with its own pooling): nothing to pool.
        (LOG.info if pooling == "avg" else LOG.warning)(
            "backbone %s gives pooled features %s: pooling %r is not applied", label,
            tuple(x.shape), pooling)
    else:
        x = build_pooling(pooling, gem_p=gem_p, gem_trainable_p=gem_trainable_p,
                          features_rank=rank, prefix_tokens=tokens)(x)
    feature_dim = x.shape[-1]
    projection = build_head(head, embedding_dim, head_bias, feature_dim=feature_dim)
    if projection is not None:
        x = projection(x)
    # The output stays float32 under mixed precision: the losses need it.
    outputs = L2Normalize(name="l2_normalize",
                          dtype=keras.config.dtype_policy().variable_dtype)(x)
    dim = embedding_dim if projection is not None else feature_dim
    model = keras.Model(inputs, outputs, name=name or f"{label}_{pooling}_{dim}")
    if freeze_bn:
        freeze_batch_norm(model)
    return model


def _normalization(mode):
    return ImageNetNormalization(mode=mode, name="normalization") if mode else None


def _backbone(backbone, input_shape, weights, preprocessing, backbone_kwargs):
    """``(feature model, prefix tokens, normalisation layer or None, name for messages)``."""
    if isinstance(backbone, keras.Model):
        if weights is not None:
            raise ValueError("a keras.Model backbone brings its own weights; received "
                             f"weights={weights!r} (load them into the model first).")
        if backbone_kwargs:
            raise ValueError(f"a keras.Model backbone takes no backbone_kwargs; received "
                             f"{backbone_kwargs}")
        if preprocessing == "auto":
            LOG.info("backbone %s: preprocessing 'auto' normalises as 'torch' (ImageNet "
                     "mean/std); pass None if the model normalises its input itself",
                     backbone.name)
            preprocessing = "torch"
        return backbone, prefix_tokens(backbone), _normalization(preprocessing), backbone.name
    if is_hub_backbone(backbone):
        if backbone_kwargs:
            raise ValueError(f"backbone={backbone!r} takes no backbone_kwargs; received "
                             f"{backbone_kwargs}")
        features, tokens = hub_backbone(backbone, input_shape, weights)
        label = preset_layer_name(hub_preset(backbone))
        if preprocessing != "auto":
            return features, tokens, _normalization(preprocessing), label
        rescaling = hub_rescaling(backbone)
        if rescaling is None:
            LOG.info("keras-hub preset %s has no image converter: normalising as 'torch' "
                     "(ImageNet mean/std)", hub_preset(backbone))
            return features, tokens, _normalization("torch"), label
        return features, tokens, ImageRescaling(*rescaling, name="normalization"), label
    if backbone not in BACKBONES:
        raise ValueError(f"`backbone` must be one of {BACKBONES}, 'keras_hub:<preset>' or a "
                         f"keras.Model; received backbone={backbone!r}")
    if preprocessing == "auto":
        preprocessing = DEFAULT_PREPROCESSING[backbone]
    features = build_backbone(backbone, input_shape=input_shape, weights=weights,
                              **(backbone_kwargs or {}))
    return features, None, _normalization(preprocessing), backbone


def build_paper_model(paper, **overrides):
    """``build_embedding_model`` with a paper's architecture (see ``PAPER_ARCHITECTURES``).

    ``overrides`` replace or add keyword arguments, e.g. ``weights="imagenet"``.
    """
    if paper not in PAPER_ARCHITECTURES:
        raise ValueError(
            f"`paper` must be one of {sorted(PAPER_ARCHITECTURES)}; received paper={paper!r}"
        )
    return build_embedding_model(**{**PAPER_ARCHITECTURES[paper], **overrides})
