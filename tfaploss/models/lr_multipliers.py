"""Per-variable learning-rate multipliers for Keras 3 optimizers: the papers train the
head 2-10x faster than the backbone. Scaling gradients would not do it for Adam (invariant
to a gradient's scale), so ``LRMultiplierOptimizer`` scales each variable's learning rate.
"""

from __future__ import annotations

import re

import keras
from keras import ops
from keras.saving import deserialize_keras_object, serialize_keras_object

from tfaploss.models.heads import HEAD_LAYER_NAME


def head_multipliers(factor, include_gem=False):
    """Multipliers for the head of a ``build_embedding_model`` model.

    Returns ``{pattern: factor}`` matching the Dense head's variables (and GeM's ``p``
    when ``include_gem``), for ``LRMultiplierOptimizer``.
    """
    names = HEAD_LAYER_NAME + ("|gem" if include_gem else "")
    return {rf"(^|/)({names})/": float(factor)}


@keras.saving.register_keras_serializable(package="tfaploss")
class LRMultiplierOptimizer(keras.optimizers.Optimizer):
    """Wrap an optimizer so that chosen variables learn ``k`` times faster.

    Each variable whose ``variable.path`` matches a pattern of ``multipliers``
    (``{regex: factor}``, ``re.search``, first match wins) is updated by the inner
    optimizer's own rule with ``learning_rate * factor``; everything else (schedules,
    optimizer state, clipping, loss scaling) is the inner optimizer's, which the wrapper
    owns from then on. Decoupled weight decay keeps the base learning rate (Keras applies
    it outside the update step). Works in ``compile``, with ``optimizer.apply`` in a
    custom step, under ``tf.distribute`` and inside ``LossScaleOptimizer``. Cost: a
    multiplication per variable per step.

    Example: ``LRMultiplierOptimizer(keras.optimizers.Adam(1e-4), head_multipliers(10.0))``.
    """

    def __init__(self, inner_optimizer, multipliers=None, name=None, **kwargs):
        if kwargs:
            raise ValueError(
                "LRMultiplierOptimizer takes no base-optimizer arguments (set them on "
                f"the inner optimizer); received {sorted(kwargs)}"
            )
        super().__init__(learning_rate=0.0, name=name)
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "LRMultiplierOptimizer: `inner_optimizer` must be a keras Optimizer; "
                f"received {inner_optimizer!r}"
            )
        multipliers = dict(multipliers or {})
        for pattern, factor in multipliers.items():
            re.compile(pattern)
            if not float(factor) >= 0:
                raise ValueError(
                    f"LRMultiplierOptimizer: multiplier for {pattern!r} must be >= 0; "
                    f"received {factor!r}"
                )
        self.inner_optimizer = inner_optimizer
        self.multipliers = {str(k): float(v) for k, v in multipliers.items()}
        self._patterns = [(re.compile(k), v) for k, v in self.multipliers.items()]
        self._factors = []

    def multiplier_for(self, variable):
        """The factor applied to ``variable`` (1.0 when no pattern matches)."""
        path = getattr(variable, "path", None) or variable.name
        for pattern, factor in self._patterns:
            if pattern.search(path):
                return factor
        return 1.0

    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        inner = self.inner_optimizer
        factors = self._factors = [self.multiplier_for(v) for v in inner._trainable_variables]
        base_update_step = type(inner).update_step

        def update_step(gradient, variable, learning_rate):
            # Keras calls `self.update_step(grad, var, lr)` once per variable (also per
            # replica under tf.distribute); an instance attribute takes precedence.
            factor = factors[inner._get_variable_index(variable)]
            if factor != 1.0:
                learning_rate = ops.multiply(learning_rate, factor)
            return base_update_step(inner, gradient, variable, learning_rate)

        inner.update_step = update_step
        if hasattr(inner, "_parallel_update_step"):
            # PyTorch's Keras optimizers update all variables in one fused call instead
            # of calling update_step per variable: run it once per multiplier group.
            base_backend_step = type(inner)._backend_update_step

            def backend_update_step(grads, variables, learning_rate):
                groups = {}
                for grad, variable in zip(grads, variables):
                    factor = factors[inner._get_variable_index(variable)]
                    groups.setdefault(factor, ([], []))
                    groups[factor][0].append(grad)
                    groups[factor][1].append(variable)
                for factor, (group_grads, group_vars) in groups.items():
                    rate = learning_rate if factor == 1.0 else learning_rate * factor
                    base_backend_step(inner, group_grads, group_vars, rate)

            inner._backend_update_step = backend_update_step
        super().build(var_list)

    @property
    def variables(self):
        return self.inner_optimizer.variables

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        return self.inner_optimizer.apply(grads, trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        return self.inner_optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        # Called by the base constructor before the inner optimizer exists.
        if "inner_optimizer" in self.__dict__:
            self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": serialize_keras_object(self.inner_optimizer),
            "multipliers": dict(self.multipliers),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = deserialize_keras_object(config.pop("inner_optimizer"),
                                         custom_objects=custom_objects)
        return cls(inner, **config)
