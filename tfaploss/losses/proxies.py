"""Learnable class proxies that a loss uses and the model trains: ``ClassProxies``.

Keras trains a model's variables only, never a loss's, so a proxy loss's proxies live in
an identity layer that the loss owns and the model holds last::

    loss = ProxyAnchorLoss(num_classes=100)
    model = keras.Sequential([embedder, loss.proxies_layer])   # or loss.with_proxies(embedder)
    model.compile(optimizer="adam", loss=loss)

The optimizer, learning-rate multipliers (path ``class_proxies/proxies``), strategies
and ``model.save`` then treat them as any model variable. After ``load_model`` the loss
binds, by the ``proxies_key`` of its config, to the most recent layer of that key. A
loss refuses proxies that never ran in a model unless given with
:meth:`ClassProxies.set_proxies`.
"""

from __future__ import annotations

import uuid
import weakref

import keras
import numpy as np

from tfaploss.losses._checks import integer

# key -> the most recently created ClassProxies of that key (weakly: a dropped model
# takes its layer with it).
_LAYERS: weakref.WeakValueDictionary[str, ClassProxies] = weakref.WeakValueDictionary()

PROXIES_LAYER_NAME = "class_proxies"


def proxies_multipliers(factor: float) -> dict:
    """``{pattern: factor}`` for ``tfaploss.models.lr_multipliers.LRMultiplierOptimizer``: the
    variables of every ``ClassProxies`` layer (the papers train proxies faster, e.g.
    Proxy-Anchor's x100)."""
    return {rf"(^|/)({PROXIES_LAYER_NAME}|cluster_proxies)(_\d+)?/": float(factor)}


@keras.saving.register_keras_serializable(package="tfaploss")
class ClassProxies(keras.layers.Layer):
    """One learnable vector per class, held inside a model (last) for a proxy loss;
    ``call`` returns its input unchanged.

    Args:
        num_classes: number of proxies (class ids ``0..num_classes-1``).
        initializer: a Keras initializer for the ``(num_classes, dim)`` variable.
            The default is pytorch-metric-learning's for Proxy-Anchor
            (``kaiming_normal_(mode="fan_out")``: normal, std ``sqrt(2 / num_classes)``).
        key: the identifier that pairs the layer with its loss across a save and load;
            the loss sets it.
    """

    def __init__(self, num_classes, initializer=None, key=None, **kwargs):
        kwargs.setdefault("name", PROXIES_LAYER_NAME)
        # An identity: never cast the embeddings to a mixed policy's float16.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self.num_classes = integer(type(self).__name__, "num_classes", num_classes)
        if initializer is None:  # pytorch-metric-learning's (class docstring)
            initializer = keras.initializers.VarianceScaling(2.0, "fan_in", "untruncated_normal")
        self.initializer = keras.initializers.get(initializer)
        self.key = str(key) if key is not None else uuid.uuid4().hex
        self.supports_masking = True
        self.given = False  # proxies set with set_proxies: a user manages them
        self.in_model = False  # call() ran: the layer is part of a forward pass
        _LAYERS[self.key] = self

    def build(self, input_shape):
        self.proxies = self.add_weight(shape=(self.num_classes, int(input_shape[-1])),
                                       name="proxies", initializer=self.initializer)

    def call(self, inputs):
        self.in_model = True  # Python side effect: runs when a step is traced, too
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape

    def set_proxies(self, values):
        """Assign ``values``, shape ``(num_classes, dim)``, building the layer if needed;
        a loss then uses them outside a model too."""
        values = np.asarray(values)
        if values.ndim != 2 or values.shape[0] != self.num_classes:
            raise ValueError(f"{type(self).__name__}.set_proxies: expected values of shape "
                             f"({self.num_classes}, dim); received shape {values.shape}.")
        if not self.built:
            self.build((None, values.shape[1]))
            self.built = True
        if tuple(self.proxies.shape) != values.shape:
            raise ValueError(f"{type(self).__name__}.set_proxies: the proxies have shape "
                             f"{tuple(self.proxies.shape)}; received shape {values.shape}.")
        self.proxies.assign(values.astype(self.proxies.dtype))
        self.given = True

    def get_config(self):
        config = super().get_config()
        config.update(num_classes=self.num_classes, key=self.key,
                      initializer=keras.initializers.serialize(self.initializer))
        return config


