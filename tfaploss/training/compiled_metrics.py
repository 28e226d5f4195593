"""The metrics a compiled Keras model keeps, for callbacks that read them mid-run."""

from __future__ import annotations

import keras

__all__ = ["compiled_metrics", "scalar"]


def compiled_metrics(model):
    """Every metric of ``model``, once each: ``model.metrics`` and, recursively, the
    metrics that Keras's containers (``CompileMetrics``, nested models) hold."""
    stack, seen = list(getattr(model, "metrics", [])), set()
    while stack:
        metric = stack.pop()
        if id(metric) in seen:
            continue
        seen.add(id(metric))
        yield metric
        stack.extend(getattr(metric, "metrics", []) or [])


def scalar(x) -> float:
    """A number from the logs, or a metric's scalar tensor or variable, as a float."""
    if isinstance(x, keras.Variable):
        x = x.value
    try:
        return float(x)  # a scalar tensor or variable of any backend, a numpy value
    except (TypeError, ValueError):
        pass
    read = getattr(x, "numpy", None)  # tf.distribute's variables (read aggregated)
    return float(read() if callable(read) else keras.ops.convert_to_numpy(x))
