"""What a ``retrieve`` signature searches: the catalogue's embeddings, keys and labels,
and the fingerprint of the model that embedded them.

An index (:func:`build_index`) comes from a split, an embed job's output or the
caller. An export refuses an index of another model by :func:`model_fingerprint`
(:class:`IndexMismatchError`), and one that is not whole (:class:`DamagedIndexError`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from tfaploss.data.split_manifest import MANIFEST

logger = logging.getLogger(__name__)

FINGERPRINT_KEY = "model_fingerprint"  # in the export metadata and the index's record


class DamagedIndexError(ValueError):
    """An index that is not whole: rows missing, values not finite, keys repeated, or
    its stored copy no longer matching what was exported."""


class IndexMismatchError(ValueError):
    """An index embedded by another model than the one it is served with."""


def model_fingerprint(model) -> str:
    """The SHA-256 (hex) of shape, dtype and bytes of each of ``model.weights`` in
    order, BatchNorm statistics included; names are left out, so reloading or renaming
    layers keeps it. Cost: one pass over the weights (~0.3 s for a ResNet-50).
    """
    import keras

    digest = hashlib.sha256(b"tfaploss-model-fingerprint-v1")
    weights = model.weights
    digest.update(len(weights).to_bytes(8, "little"))
    for weight in weights:
        value = np.ascontiguousarray(keras.ops.convert_to_numpy(weight))
        digest.update(f"{value.dtype.str}{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


@dataclass(frozen=True, eq=False)
class RetrievalIndex:
    """The catalogue a ``retrieve`` signature searches: ``embeddings`` (N, D) float32,
    unique str ``keys`` (what a search returns), int64 ``labels`` (-1 when unknown), the
    :func:`model_fingerprint` of the model that embedded them, and their ``source``
    (for messages). A :class:`DamagedIndexError` when they are not whole.
    """

    embeddings: np.ndarray
    keys: np.ndarray
    labels: np.ndarray
    model_fingerprint: str
    source: str = "arrays"

    def __post_init__(self):
        where = f"the index from {self.source}"
        emb = np.asarray(self.embeddings)
        if emb.ndim != 2 or emb.shape[0] == 0 or emb.shape[1] == 0:
            raise DamagedIndexError(f"{where}: `embeddings` must be a non-empty (N, D) "
                                    f"array; received shape {emb.shape}")
        if not np.issubdtype(emb.dtype, np.floating):
            raise DamagedIndexError(f"{where}: `embeddings` must hold floats; received "
                                    f"dtype {emb.dtype}")
        emb = np.ascontiguousarray(emb, np.float32)
        bad = np.flatnonzero(~np.all(np.isfinite(emb), axis=1))
        if bad.size:
            raise DamagedIndexError(f"{where}: {bad.size} row(s) hold NaN or infinite "
                                    f"values (the first at row {int(bad[0])})")
        keys = np.asarray(self.keys)
        if keys.dtype.kind in "SO":  # bytes read from records: UTF-8, not repr()
            keys = np.array([k.decode("utf-8") if isinstance(k, bytes) else str(k)
                             for k in keys.reshape(-1)]).reshape(keys.shape)
        keys = keys.astype(str)
        labels = np.asarray(self.labels)
        if keys.shape != (len(emb),) or labels.shape != (len(emb),):
            raise DamagedIndexError(f"{where}: {len(emb)} rows, but keys of shape "
                                    f"{keys.shape} and labels of shape {labels.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise DamagedIndexError(f"{where}: labels must be integers; received dtype "
                                    f"{labels.dtype}")
        unique, counts = np.unique(keys, return_counts=True)
        if len(unique) != len(keys):
            repeated = unique[counts > 1]
            raise DamagedIndexError(f"{where}: {len(repeated)} key(s) name more than one "
                                    f"row (e.g. {repeated[0]!r}); a key must name one item")
        if not isinstance(self.model_fingerprint, str) or len(self.model_fingerprint) != 64:
            raise ValueError(f"{where}: `model_fingerprint` must be a 64-character hex "
                             f"digest (model_fingerprint(model)); received "
                             f"{self.model_fingerprint!r}")
        object.__setattr__(self, "embeddings", emb)
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "labels", labels.astype(np.int64))

    @property
    def size(self) -> int:
        return int(self.embeddings.shape[0])

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])

    def check_model(self, fingerprint: str, what: str = "the model being exported") -> None:
        """Refuse to serve this index with a model of another ``fingerprint``.

        Raises:
          IndexMismatchError: naming both fingerprints and what to do.
        """
        if self.model_fingerprint != fingerprint:
            raise IndexMismatchError(
                f"the index from {self.source} was embedded by the model with fingerprint "
                f"{self.model_fingerprint[:16]}..., not by {what} "
                f"({fingerprint[:16]}...): its rows and the served queries would not be "
                "comparable. Embed the catalogue with this model (pass the split itself as "
                "the index, or rerun the embed job with this model's export), or export "
                "the model that embedded it")


def _is_split(path: str) -> bool:
    import tensorflow as tf

    return (tf.io.gfile.exists(os.path.join(path, MANIFEST))
            and bool(tf.io.gfile.glob(os.path.join(path, "images-*.tfrecord"))))


def _is_embeddings(path: str) -> bool:
    import tensorflow as tf

    from tfaploss.evaluation.embedding_files import FILE_PREFIX

    return bool(tf.io.gfile.glob(os.path.join(path, f"{FILE_PREFIX}-*")))


def build_index(source, model, image_size=(224, 224), crop_fraction=None,
                batch_size: int = 64, fingerprint: str | None = None) -> RetrievalIndex:
    """The :class:`RetrievalIndex` ``source`` names (an index, a split folder or an
    embeddings folder), checked against ``model`` (the exported one, after any
    whitening). ``image_size``, ``crop_fraction``: the served preprocessing a split is
    embedded with. ``fingerprint``: ``model_fingerprint(model)``, when known.

    Raises :class:`IndexMismatchError`, :class:`DamagedIndexError`, or ``ValueError``
    for a source that is neither, or rows of another dimension than the model's.
    """
    fingerprint = fingerprint or model_fingerprint(model)
    if isinstance(source, RetrievalIndex):
        index = source
    else:
        path = os.fspath(source)
        if _is_split(path):
            index = index_from_split(model, path, image_size, crop_fraction, batch_size,
                                     fingerprint=fingerprint)
        elif _is_embeddings(path):
            index = index_from_embeddings(path)
        else:
            raise ValueError(
                f"`index` {path!r} is neither a split folder (manifest.json and "
                "images-*.tfrecord, written by a pipelines job) nor an embeddings folder "
                "(embeddings-*.tfrecord, written by python -m tfaploss.pipelines.embed)")
    index.check_model(fingerprint)
    dim = int(model.output_shape[-1])
    if index.dim != dim:
        raise ValueError(f"the index from {index.source} holds {index.dim}-d rows; the "
                         f"model embeds in {dim} dimensions")
    return index


def index_from_split(model, split: str, image_size=(224, 224), crop_fraction=None,
                     batch_size: int = 64, fingerprint: str | None = None
                     ) -> RetrievalIndex:
    """Embed every image of a split with ``model`` as the served images are
    preprocessed. Cost: one forward pass per image, in this process (for millions, use
    the embed job and pass its output).
    """
    from tfaploss.data import make_eval_dataset
    from tfaploss.data.augment import DEFAULT_CROP_FRACTION
    from tfaploss.evaluation import embed_dataset

    height, width = (int(s) for s in image_size)
    if height != width:
        raise ValueError(f"an index built from a split needs a square image_size (the "
                         f"evaluation crop is square); received {tuple(image_size)}")
    crop_fraction = DEFAULT_CROP_FRACTION if crop_fraction is None else crop_fraction
    dataset = make_eval_dataset(split, image_size=height,
                                resize_size=round(height / crop_fraction),
                                batch_size=batch_size)
    logger.info("index: embedding the split %s with the model being exported", split)
    embeddings, labels, ids = embed_dataset(model, dataset, verbose=0, predict_step=True)
    if ids is None:
        raise DamagedIndexError(f"the split {split!r} yielded no image ids")
    return RetrievalIndex(embeddings, ids, labels, fingerprint or model_fingerprint(model),
                          source=split)


def index_from_embeddings(path: str) -> RetrievalIndex:
    """Read an embed job's output as an index, keyed by ``image/id``; its manifest
    gives the row count and the SavedModel whose metadata holds the fingerprint."""
    import tensorflow as tf

    from tfaploss.evaluation.embedding_files import load_embeddings

    manifest_path = os.path.join(path, MANIFEST)
    if not tf.io.gfile.exists(manifest_path):
        raise DamagedIndexError(f"the embeddings folder {path!r} has no manifest.json; "
                                "write it with python -m tfaploss.pipelines.embed")
    with tf.io.gfile.GFile(manifest_path) as f:
        try:
            manifest = json.load(f)
        except json.JSONDecodeError as err:
            raise DamagedIndexError(f"{manifest_path} is not JSON ({err})") from None
    missing = [s for s in manifest.get("shards", [])
               if not tf.io.gfile.exists(os.path.join(path, s))]
    if missing:
        raise DamagedIndexError(f"the embeddings folder {path!r} lacks the shard(s) its "
                                f"manifest lists: {', '.join(missing)}")
    try:
        embeddings, labels, ids = load_embeddings(path)
    except tf.errors.DataLossError as err:
        raise DamagedIndexError(f"the embeddings in {path!r} are damaged: "
                                f"{err.message}") from None
    except ValueError as err:
        raise DamagedIndexError(f"the embeddings in {path!r} are damaged: {err}") from None
    expected = manifest.get("num_embedded")
    if expected is not None and expected != len(ids):
        raise DamagedIndexError(f"the embeddings folder {path!r} holds {len(ids)} rows; its "
                                f"manifest counts {expected}")
    fingerprint = _embedding_model_fingerprint(path, manifest)
    return RetrievalIndex(embeddings, ids, labels, fingerprint, source=path)


def _embedding_model_fingerprint(path: str, manifest: dict) -> str:
    """The fingerprint of the SavedModel the embed job's manifest names."""
    from tfaploss.export.versions import read_export_metadata

    model = manifest.get("model")
    if not model:
        raise IndexMismatchError(f"the manifest of {path!r} does not name the model that "
                                 "embedded it; rerun python -m tfaploss.pipelines.embed")
    candidates = [model] if os.path.isabs(model) else [
        model, os.path.join(os.path.dirname(os.path.abspath(path)), model)]
    for candidate in candidates:
        try:
            meta = read_export_metadata(candidate)
        except FileNotFoundError:
            continue
        fingerprint = meta.get(FINGERPRINT_KEY)
        if not fingerprint:
            raise IndexMismatchError(
                f"the SavedModel {candidate!r} that embedded {path!r} records no model "
                "fingerprint (exported by an older tfaploss): export the model again, "
                "rerun the embed job with it, or pass the split itself as the index")
        return fingerprint
    raise IndexMismatchError(
        f"cannot tell which model embedded {path!r}: the SavedModel its manifest names "
        f"({model!r}) is not there; pass the split itself as the index, or rerun the "
        "embed job with this model's export")
