"""The one embedding loop (``evaluate``'s and the training run's): a model over a
batched dataset -> embeddings, labels, ids."""

from __future__ import annotations

import numpy as np

__all__ = ["EmptyDatasetError", "embed_dataset", "split_element"]


class EmptyDatasetError(ValueError):
    """The dataset given to :func:`embed_dataset` yielded no element."""


def split_element(element):
    """(images, labels, ids) from a dataset element: images | (images, labels) |
    (images, labels, ids) | dict with 'image(s)', 'label(s)', 'id(s)'."""
    if isinstance(element, dict):
        def pick(*names):
            for n in names:
                if n in element:
                    return element[n]
            return None
        images = pick("images", "image", "image/encoded")
        if images is None:
            raise ValueError(f"dataset dict elements need an 'image' key; got {sorted(element)}.")
        return images, pick("labels", "label", "image/class/label"), pick("ids", "id", "image/id")
    if isinstance(element, (tuple, list)):
        if len(element) not in (2, 3):
            raise ValueError(f"dataset elements must be (images, labels) or (images, labels, "
                             f"ids); got a tuple of {len(element)}.")
        return element[0], element[1], (element[2] if len(element) == 3 else None)
    return element, None, None


def embed_dataset(model, dataset, verbose: int = 1, *, predict_step: bool = False):
    """Run ``model`` over a batched dataset; returns ``(embeddings, labels, ids)``.

    Args:
      model: a Keras model (called with ``training=False``) or any callable images ->
        embeddings; a model returning a dict must return one entry.
      dataset: a batched ``tf.data.Dataset`` (or any iterable) of elements
        :func:`split_element` reads.
      verbose: show a Keras progress bar.
      predict_step: run each batch through ``predict_on_batch`` (compiled: faster when
        every batch has the same image size, else retraced at every new shape).

    Returns:
      ``(embeddings (N, D) float32, labels (N,) or None, ids (N,) str or None)``.

    Raises:
      EmptyDatasetError: the dataset yielded nothing.
    """
    import keras
    import tensorflow as tf

    n_batches = None
    if isinstance(dataset, tf.data.Dataset):
        card = int(dataset.cardinality())
        n_batches = card if card >= 0 else None
    bar = keras.utils.Progbar(n_batches, unit_name="batch") if verbose else None
    embs, labels, ids = [], [], []
    for step, element in enumerate(dataset):
        images, lab, idx = split_element(element)
        if predict_step:
            out = model.predict_on_batch(images)
        elif isinstance(model, keras.Model):
            out = model(images, training=False)
        else:
            out = model(images)
        if isinstance(out, dict):
            if len(out) != 1:
                raise ValueError(f"the model returns several outputs {sorted(out)}; "
                                 "pass a model that returns the embedding only.")
            out = next(iter(out.values()))
        embs.append(np.asarray(out, np.float32))
        if lab is not None:
            labels.append(np.asarray(lab).reshape(-1))
        if idx is not None:
            ids.extend(v.decode("utf-8") if isinstance(v, bytes) else str(v)
                       for v in np.asarray(idx).reshape(-1).tolist())
        if bar is not None:
            bar.update(step + 1)
    if not embs:
        raise EmptyDatasetError("the dataset is empty; nothing to embed.")
    emb = np.concatenate(embs)
    lab = np.concatenate(labels) if labels else None
    if lab is not None and len(lab) != len(emb):
        raise ValueError(f"the dataset yielded {len(lab)} labels for {len(emb)} images.")
    return emb, lab, (np.asarray(ids) if ids else None)
