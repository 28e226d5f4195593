"""The checks the ranking losses make of their arguments (a ValueError naming the loss,
the argument and the value) and of their call inputs."""

from __future__ import annotations

import math
import numbers

import keras
import numpy as np
from keras import ops

from tfaploss.ops.backend import on_tensorflow, tf_kernels

# Label ids above 2**24 are not exact in float32, the dtype Keras gives a loss's y_true.
NARROW_FLOATS = ("float16", "bfloat16")

# -- constructor arguments ----------------------------------------------------------------


def is_number(value) -> bool:
    """A real number, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check(owner, name, value, valid, requirement):
    """``value``, refused unless ``valid``: "``owner``: ``name`` must be
    ``requirement``; received ``name``=``value``"."""
    if not valid:
        raise ValueError(f"{owner}: {name} must be {requirement}; received {name}={value!r}.")
    return value


def number(owner, name, value, low=None, high=None, *, open_low=False, open_high=False,
           optional=False):
    """``value`` as a float, refused unless a number within the bounds (never NaN);
    None passes when ``optional``."""
    if optional and value is None:
        return None
    ok = is_number(value) and not math.isnan(value)
    bounds = []
    if low is not None:
        ok = ok and (value > low if open_low else value >= low)
        bounds.append(f"{'>' if open_low else '>='} {low:g}")
    if high is not None:
        ok = ok and (value < high if open_high else value <= high)
        bounds.append(f"{'<' if open_high else '<='} {high:g}")
    requirement = " and ".join([" ".join(["a number", *bounds[:1]]), *bounds[1:]])
    return float(check(owner, name, value, ok, requirement + (" or None" if optional else "")))


def positive_number(owner, name, value):
    return number(owner, name, value, low=0, open_low=True)


def integer(owner, name, value, low=1, optional=False):
    """``value`` as an int >= ``low`` (None passes when ``optional``)."""
    if optional and value is None:
        return None
    requirement = (f"an int >= {low}" if low != 1 else "a positive int") + (
        " or None" if optional else "")
    return int(check(owner, name, value, is_int(value) and value >= low, requirement))


def one_of(owner, name, value, choices):
    return check(owner, name, value, value in choices, f"one of {tuple(choices)}")


def positive_ints(owner, name, value):
    """``value`` (a list or tuple of positive ints) as a tuple."""
    ok = isinstance(value, (list, tuple)) and value and all(
        is_int(v) and v > 0 for v in value)
    return tuple(int(v) for v in check(owner, name, value, ok,
                                       "a non-empty list of positive integers"))


# -- call inputs -----------------------------------------------------------------------------


def concrete(value):
    """``value`` as a NumPy scalar when it is known now (eager), else None (traced)."""
    if on_tensorflow():
        import tensorflow as tf

        return value.numpy() if tf.executing_eagerly() else None
    if keras.backend.backend() == "jax":
        import jax

        return None if isinstance(value, jax.core.Tracer) else np.asarray(value)
    return ops.convert_to_numpy(value)


def dtype_name(values):
    dtype = getattr(values, "dtype", None)
    if dtype is None:
        dtype = np.asarray(values).dtype
    if isinstance(dtype, np.dtype) and dtype.kind in "USO":
        return "string"
    try:
        return keras.backend.standardize_dtype(dtype)
    except ValueError:
        return str(getattr(dtype, "name", dtype))


def check_labels(y_true):
    """Return labels as a rank-1 tensor, refusing shapes and dtypes that lose ids."""
    name = dtype_name(y_true)
    if name in NARROW_FLOATS:
        raise ValueError(
            f"Ranking losses need labels that represent class ids exactly; received "
            f"y_true of dtype {name}, which only holds integers up to "
            f"{'2048' if name == 'float16' else '256'} exactly. Pass "
            "integer labels (int32/int64) or float32."
        )
    if not ("int" in name or "float" in name):
        raise ValueError(
            f"Ranking losses expect integer class labels as y_true; received dtype "
            f"{name}. Map string or one-hot labels to integer ids first."
        )
    labels = ops.convert_to_tensor(y_true)
    shape = tuple(labels.shape)
    if len(shape) == 2 and shape[-1] == 1:
        labels = ops.squeeze(labels, axis=-1)
    elif len(shape) != 1:
        raise ValueError(
            "Ranking losses expect y_true of shape (batch,) or (batch, 1) holding "
            f"integer class labels; received shape {shape}. One-hot labels: "
            "pass `argmax(y, axis=-1)` instead."
        )
    return labels


def check_sizes(owner, labels, embeddings, labels_name="y_true", embeddings_name="y_pred"):
    """``labels``, checked to hold one label per row of ``embeddings`` (at run time in
    a TensorFlow graph of unknown batch size)."""
    n_labels, n_rows = labels.shape[0], embeddings.shape[0]
    message = (f"{owner}: {labels_name} holds {{}} labels but {embeddings_name} holds {{}} "
               "embeddings; pass exactly one label per embedding.")
    if n_labels is not None and n_rows is not None:
        if int(n_labels) != int(n_rows):
            raise ValueError(message.format(n_labels, n_rows))
        return labels
    kernels = tf_kernels()
    if kernels is None:
        return labels  # JAX traces and torch tensors always have static sizes
    return kernels.assert_same_rows(
        labels, embeddings, f"ValueError: {owner}: {labels_name} and {embeddings_name} "
        "differ in size (one label per embedding needed); sizes:")


def finite_or_zero(*embeddings):
    """``(all finite, embeddings)``, every embedding zeroed when any value is not finite:
    the loss is computed on zeros (a NaN bin index crashes a bincount) and replaced by
    NaN at the end (:func:`nan_unless`), with gradient 0. Cost: one pass."""
    finite = ops.all(ops.stack([ops.all(ops.isfinite(e)) for e in embeddings]))
    return finite, tuple(ops.where(finite, e, ops.zeros_like(e)) for e in embeddings)


def nan_unless(finite, loss):
    return ops.where(finite, loss, ops.full_like(loss, float("nan")))
