"""Export embedding models as SavedModels for TF Serving (see ``export_saved_model``),
optionally with a retrieval index searched in the serving graph (``retrieve``)."""

from tfaploss.export.image_header import declared_pixels
from tfaploss.export.image_ops import DEFAULT_MAX_PIXELS, decode_images, resize_and_center_crop
from tfaploss.export.retrieval_index import (
    DamagedIndexError,
    IndexMismatchError,
    RetrievalIndex,
    build_index,
    model_fingerprint,
)
from tfaploss.export.retrieval_search import (
    RETRIEVE_PIXELS_SIGNATURE,
    RETRIEVE_SIGNATURE,
)
from tfaploss.export.saved_model import (
    BYTES_SIGNATURE,
    OUTPUT_KEY,
    PIXELS_SIGNATURE,
    export_saved_model,
    find_saved_model,
    load_pixels_embedder,
    load_retriever,
    next_version,
    read_export_metadata,
)

__all__ = ["BYTES_SIGNATURE", "DEFAULT_MAX_PIXELS", "OUTPUT_KEY", "PIXELS_SIGNATURE",
           "RETRIEVE_PIXELS_SIGNATURE", "RETRIEVE_SIGNATURE", "DamagedIndexError",
           "IndexMismatchError", "RetrievalIndex", "build_index", "declared_pixels",
           "decode_images", "export_saved_model", "find_saved_model", "load_pixels_embedder",
           "load_retriever", "model_fingerprint", "next_version", "read_export_metadata",
           "resize_and_center_crop"]
