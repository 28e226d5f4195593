"""Convolutional backbones: ResNet-50/101 from ``keras.applications`` and a small CNN,
mapping normalised images to a feature map ``(B, H', W', C)``. ImageNet weights are never
downloaded: ``weights="imagenet"`` uses Keras's cache, else the error says which file to
fetch, from where, and how to pass it as ``weights=path``.
"""

from __future__ import annotations

import os

import keras

# The files ``keras.applications`` fetches for ``include_top=False`` (see
# keras/src/applications/resnet.py); Keras caches them in ``$KERAS_HOME/models``.
KERAS_WEIGHTS_BASE_URL = "https://storage.googleapis.com/tensorflow/keras-applications/resnet/"
IMAGENET_NOTOP_FILES = {
    "resnet50": "resnet50_weights_tf_dim_ordering_tf_kernels_notop.h5",
    "resnet101": "resnet101_weights_tf_dim_ordering_tf_kernels_notop.h5",
}
_RESNETS = {
    "resnet50": keras.applications.ResNet50,
    "resnet101": keras.applications.ResNet101,
}
BACKBONES = ("resnet50", "resnet101", "small_cnn")


def keras_cache_dir() -> str:
    """Where Keras keeps downloaded weights: ``$KERAS_HOME/models`` or ``~/.keras/models``."""
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "models")


def resolve_imagenet_weights(backbone: str) -> str:
    """Path of the cached ImageNet weights of ``backbone``; else a FileNotFoundError
    giving the file name, its URL and the ``weights=path`` alternative."""
    file_name = IMAGENET_NOTOP_FILES[backbone]
    path = os.path.join(keras_cache_dir(), file_name)
    if os.path.isfile(path):
        return path
    raise FileNotFoundError(
        f"weights='imagenet' for backbone={backbone!r}: {file_name} is not in Keras's "
        f"cache ({keras_cache_dir()}), and tfaploss never downloads weights. Fetch it on "
        f"a machine with network access from {KERAS_WEIGHTS_BASE_URL}{file_name} and "
        "either put it in that cache directory (or $KERAS_HOME/models) or pass its path "
        f"as weights='path/to/{file_name}'. Use weights=None for random weights."
    )


def _resolve_weights(backbone: str, weights):
    if weights is None:
        return None
    if weights == "imagenet":
        if backbone == "small_cnn":
            raise ValueError(
                "backbone='small_cnn' has no ImageNet weights; received weights='imagenet'. "
                "Use weights=None or a path to a small_cnn weights file (.weights.h5)."
            )
        return resolve_imagenet_weights(backbone)
    if isinstance(weights, (str, os.PathLike)):
        path = os.fspath(weights)
        if not os.path.isfile(path):
            what = "a folder, not a weights file" if os.path.isdir(path) else "no such file"
            raise FileNotFoundError(
                f"weights={path!r}: {what}. Pass None, 'imagenet' (cached file "
                "only) or the path of a backbone weights file."
            )
        return path
    raise ValueError(
        f"`weights` must be None, 'imagenet' or a file path; received weights={weights!r}"
    )


def small_cnn(input_shape=(32, 32, 3), widths=(32, 64, 128), name="small_cnn"):
    """A small VGG-like CNN for tests and demos, fast on a CPU.

    ``len(widths)`` stages of two ``Conv 3x3 -> BatchNorm -> ReLU`` blocks, each but the
    last ending with a 2x2 max-pool (32x32 -> 8x8 x ``widths[-1]``). No dropout:
    multi-staged backprop needs a deterministic model. Cost: about 38 M multiply-adds
    per 32x32 image.
    """
    if not widths:
        raise ValueError(f"small_cnn: `widths` must be non-empty, received widths={widths!r}")
    inputs = keras.Input(shape=input_shape, name="images")
    x = inputs
    for stage, width in enumerate(widths):
        for block in range(2):
            prefix = f"stage{stage + 1}_block{block + 1}"
            x = keras.layers.Conv2D(
                width, 3, padding="same", use_bias=False, name=f"{prefix}_conv"
            )(x)
            x = keras.layers.BatchNormalization(name=f"{prefix}_bn")(x)
            x = keras.layers.ReLU(name=f"{prefix}_relu")(x)
        if stage < len(widths) - 1:
            x = keras.layers.MaxPooling2D(2, name=f"stage{stage + 1}_pool")(x)
    return keras.Model(inputs, x, name=name)


def build_backbone(name="resnet50", input_shape=(224, 224, 3), weights=None, **kwargs):
    """A ``keras.Model`` mapping normalised images to a ``(B, H', W', C)`` feature map:
    ``"resnet50"``, ``"resnet101"`` or ``"small_cnn"`` (``**kwargs``: ``widths``).
    ``weights``: ``None`` (random), ``"imagenet"`` (only from Keras's cache) or a
    weights file (for ResNets the ``*_notop.h5`` file Keras uses)."""
    if name not in BACKBONES:
        raise ValueError(f"`backbone` must be one of {BACKBONES}; received backbone={name!r}")
    weights_path = _resolve_weights(name, weights)
    if name == "small_cnn":
        model = small_cnn(input_shape=input_shape, **kwargs)
        if weights_path is not None:
            model.load_weights(weights_path)
        return model
    if kwargs:
        raise ValueError(f"backbone={name!r} takes no extra arguments; received {kwargs}")
    return _RESNETS[name](include_top=False, weights=weights_path, input_shape=input_shape)
