"""tfaploss: train image-retrieval embeddings by directly optimising Average Precision.

The data's path: raw files -> pipelines (Beam) -> TFRecords -> tfaploss.data -> models
-> tfaploss.losses / tfaploss.training -> tfaploss.run -> tfaploss.evaluation ->
tfaploss.export. The library logs through the ``tfaploss`` logger and configures nothing
on import; subpackages are imported on first use, so ``import tfaploss`` stays cheap. It
is also all it takes to load a saved model in plain Keras (:mod:`tfaploss._registration`)::

    import keras
    import tfaploss

    model = keras.saving.load_model("runs/my_run/model.keras")
"""

import importlib
import logging

from tfaploss._registration import install as _install_registration
from tfaploss._registration import register_keras_objects as register_keras_objects

__version__ = "0.1.0"

_SUBMODULES = ("callbacks", "config", "data", "evaluation", "export", "losses", "ops", "run",
               "training")

# Library convention: records go nowhere until the application configures logging.
logging.getLogger("tfaploss").addHandler(logging.NullHandler())


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"tfaploss.{name}")
    raise AttributeError(f"module 'tfaploss' has no attribute {name!r}")


_install_registration()


def __dir__():
    return sorted(list(globals()) + list(_SUBMODULES))
