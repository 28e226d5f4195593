"""Retrieval models: backbones, pooling, heads and whitening."""

from models.gem import GeM

__all__ = ["GeM"]
