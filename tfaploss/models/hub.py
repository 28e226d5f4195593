"""Backbones from keras-hub presets (``"keras_hub:<preset>"``: a built-in name, a Kaggle
or Hugging Face handle, or a local preset folder; the ``hub`` extra) and from a user's own
Keras model file. A backbone gives a feature map ``(B, H', W', C)``, tokens ``(B, T, C)``
(pooled by :class:`tfaploss.models.heads.TokenPooling`) or pooled ``(B, C)``. A preset's
input scaling becomes the model's :class:`tfaploss.models.preprocessing.ImageRescaling`
layer, so the model still takes raw pixels in [0, 255].
"""

from __future__ import annotations

import logging
import os

import keras

from tfaploss import extras

LOG = logging.getLogger(__name__)

KERAS_HUB_PREFIX = "keras_hub:"


def require_keras_hub(what: str = "a keras_hub: backbone"):
    """The ``keras_hub`` module, or a :class:`~tfaploss.extras.MissingExtraError` (an
    ``ImportError``) whose one line says how to install it."""
    return extras.import_extra("hub", what)


def is_hub_backbone(backbone) -> bool:
    """Whether ``backbone`` is a ``"keras_hub:<preset>"`` string."""
    return isinstance(backbone, str) and backbone.startswith(KERAS_HUB_PREFIX)


def hub_preset(backbone: str) -> str:
    """The preset of ``"keras_hub:<preset>"`` (a name, handle or folder)."""
    preset = backbone[len(KERAS_HUB_PREFIX):].strip()
    if not preset:
        raise ValueError(f"backbone={backbone!r} names no preset; write e.g. "
                         "'keras_hub:resnet_50_imagenet' or 'keras_hub:path/to/preset_dir'.")
    return preset


def prefix_tokens(backbone) -> int | None:
    """Leading tokens of a ``(B, T, C)`` output that are not image patches: the class
    token plus DINOv2's register tokens; ``None`` when the model does not say."""
    if hasattr(backbone, "num_register_tokens"):  # DINOv2, DINOv3: [CLS, registers, patches]
        return 1 + int(backbone.num_register_tokens)
    if hasattr(backbone, "use_class_token"):  # ViT: [CLS, patches] or [patches]
        return int(bool(backbone.use_class_token))
    return None


def plain_functional(backbone: keras.Model, name: str) -> keras.Model:
    """``backbone``'s graph as a plain functional model, one image tensor in.

    A keras-hub backbone saves only its constructor arguments (its BatchNorm would load
    unfrozen); a plain functional model saves each layer. Cost: none.
    """
    inputs = backbone.inputs
    if len(inputs) != 1 or len(backbone.outputs) != 1:
        return backbone
    return keras.Model(inputs[0], backbone.outputs[0], name=name)


def preset_layer_name(preset: str) -> str:
    """A layer name for a preset: its last path part (Keras refuses '/' in names)."""
    base = os.path.basename(os.path.normpath(preset.split("://")[-1])) or "keras_hub"
    return "".join(c if c.isalnum() or c == "_" else "_" for c in base)


def hub_backbone(backbone: str, input_shape, weights=None):
    """``(model, prefix_tokens)`` of a keras-hub preset (``"keras_hub:<preset>"``): the
    backbone as a plain functional model and, for a token-sequence output, the number
    of leading non-patch tokens. ``input_shape`` goes to the preset as ``image_shape``
    (ViT and DINOv2 need H and W); ``weights``: ``None`` (random), ``"preset"`` or a
    ``.weights.h5`` file.
    """
    hub = require_keras_hub()
    preset = hub_preset(backbone)
    if weights not in (None, "preset") and not isinstance(weights, (str, os.PathLike)):
        raise ValueError(f"weights={weights!r}: a keras_hub backbone takes None, 'preset' or "
                         "the path of a .weights.h5 file.")
    if weights == "imagenet":
        raise ValueError("weights='imagenet' is for the built-in ResNets; a keras_hub "
                         "backbone takes weights='preset' (the preset's own weights).")
    path = None if weights in (None, "preset") else os.fspath(weights)
    if path is not None and not os.path.isfile(path):
        raise FileNotFoundError(f"weights={path!r}: no such file.")
    model = hub.models.Backbone.from_preset(preset, load_weights=weights == "preset",
                                            image_shape=tuple(input_shape))
    if path is not None:
        model.load_weights(path)
    for variable in model.weights:
        if variable.path.endswith("mask_token"):
            # DINOv2's mask token replaces masked patches in its pretraining only; with no
            # masks it gets no gradient, and Keras would warn about it at every step.
            variable.trainable = False
    tokens = prefix_tokens(model)
    return plain_functional(model, preset_layer_name(preset)), tokens


def hub_rescaling(backbone: str):
    """``(scale, offset)`` of a keras-hub preset's ``ImageConverter``, or ``None`` when the
    preset has none (a folder written by ``backbone.save_to_preset`` alone)."""
    hub = require_keras_hub()
    preset = hub_preset(backbone)
    try:
        converter = hub.layers.ImageConverter.from_preset(preset)
    except (FileNotFoundError, ValueError) as err:
        LOG.info("keras-hub preset %s has no image converter (%s)", preset, err)
        return None
    if converter.scale is None and converter.offset is None:
        return None
    return converter.scale, converter.offset


def load_backbone_file(path, weights=None) -> keras.Model:
    """A user's own backbone from a Keras model file (``.keras``; legacy ``.h5``).

    The model must take one image tensor ``(B, H, W, 3)`` (normalised as
    ``preprocessing`` says) and give one tensor: a feature map ``(B, H', W', C)``,
    tokens ``(B, T, C)`` or pooled features ``(B, C)``. Its classes must be importable
    (keras-hub's are imported by Keras on load); Lambda layers stay refused (Keras's
    ``safe_mode``).

    Args:
        path: the model file.
        weights: ``None`` (the file's weights) or the path of a ``.weights.h5`` file
            loaded over them.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        what = "a folder, not a model file" if os.path.isdir(path) else "no such file"
        raise FileNotFoundError(f"backbone_file={path!r}: {what}. Save your backbone with "
                                "model.save('backbone.keras').")
    model = keras.saving.load_model(path, compile=False)
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise ValueError(f"backbone_file={path!r}: a backbone takes one image tensor and "
                         f"gives one tensor; this model has {len(model.inputs)} inputs and "
                         f"{len(model.outputs)} outputs.")
    if weights is not None:
        model.load_weights(os.fspath(weights))
    return model
