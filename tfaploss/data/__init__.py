"""Input pipeline: the TFRecords written by ``pipelines`` -> batches for training/eval:
:func:`load_split` (every image as dicts), :func:`make_train_dataset` (endless augmented
batches from a class-balanced sampler or plain shuffling), :func:`make_eval_dataset`
(each image once, resized and centre-cropped, or kept). Images are float32 raw pixels in
[0, 255] by default (the models carry their own preprocessing).
"""

import importlib

# Each public name and the submodule that defines it, imported on first use: the Beam
# jobs import tfaploss.data.integrity (manifest checksums), and an eager import here
# would load TensorFlow into every job, seconds of start-up for nothing.
_HOME = {
    "DEFAULT_CROP_FRACTION": "augment", "IMAGENET_MEAN": "augment", "IMAGENET_STD": "augment",
    "center_crop": "augment", "decode_rgb": "augment", "normalize": "augment",
    "random_resized_crop": "augment", "make_eval_dataset": "datasets",
    "make_train_dataset": "datasets", "load_split": "records", "read_manifest": "records",
    "split_files": "records", "SAMPLERS": "samplers",
}


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'tfaploss.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tfaploss.data.{home}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_HOME})


__all__ = ["DEFAULT_CROP_FRACTION", "IMAGENET_MEAN", "IMAGENET_STD", "SAMPLERS", "center_crop",
           "decode_rgb", "load_split", "make_eval_dataset", "make_train_dataset", "normalize",
           "random_resized_crop", "read_manifest", "split_files"]
