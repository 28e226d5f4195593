"""Pooling, projection head and L2 normalisation: feature map -> embedding."""

from __future__ import annotations

import keras
from keras import ops

from tfaploss.models.config_layer import ConfigLayer, SameShapeLayer
from tfaploss.models.gem import GeM

POOLINGS = ("gem", "avg", "max_ln", "cls")
HEAD_TYPES = ("linear", "identity")
# Name of the head's Dense layer; ``tfaploss.models.lr_multipliers.head_multipliers`` targets it.
HEAD_LAYER_NAME = "head"


@keras.saving.register_keras_serializable(package="tfaploss")
class L2Normalize(SameShapeLayer):
    """``x / max(||x||_2, epsilon)`` along ``axis`` (``torch.nn.functional.normalize``).

    Args:
        axis: axis to normalise.
        epsilon: floor of the norm, so that a zero vector maps to zero, not NaN.

    Cost: O(size of x).
    """

    CONFIG = ("axis", "epsilon")

    def __init__(self, axis=-1, epsilon=1e-12, **kwargs):
        super().__init__(**kwargs)
        self.axis = axis
        self.epsilon = float(epsilon)

    def call(self, inputs):
        x = ops.cast(inputs, self.compute_dtype)
        norm = ops.sqrt(ops.sum(ops.square(x), axis=self.axis, keepdims=True))
        return x / ops.maximum(norm, self.epsilon)


class PoolingError(ValueError):
    """A pooling that does not fit the backbone's output (GeM on tokens, a class token
    of a feature map): a setting to change, not a damaged weights file."""


@keras.saving.register_keras_serializable(package="tfaploss")
class TokenPooling(ConfigLayer):
    """Pool a token sequence ``(B, T, C)`` of a ViT-like backbone into ``(B, C)``.

    ``mode``: ``"cls"`` the class token ``x[:, 0]`` (ViT's and DINOv2's image
    descriptor), ``"avg"`` the mean of the patch tokens ``x[:, prefix_tokens:]``, or
    ``"max"`` their per-channel maximum.

    ``prefix_tokens``: leading tokens that are not patches (class token, registers).

    Cost: O(B T C).
    """

    CONFIG = ("mode", "prefix_tokens")

    def __init__(self, mode="cls", prefix_tokens=1, **kwargs):
        super().__init__(**kwargs)
        if mode not in ("cls", "avg", "max"):
            raise ValueError(f"TokenPooling: `mode` must be 'cls', 'avg' or 'max'; "
                             f"received mode={mode!r}")
        self.mode = mode
        self.prefix_tokens = int(prefix_tokens)

    def call(self, inputs):
        if self.mode == "cls":
            return inputs[:, 0]
        patches = inputs[:, self.prefix_tokens:]
        if self.mode == "avg":
            return ops.mean(patches, axis=1)
        return ops.max(patches, axis=1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])


def build_pooling(pooling="gem", gem_p=3.0, gem_trainable_p=True, features_rank=4,
                  prefix_tokens=None):
    """A global pooling layer ``(B, H, W, C) -> (B, C)`` or ``(B, T, C) -> (B, C)``.

    Feature maps (``features_rank=4``): ``"gem"`` (:class:`GeM`, ``p`` from ``gem_p``,
    learned when ``gem_trainable_p``), ``"avg"``, ``"max_ln"`` (global max, then
    LayerNorm without affine parameters). Tokens (``features_rank=3``, with
    :class:`TokenPooling`): ``"cls"``, ``"avg"``, ``"max_ln"``; ``"gem"`` is refused,
    since its power mean needs non-negative activations and tokens leave LayerNorm
    signed. ``prefix_tokens``: leading non-patch tokens (``None``: unknown, none for
    ``avg``/``max_ln``, token 0 as the class token). Raises :class:`PoolingError` when
    the pooling does not fit the features.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"`pooling` must be one of {POOLINGS}; received pooling={pooling!r}")
    if features_rank == 3:
        return _token_pooling(pooling, prefix_tokens)
    if pooling == "gem":
        return GeM(p=gem_p, trainable_p=gem_trainable_p, name="gem")
    if pooling == "avg":
        return keras.layers.GlobalAveragePooling2D(name="avg_pool")
    if pooling == "max_ln":
        return _max_ln(keras.layers.GlobalMaxPooling2D(name="max_pool"))
    raise PoolingError("pooling='cls' takes the class token of a token sequence "
                       "(B, T, C); this backbone gives a feature map (B, H, W, C): use "
                       "'gem', 'avg' or 'max_ln'.")


def _token_pooling(pooling, prefix_tokens):
    skip = prefix_tokens or 0
    if pooling == "cls":
        if prefix_tokens == 0:
            raise PoolingError("pooling='cls': this backbone has no class token; use 'avg'.")
        return TokenPooling("cls", name="cls_token")
    if pooling == "avg":
        return TokenPooling("avg", prefix_tokens=skip, name="avg_pool")
    if pooling == "max_ln":
        return _max_ln(TokenPooling("max", prefix_tokens=skip, name="max_pool"))
    raise PoolingError("pooling='gem' needs a non-negative feature map (B, H, W, C); "
                       "this backbone gives signed tokens (B, T, C): use 'cls' (the "
                       "class token) or 'avg' (the mean of the patch tokens).")


def _max_ln(max_pool):
    """``max_pool``, then LayerNorm without affine parameters."""
    return keras.Sequential(
        [max_pool, keras.layers.LayerNormalization(center=False, scale=False, name="ln")],
        name="max_ln")


def build_head(head="linear", embedding_dim=512, head_bias=True, feature_dim=None):
    """The projection head after pooling, or ``None`` for no projection.

    Args:
        head: ``"linear"`` (``Dense(embedding_dim)``, named ``"head"``) or ``"identity"``
            (the pooled features are the embedding; ``embedding_dim`` must then be
            ``None`` or equal ``feature_dim``).
        embedding_dim: output size of the linear head.
        head_bias: whether the Dense layer has a bias (the papers' heads do).
        feature_dim: channels of the pooled features, to check ``"identity"``.
    """
    if head == "linear":
        if embedding_dim is None or int(embedding_dim) < 1:
            raise ValueError(
                f"head='linear' needs a positive `embedding_dim`; received {embedding_dim!r}"
            )
        return keras.layers.Dense(int(embedding_dim), use_bias=bool(head_bias),
                                  name=HEAD_LAYER_NAME)
    if head == "identity":
        if embedding_dim is not None and feature_dim is not None and embedding_dim != feature_dim:
            raise ValueError(
                f"head='identity' keeps the backbone's {feature_dim} channels; received "
                f"embedding_dim={embedding_dim!r} (pass None or {feature_dim})"
            )
        return None
    raise ValueError(f"`head` must be one of {HEAD_TYPES}; received head={head!r}")
