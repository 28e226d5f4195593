"""Export embedding models as SavedModels for TF Serving (see ``export_saved_model``)."""

from tfaploss.export.image_header import declared_pixels
from tfaploss.export.image_ops import DEFAULT_MAX_PIXELS, decode_images, resize_and_center_crop
from tfaploss.export.saved_model import (
    BYTES_SIGNATURE,
    OUTPUT_KEY,
    PIXELS_SIGNATURE,
    export_saved_model,
    find_saved_model,
    load_pixels_embedder,
    next_version,
)

__all__ = [
    "BYTES_SIGNATURE",
    "DEFAULT_MAX_PIXELS",
    "OUTPUT_KEY",
    "PIXELS_SIGNATURE",
    "declared_pixels",
    "decode_images",
    "export_saved_model",
    "find_saved_model",
    "load_pixels_embedder",
    "next_version",
    "resize_and_center_crop",
]
