"""Functional core of the AP surrogates.

Every function here works on a (queries x database) score matrix with boolean
``positives`` (relevant items) and ``candidates`` (items that take part in the
ranking, e.g. everything but the query itself) masks, so the same code ranks a batch
against itself or a batch against a memory bank of reference embeddings. The Keras
loss classes in :mod:`tfaploss.losses` are thin wrappers around these functions.
"""

from tfaploss.ops.masks import label_masks, pairwise_scores, safe_normalize

__all__ = ["label_masks", "pairwise_scores", "safe_normalize"]
