"""Input pipeline: the TFRecords written by ``pipelines`` -> batches for training/eval.

* :func:`load_split` - every image of a split as dicts (``image``, ``label``, ``id``...).
* :func:`make_train_dataset` - endless augmented batches from a class-balanced sampler
  (``"m_per_class"``, ``"hierarchical"``, ``"all_classes"``) or plain shuffling.
* :func:`make_eval_dataset` - each image once, resized + centre-cropped (or kept).

Images are float32 raw pixels in [0, 255] by default, because the models carry their
own preprocessing; pass ``normalize="imagenet"`` for (x / 255 - mean) / std.
"""

from tfaploss.data.augment import (
    DEFAULT_CROP_FRACTION,
    IMAGENET_MEAN,
    IMAGENET_STD,
    center_crop,
    normalize,
    random_resized_crop,
)
from tfaploss.data.datasets import make_eval_dataset, make_train_dataset
from tfaploss.data.records import decode_rgb, load_split, read_manifest, split_files
from tfaploss.data.samplers import SAMPLERS

__all__ = [
    "DEFAULT_CROP_FRACTION", "IMAGENET_MEAN", "IMAGENET_STD", "SAMPLERS", "center_crop",
    "decode_rgb", "load_split", "make_eval_dataset", "make_train_dataset", "normalize",
    "random_resized_crop", "read_manifest", "split_files",
]
