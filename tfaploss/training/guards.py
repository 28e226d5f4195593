"""Stop training loudly at the first non-finite loss or weight (a learning rate far too
high, a float16 overflow): :class:`StopOnNonFinite` raises
:class:`NonFiniteTrainingError`, naming the step and the likely causes, before
anything is checkpointed or saved, rather than a run ending with a NaN model."""

from __future__ import annotations

import math

import keras


class NonFiniteTrainingError(RuntimeError):
    """The loss or the weights became NaN/inf; the message says where and why."""


def sync_state(model) -> None:
    """Make ``model``'s variables hold its current state, for a callback reading them
    mid-epoch: Keras's JAX trainer keeps the state outside them until the epoch's end.
    Elsewhere a no-op. Cost on JAX: one assignment per variable."""
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()


def _float_variables(variables) -> list:
    """The floating-point variables (integers are always finite)."""
    return [v for v in variables if "float" in str(v.dtype)]


def _make_all_finite(variables):
    """A function returning whether all ``variables`` are finite: one fused reduction
    (a tf.function on TensorFlow). Cost: one read of every variable, no copy."""
    variables = _float_variables(variables)

    def all_finite():
        flags = [keras.ops.all(keras.ops.isfinite(v.value)) for v in variables]
        return keras.ops.all(keras.ops.stack(flags)) if flags else True

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.function(all_finite)
    return all_finite


def nonfinite_variables(variables) -> list[str]:
    """Names of the variables holding a NaN or an infinity (slow path, for messages)."""
    import numpy as np

    return [getattr(v, "path", None) or getattr(v, "name", "?")
            for v in _float_variables(variables)
            if not np.all(np.isfinite(keras.ops.convert_to_numpy(v.value)))]


def check_finite_weights(model, what: str) -> None:
    """Raise :class:`NonFiniteTrainingError` naming ``what`` (the artefact then not
    written) if a variable of ``model`` is not finite."""
    bad = nonfinite_variables(model.weights)
    if bad:
        raise NonFiniteTrainingError(
            f"refusing to write {what}: {len(bad)} weight(s) of the model are NaN or "
            f"infinite ({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}).")


class StopOnNonFinite(keras.callbacks.Callback):
    """Raise :class:`NonFiniteTrainingError` at the first batch whose loss or resulting
    weights are not finite. ``steps_per_epoch`` and ``hint`` (e.g. the configured
    learning rate) go into the message. Cost per batch: one reduction over all model
    variables and one device-to-host copy of a boolean and the loss.
    """

    def __init__(self, steps_per_epoch: int | None = None, hint: str = ""):
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        self.hint = hint
        self._epoch = 0
        self._check = None

    def on_train_begin(self, logs=None):
        self._check = _make_all_finite(self.model.weights)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        loss_value = None if loss is None else float(keras.ops.convert_to_numpy(loss))
        loss_ok = loss_value is None or math.isfinite(loss_value)
        sync_state(self.model)
        weights_ok = bool(keras.ops.convert_to_numpy(self._check()))
        if loss_ok and weights_ok:
            return
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        where = (f"update {step} (epoch {self._epoch + 1}, batch {batch + 1}"
                 + (f" of {self.steps_per_epoch}" if self.steps_per_epoch else "") + ")")
        if not loss_ok:
            what = f"the loss is {loss_value} at {where}"
        else:
            bad = nonfinite_variables(self.model.weights)
            what = (f"the loss is still finite ({loss_value:.4g}) but {len(bad)} weight(s) "
                    f"became NaN or infinite at {where}: {', '.join(bad[:3])}"
                    f"{', ...' if len(bad) > 3 else ''}")
        raise NonFiniteTrainingError(
            f"training stopped: {what}. Nothing from this epoch was checkpointed or "
            "saved. Likely causes: a learning rate too high for this model and batch "
            f"size{(' (' + self.hint + ')') if self.hint else ''}: try 10x lower, a "
            "warm-up (optimizer.warmup_epochs) or gradient clipping (optimizer.clipnorm); "
            "with training.mixed_precision, a float16 overflow; non-finite input pixels.")
