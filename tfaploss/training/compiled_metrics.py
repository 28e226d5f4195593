"""The metrics a compiled Keras model keeps, for callbacks that read them mid-run."""

from __future__ import annotations

__all__ = ["compiled_metrics"]


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
