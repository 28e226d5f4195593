"""Pooling, projection head and L2 normalisation: feature map -> embedding."""

from __future__ import annotations

import keras
from keras import ops

from models.gem import GeM

POOLINGS = ("gem", "avg", "max_ln")
HEAD_TYPES = ("linear", "identity")
# Name of the head's Dense layer; ``models.lr_multipliers.head_multipliers`` targets it.
HEAD_LAYER_NAME = "head"


@keras.saving.register_keras_serializable(package="tfaploss")
class L2Normalize(keras.layers.Layer):
    """``x / max(||x||_2, epsilon)`` along ``axis`` (``torch.nn.functional.normalize``).

    Args:
        axis: axis to normalise.
        epsilon: floor of the norm, so that a zero vector maps to zero, not NaN.

    Cost: O(size of x).
    """

    def __init__(self, axis=-1, epsilon=1e-12, **kwargs):
        super().__init__(**kwargs)
        self.axis = axis
        self.epsilon = float(epsilon)

    def call(self, inputs):
        x = ops.cast(inputs, self.compute_dtype)
        norm = ops.sqrt(ops.sum(ops.square(x), axis=self.axis, keepdims=True))
        return x / ops.maximum(norm, self.epsilon)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(axis=self.axis, epsilon=self.epsilon)
        return config


def build_pooling(pooling="gem", gem_p=3.0, gem_trainable_p=True):
    """A global pooling layer ``(B, H, W, C) -> (B, C)``.

    - ``"gem"``: generalised mean (``models.GeM``), ``p`` initialised to ``gem_p`` and
      learned when ``gem_trainable_p`` (Revaud et al.).
    - ``"avg"``: global average pooling (Smooth-AP, PNP, ROADMAP on SOP/iNat, FastAP).
    - ``"max_ln"``: global max pooling then LayerNorm without affine parameters
      (ROADMAP on CUB).

    Returns one layer (a ``keras.Sequential`` for ``"max_ln"``).
    """
    if pooling == "gem":
        return GeM(p=gem_p, trainable_p=gem_trainable_p, name="gem")
    if pooling == "avg":
        return keras.layers.GlobalAveragePooling2D(name="avg_pool")
    if pooling == "max_ln":
        return keras.Sequential(
            [
                keras.layers.GlobalMaxPooling2D(name="max_pool"),
                keras.layers.LayerNormalization(center=False, scale=False, name="ln"),
            ],
            name="max_ln",
        )
    raise ValueError(f"`pooling` must be one of {POOLINGS}; received pooling={pooling!r}")


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
