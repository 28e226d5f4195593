"""Tiny keras-hub backbones saved as local presets: keras-hub architectures with no
download (``from_preset`` reads a local folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

# The keras-hub classes whose built-in presets the recipes may name, with a tiny
# configuration of each (tens of thousands of weights; ResNetBackbone wants 64 filters
# in its first stack).
TINY = {
    "ResNetBackbone": {
        "input_conv_filters": [64], "input_conv_kernel_sizes": [3],
        "stackwise_num_filters": [64, 16], "stackwise_num_blocks": [1, 1],
        "stackwise_num_strides": [1, 2], "block_type": "basic_block",
        "image_shape": (None, None, 3)},
    # Patch 14 as the DINOv2 presets; the preset trains its position embeddings at 28 x 28
    # and the model interpolates them to the input size, as dinov2_small does from 518.
    "DINOV2Backbone": {
        "patch_size": 14, "num_layers": 1, "hidden_dim": 16, "num_heads": 2,
        "intermediate_dim": 32, "num_register_tokens": 2, "image_shape": (28, 28, 3),
        "position_embedding_shape": (28, 28, 3)},
    "ViTBackbone": {
        "image_shape": (32, 32, 3), "patch_size": 8, "num_layers": 1, "num_heads": 2,
        "hidden_dim": 16, "mlp_dim": 32},
}


def keras_hub():
    return pytest.importorskip("keras_hub", reason='keras-hub not installed ("tfaploss[hub]")')


def preset_class(name: str) -> str:
    """The keras-hub backbone class of the built-in preset ``name`` (offline: the preset
    lists ship with keras-hub)."""
    hub = keras_hub()
    for cls in TINY:
        if name in getattr(hub.models, cls).presets:
            return cls
    raise LookupError(f"{name!r} is not a built-in preset of {sorted(TINY)}")


def tiny_preset(folder: Path, cls: str = "ResNetBackbone", converter=None) -> Path:
    """A randomly initialised tiny ``cls`` saved as a keras-hub preset in ``folder``, with
    an ``ImageConverter`` of ``converter=(scale, offset)`` when given."""
    hub = keras_hub()
    backbone = getattr(hub.models, cls)(**TINY[cls])
    backbone.save_to_preset(str(folder))
    if converter is not None:
        scale, offset = converter
        hub.layers.ImageConverter(image_size=None, scale=scale, offset=offset).save_to_preset(
            str(folder))
    return folder
