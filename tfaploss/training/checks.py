"""Exactness guards for multi-staged backpropagation, which embeds every chunk twice and
is exact only when both passes agree: the model must be deterministic in training
mode (no dropout, noise or augmentation layers). BatchNorm on batch statistics is
allowed: both stages normalise a chunk with its own statistics (ghost batch norm,
Hoffer et al., NeurIPS 2017; ``docs/batch_sweep/first_sweep.md``)."""

from __future__ import annotations

import warnings

import keras

from tfaploss.models.batch_norm import FrozenBatchNormalization

_NONDETERMINISTIC_CHOICES = ("warn", "raise", "ignore")


class NondeterministicModelWarning(UserWarning):
    """A model used for multi-staged backpropagation is random in training mode."""


def find_nondeterministic_layers(model: keras.layers.Layer) -> list[str]:
    """One line per layer of ``model`` drawing random numbers in training (dropout,
    noise, augmentation, unless their rate is 0); empty when it is safe."""
    problems = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if isinstance(layer, keras.layers.BatchNormalization):
            continue
        if any(isinstance(v, keras.random.SeedGenerator) for v in vars(layer).values()):
            rate = getattr(layer, "rate", None)
            if rate is not None and float(rate) == 0.0:
                continue
            problems.append(
                f"{layer.name} ({type(layer).__name__}) draws random numbers in "
                "training mode; remove it (augment in the input pipeline, before the "
                "step) or set its rate to 0"
            )
    return problems


def batch_statistics_layers(model: keras.layers.Layer) -> list:
    """The BatchNorm layers of ``model`` that normalise with batch statistics in training."""
    return [layer for layer in model._flatten_layers(include_self=True, recursive=True)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
            and not isinstance(layer, FrozenBatchNormalization)]


def check_deterministic(model: keras.layers.Layer, on_nondeterministic: str = "warn") -> list[str]:
    """Warn about (``"warn"``, a :class:`NondeterministicModelWarning`), raise on
    (``"raise"``, a ``ValueError``) or ``"ignore"`` layers that make stage 1 and stage 3
    differ; returns the problems found."""
    if on_nondeterministic not in _NONDETERMINISTIC_CHOICES:
        raise ValueError(
            f"`on_nondeterministic` must be one of {_NONDETERMINISTIC_CHOICES}, "
            f"received on_nondeterministic={on_nondeterministic!r}"
        )
    problems = find_nondeterministic_layers(model)
    if not problems or on_nondeterministic == "ignore":
        return problems
    message = (
        f"Multi-staged backpropagation is exact only for a model that is deterministic "
        f"in training mode, but {model.name!r} has {len(problems)} layer(s) that are "
        "not, so stage 3 would backpropagate through different embeddings than the "
        "loss saw:\n  - " + "\n  - ".join(problems) + "\nPass "
        "on_nondeterministic='ignore' to accept an approximate gradient."
    )
    if on_nondeterministic == "raise":
        raise ValueError(message)
    warnings.warn(message, NondeterministicModelWarning, stacklevel=3)
    return problems
