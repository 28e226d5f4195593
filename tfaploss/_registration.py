"""``import tfaploss`` registers every Keras class the library saves, without importing
Keras itself.

A saved model holds tfaploss layers, losses, the ``LRMultiplierOptimizer``, schedules and
``MultiStageModel``; Keras finds them by their registered names (``"tfaploss>GeM"``) only
once their modules have run, so :func:`register_keras_objects` imports them. When Keras
is already imported that happens at once; otherwise a meta-path hook registers as soon
as ``keras`` and the tfaploss module being imported have loaded, then removes itself.
Why a hook, not imports in ``__init__`` (keras-hub's way): those would load TensorFlow
before the CLI can set ``TF_CPP_MIN_LOG_LEVEL`` and ``KERAS_BACKEND`` (``tfaploss --help``
8-11 s instead of 0.1-0.3 s), and in every Beam worker.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings

# Every module that defines a class tfaploss saves with register_keras_serializable.
# Importing them is all registration takes; none needs Beam, ScaNN or matplotlib.
REGISTERING_MODULES = ("tfaploss.models", "tfaploss.losses", "tfaploss.training",
                       "tfaploss.run.schedule")
PACKAGE = "tfaploss"


def register_keras_objects() -> dict:
    """Import the modules defining tfaploss's Keras classes; returns them by registered
    name (``{"tfaploss>GeM": GeM, ...}``), e.g. for ``custom_objects=``."""
    for name in REGISTERING_MODULES:
        importlib.import_module(name)
    import keras

    prefix = f"{PACKAGE}>"
    return {k: v for k, v in keras.saving.get_custom_objects().items() if k.startswith(prefix)}


def _ours(name: str) -> bool:
    return name == "tfaploss" or name.startswith("tfaploss.")


def _half_imported() -> bool:
    """Is keras or a module of ours still executing its import?"""
    return any((name == "keras" or _ours(name))
               and getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items()))


class _Loader:
    """Delegates to the real loader; registers once the import stack is clear."""

    def __init__(self, loader, hook):
        self._loader, self._hook = loader, hook

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def exec_module(self, module):
        self._loader.exec_module(module)
        # This module's own spec is still marked as initialising: mark it done first.
        spec = getattr(module, "__spec__", None)
        if spec is not None:
            spec._initializing = False
        self._hook.maybe_register()


class _RegisterWhenKerasLoads(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.running = False

    def find_spec(self, fullname, path, target=None):
        if self.running or not (fullname == "keras" or _ours(fullname)):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self)
        return spec

    def maybe_register(self):
        if self.running or sys.modules.get("keras") is None or _half_imported():
            return
        self.running = True
        try:
            register_keras_objects()
        except ImportError as err:  # Keras unavailable or blocked: nothing can load anyway
            warnings.warn(f"tfaploss could not register its Keras classes ({err}); "
                          "call tfaploss.register_keras_objects() before loading a model.",
                          stacklevel=2)
        finally:
            self.uninstall()

    def uninstall(self):
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def install() -> None:
    """Register now if Keras is loaded, else when it is (called by ``import tfaploss``)."""
    if sys.modules.get("keras") is not None:
        register_keras_objects()
        return
    if any(isinstance(f, _RegisterWhenKerasLoads) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _RegisterWhenKerasLoads())
