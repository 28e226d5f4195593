"""The on-disk format of embeddings written by ``tfaploss/pipelines/embed.py``: sharded
TFRecord files ``<output>/embeddings-SSSSS-of-NNNNN.tfrecord``, one ``tf.train.Example``
per image with ``embedding`` (the model's D floats), ``image/id`` (bytes: the TFRecord's
``image/id`` or the file path) and ``image/class/label`` (int64, -1 when unknown).
Beam writes records in no particular order; :func:`load_embeddings` sorts them by id.
"""

from __future__ import annotations

import os

import numpy as np

EMBEDDING_KEY = "embedding"
ID_KEY = "image/id"
LABEL_KEY = "image/class/label"
FILE_PREFIX = "embeddings"
FILE_SUFFIX = ".tfrecord"


def embedding_example(embedding, image_id, label: int) -> bytes:
    """Serialise one embedding record."""
    import tensorflow as tf

    if isinstance(image_id, str):
        image_id = image_id.encode("utf-8")
    feature = {
        EMBEDDING_KEY: tf.train.Feature(
            float_list=tf.train.FloatList(value=np.asarray(embedding, np.float32).reshape(-1))),
        ID_KEY: tf.train.Feature(bytes_list=tf.train.BytesList(value=[bytes(image_id)])),
        LABEL_KEY: tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def embedding_files(path: str) -> list[str]:
    """The shard files under ``path`` (a directory, a file or a glob pattern)."""
    import tensorflow as tf

    if tf.io.gfile.isdir(path):
        pattern = os.path.join(path, f"{FILE_PREFIX}-*{FILE_SUFFIX}*")
    else:
        pattern = path
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no embedding files match {pattern!r}; expected the output "
                                "of `python -m tfaploss.pipelines.embed`.")
    return files


def load_embeddings(path: str, batch_size: int = 4096):
    """Read embedding shards into ``(embeddings (N, D) float32, labels (N,) int64,
    ids (N,) str)``, sorted by id."""
    import tensorflow as tf

    spec = {
        EMBEDDING_KEY: tf.io.RaggedFeature(tf.float32),
        ID_KEY: tf.io.FixedLenFeature([], tf.string),
        LABEL_KEY: tf.io.FixedLenFeature([], tf.int64, default_value=-1),
    }
    ds = tf.data.TFRecordDataset(embedding_files(path)).batch(batch_size)
    ds = ds.map(lambda s: tf.io.parse_example(s, spec))
    embs, labels, ids = [], [], []
    for batch in ds:
        e = batch[EMBEDDING_KEY]
        lengths = np.unique(e.row_lengths().numpy())
        if len(lengths) != 1:
            raise ValueError(f"embeddings in {path!r} have different sizes {lengths.tolist()}.")
        embs.append(e.to_tensor().numpy())
        labels.append(batch[LABEL_KEY].numpy())
        ids.extend(x.decode("utf-8") for x in batch[ID_KEY].numpy())
    emb = np.concatenate(embs).astype(np.float32)
    lab = np.concatenate(labels).astype(np.int64)
    ids_arr = np.asarray(ids, dtype=object)
    order = np.argsort(ids_arr.astype(str), kind="stable")
    return emb[order], lab[order], ids_arr[order].astype(str)