class ProxiesOwner:
    """Mix-in of a loss that owns a :class:`ClassProxies` layer (:meth:`_init_proxies`
    in its constructor, :meth:`proxies_for` in its computation)."""

    proxies_layer_class = ClassProxies

    @classmethod
    def uses_proxies(cls, kwargs: dict) -> bool:
        """Whether the loss built with constructor arguments ``kwargs`` uses proxies."""
        return True

    def _init_proxies(self, num_classes, proxies_key=None):
        self._proxies_layer = None
        self._num_proxies = num_classes
        self.proxies_key = proxies_key or uuid.uuid4().hex
        if proxies_key is not None:
            self._proxies_layer = _LAYERS.get(proxies_key)  # the model's, after a load

    @property
    def proxies_layer(self):
        """The :class:`ClassProxies` layer this loss reads; put it in the model."""
        if self._proxies_layer is None:
            # float64 losses (tests against float64 goldens) keep float64 proxies
            dtype = "float64" if self.dtype == "float64" else None
            self._proxies_layer = self.proxies_layer_class(self._num_proxies,
                                                           key=self.proxies_key, dtype=dtype)
        return self._proxies_layer

    @proxies_layer.setter
    def proxies_layer(self, layer):
        if layer is not None and not isinstance(layer, ClassProxies):
            raise ValueError(f"{type(self).__name__}: proxies_layer must be a ClassProxies "
                             f"layer; received {type(layer).__name__}.")
        if layer is not None and layer.num_classes != self._num_proxies:
            raise ValueError(f"{type(self).__name__}: proxies_layer holds "
                             f"{layer.num_classes} proxies but num_classes="
                             f"{self._num_proxies}.")
        self._proxies_layer = layer
        if layer is not None:
            self.proxies_key = layer.key

    def with_proxies(self, model):
        """``model`` followed by this loss's proxies layer (a new functional model with
        the same inputs and outputs; ``model`` itself is unchanged)."""
        if any(layer is self.proxies_layer for layer in getattr(model, "layers", ())):
            return model
        outputs = self.proxies_layer(model.outputs[0] if len(model.outputs) == 1
                                     else model.outputs)
        return keras.Model(model.inputs, outputs, name=model.name)

    def proxies_for(self, embeddings):
        """The proxies as a tensor of ``embeddings``' dtype (the layer built to their
        width if it is not yet), refused if no model trains them."""
        layer = self.proxies_layer
        dim = embeddings.shape[-1]
        if not layer.built:
            if dim is None:
                raise ValueError(f"{type(self).__name__}: build the proxies layer first "
                                 "(y_pred's width is not known here).")
            layer.build((None, int(dim)))
            layer.built = True
        if not (layer.in_model or layer.given):
            raise ValueError(
                f"{type(self).__name__}: its proxies (loss.proxies_layer, a ClassProxies "
                "layer) are not part of the model, so no optimizer would ever update them. "
                "Put the layer last in the embedding model: model = "
                "loss.with_proxies(model) (or keras.Sequential([model, "
                "loss.proxies_layer])), then compile that model with this loss. To use "
                "fixed proxies, give them with loss.proxies_layer.set_proxies(values); "
                f"received proxies_layer={layer.name!r}, never called in a model.")
        if dim is not None and int(layer.proxies.shape[-1]) != int(dim):
            raise ValueError(
                f"{type(self).__name__}: the proxies have dimension "
                f"{int(layer.proxies.shape[-1])} but y_pred has {int(dim)}; "
                "the proxies layer must sit right after the embedding.")
        return keras.ops.cast(layer.proxies, embeddings.dtype)


@keras.saving.register_keras_serializable(package="tfaploss")
class ClusterProxies(ClassProxies):
    """HAPPIER's clustering proxies (``HAPLoss(clustering_weight > 0)``), one per
    finest-level class: a :class:`ClassProxies` initialised as the authors' (uniform
    in ±1/sqrt(D)) unless ``initializer`` says otherwise."""

    def __init__(self, num_classes, initializer=None, key=None, **kwargs):
        kwargs.setdefault("name", "cluster_proxies")
        self._uniform = initializer is None
        super().__init__(num_classes, initializer=initializer, key=key, **kwargs)

    def build(self, input_shape):
        if self._uniform:
            bound = 1.0 / int(input_shape[-1]) ** 0.5
            self.initializer = keras.initializers.RandomUniform(-bound, bound)
        super().build(input_shape)

    def get_config(self):
        config = super().get_config()
        if self._uniform:
            config["initializer"] = None
        return config
