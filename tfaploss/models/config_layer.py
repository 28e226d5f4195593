"""The base of the models' own layers: a config made of the constructor arguments."""

from __future__ import annotations

import keras


@keras.saving.register_keras_serializable(package="tfaploss")
class ConfigLayer(keras.layers.Layer):
    """A layer whose ``get_config`` adds the attributes named in ``CONFIG``: its
    constructor arguments, kept under their own names."""

    CONFIG: tuple[str, ...] = ()

    def get_config(self):
        return {**super().get_config(), **{name: getattr(self, name) for name in self.CONFIG}}


@keras.saving.register_keras_serializable(package="tfaploss")
class SameShapeLayer(ConfigLayer):
    """A :class:`ConfigLayer` whose output has its input's shape."""

    def compute_output_shape(self, input_shape):
        return input_shape
