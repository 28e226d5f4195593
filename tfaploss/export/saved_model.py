"""Export an embedding model as a SavedModel for TF Serving."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import keras
import tensorflow as tf

from tfaploss.data.augment import DEFAULT_CROP_FRACTION
from tfaploss.durable import atomic, faults, locks
from tfaploss.evaluation.arrays import check_int
from tfaploss.export.image_ops import (
    DEFAULT_MAX_PIXELS,
    check_max_pixels,
    check_max_request_pixels,
    decode_images,
)
from tfaploss.export.retrieval_index import (
    FINGERPRINT_KEY,
    DamagedIndexError,
    IndexMismatchError,
    build_index,
    model_fingerprint,
)
from tfaploss.export.retrieval_search import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_K,
    INDEX_COLLECTION,
    K_INPUT,
    KEYS_OUTPUT,
    LABELS_OUTPUT,
    RETRIEVE_PIXELS_SIGNATURE,
    RETRIEVE_SIGNATURE,
    SCORES_OUTPUT,
    check_backend,
    load_op_libraries,
    make_search,
    variables_digest,
)
from tfaploss.export.versions import (
    METADATA_FILE,
    find_saved_model,
    next_version,
    read_export_metadata,
)

BYTES_SIGNATURE = "serving_default"
PIXELS_SIGNATURE = "embed_pixels"
OUTPUT_KEY = "embedding"

logger = logging.getLogger(__name__)


def recover_export_folder(path) -> list[str]:
    """Undo what exports killed outright left in ``path`` (a version replaced halfway,
    ``.tmp-*`` staging folders: the caller holds the folder's lock, so no export is
    writing them); returns the staging folders removed."""
    for final in atomic.interrupted_replacements(path):
        if os.path.basename(final).isdigit():
            atomic.recover_folder(final)
    removed = [name for name in sorted(os.listdir(path))
               if name.startswith(".tmp-") and os.path.isdir(os.path.join(path, name))]
    for name in removed:
        shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    if removed:
        logger.warning("export: removed %d staging folder(s) that a killed export left in "
                       "%s: %s", len(removed), path, ", ".join(removed))
    return removed


def export_size(model) -> int:
    """About the bytes a SavedModel of ``model`` takes: its variables as stored, plus
    1 MB for the graph and assets (a ResNet-50's graph is ~0.6 MB)."""
    import numpy as np

    return sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
               for w in model.weights) + (1 << 20)


def load_pixels_embedder(path):
    """``(embed, image_size)`` over the ``embed_pixels`` signature of an export (a
    version folder, or the base folder: its newest version; load only models you
    trust): ``embed(images)`` takes RGB pixels ``[N, h, w, 3]`` in [0, 255] and returns
    float32 ``[N, D]``; ``image_size`` is the signature's image height."""
    loaded = tf.saved_model.load(find_saved_model(path))
    signature = loaded.signatures[PIXELS_SIGNATURE]
    size = signature.structured_input_signature[1]["images"].shape[1]

    def embed(images):
        return signature(images=tf.cast(images, tf.float32))[OUTPUT_KEY]

    embed.loaded = loaded  # keep the SavedModel alive
    return embed, size


def _check_model(model, image_size):
    shape = tuple(model.input_shape)
    if len(shape) != 4 or shape[-1] != 3:
        raise ValueError("export_saved_model: the model must take (B, H, W, 3) images; its "
                         f"input_shape is {shape}")
    for got, want in zip(shape[1:3], image_size):
        if got is not None and got != want:
            raise ValueError(f"export_saved_model: image_size={tuple(image_size)} does not "
                             f"match the model's input size {shape[1:3]}")


def export_saved_model(model, path, image_size=(224, 224), version=None, whitening=None,
                       crop_fraction=DEFAULT_CROP_FRACTION, resize_method="bilinear",
                       antialias=True, max_pixels=DEFAULT_MAX_PIXELS,
                       max_request_pixels=None, overwrite=False, verbose=False, index=None,
                       k=DEFAULT_K, index_backend="brute_force",
                       index_chunk_rows=DEFAULT_CHUNK_ROWS):
    """Write ``model`` as a TF Serving SavedModel in ``path/<version>/``, with a
    retrieval index when ``index`` is given.

    Signatures:

    - ``serving_default``: ``image_bytes`` string ``[None]`` (encoded JPEG, PNG, GIF, BMP or
      WebP files; REST takes ``{"b64": ...}``) -> ``{"embedding": float32 [None, D]}``,
      preprocessed like evaluation (:func:`~tfaploss.export.decode_images`). An
      undecodable input, or headers declaring more than ``max_pixels`` for an image or
      ``max_request_pixels`` in all, fails the batch with ``INVALID_ARGUMENT``.
    - ``embed_pixels``: ``images`` float32 ``[None, h, w, 3]``, RGB pixels in
      [0, 255] already at ``image_size`` -> ``{"embedding": ...}``.
    - With ``index``: ``retrieve`` (``image_bytes``) and ``retrieve_pixels``
      (``images``), with an optional int32 ``k`` (1 to the exported ``k``) ->
      ``{"keys", "scores", "labels"}``, each ``[None, k]``, best first.

    Args:
        model: a Keras model from raw ``(B, H, W, 3)`` images in [0, 255] to
            embeddings.
        path: the model's base directory (TF Serving's ``--model_base_path``).
        image_size: ``(height, width)`` the served images are cropped to.
        version: integer version directory; ``None`` takes 1 + the largest existing.
        whitening: optional ``tfaploss.models.PCAWhitening`` appended to the model.
        crop_fraction: see above; 1.0 keeps the whole short side.
        resize_method, antialias: passed to ``tf.image.resize``.
        max_pixels: largest width x height an image header may declare (all frames of
            a GIF together); default 40 megapixels.
        max_request_pixels: largest total over one request's images, at least
            ``max_pixels``; default ``None``: 4 x ``max_pixels``.
        overwrite: replace an existing ``path/<version>``; otherwise it is an error.
        verbose: print Keras's summary of the exported endpoints.
        index: ``None``, or the catalogue ``retrieve`` searches, embedded by this model:
            a split folder (embedded here), an embeddings folder of
            ``python -m tfaploss.pipelines.embed``, or a ``RetrievalIndex``.
        k: the most results a ``retrieve`` request gets (at most the index's size).
        index_backend: ``"brute_force"`` (exact, stock TF ops) or ``"scann"``
            (approximate; needs ScaNN's ops here and in the server).
        index_chunk_rows: index rows scored at once by brute force.

    Raises:
        IndexMismatchError: ``index`` was embedded by another model.
        DamagedIndexError: ``index`` is not whole.

    Returns:
        The version directory (``str``).

    The version is written to a temporary directory and renamed into place (a server
    never loads a half-written one), under ``path``'s lock. Cost: one trace per
    signature; with ``index``, embedding a split and a pass over the index (~1 s/GB).
    """
    image_size = tuple(int(s) for s in image_size)
    max_pixels = check_max_pixels(max_pixels)
    max_request_pixels = check_max_request_pixels(max_request_pixels, max_pixels)
    if index is not None:
        k = check_int("k", k)
        index_backend = check_backend(index_backend)
    if whitening is not None:
        from tfaploss.models.whitening import with_whitening

        model = with_whitening(model, whitening)
    _check_model(model, image_size)
    fingerprint = model_fingerprint(model)
    search = None
    if index is not None:  # before the folder's lock: embedding a split takes a while
        index = build_index(index, model, image_size, crop_fraction, fingerprint=fingerprint)
        search = make_search(index, k, index_backend, index_chunk_rows)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    # One export at a time per folder: what a killed export left is then known stale.
    with locks.exclusive(path, "SavedModel export folder"):
        recover_export_folder(path)
        version = next_version(path) if version is None else int(version)
        if version < 0:
            raise ValueError(f"export_saved_model: `version` must be >= 0; received {version!r}")
        target = os.path.join(path, str(version))
        if os.path.exists(target) and not overwrite:
            raise FileExistsError(f"export_saved_model: {target} already exists; pass another "
                                  "`version`, version=None for the next one, or overwrite=True")

        needed = export_size(model) + (0 if index is None else _index_size(index))
        atomic.check_space(target, needed)  # before tracing, before TensorFlow writes a byte

        bytes_spec = tf.TensorSpec([None], tf.string, name="image_bytes")
        pixels_spec = tf.TensorSpec([None, *image_size, 3], tf.float32, name="images")

        def embed(images):
            return {OUTPUT_KEY: tf.cast(model(images, training=False), tf.float32)}

        def serve_bytes(image_bytes):
            images = decode_images(image_bytes, image_size, crop_fraction, resize_method,
                                   antialias, max_pixels, max_request_pixels)
            return embed(images)

        archive = keras.export.ExportArchive()
        archive.track(model)
        archive.add_endpoint(BYTES_SIGNATURE, serve_bytes, input_signature=[bytes_spec])
        archive.add_endpoint(PIXELS_SIGNATURE, embed, input_signature=[pixels_spec])
        metadata = {
            "signatures": {BYTES_SIGNATURE: {"input": "image_bytes", "output": OUTPUT_KEY},
                           PIXELS_SIGNATURE: {"input": "images", "output": OUTPUT_KEY}},
            "image_size": list(image_size), "crop_fraction": crop_fraction,
            "resize_method": resize_method, "antialias": antialias,
            "max_pixels": max_pixels, "max_request_pixels": max_request_pixels,
            "embedding_dim": int(model.output_shape[-1]),
            "whitening": whitening is not None, "model_name": model.name,
            FINGERPRINT_KEY: fingerprint}
        if search is not None:
            metadata["retrieval"] = _add_retrieval(archive, search, index, embed, serve_bytes,
                                                   (bytes_spec, pixels_spec))
            metadata["retrieve_signatures"] = {
                name: {"input": first, "optional_input": K_INPUT,
                       "outputs": [KEYS_OUTPUT, SCORES_OUTPUT, LABELS_OUTPUT]}
                for name, first in ((RETRIEVE_SIGNATURE, "image_bytes"),
                                    (RETRIEVE_PIXELS_SIGNATURE, "images"))}

        tmp = tempfile.mkdtemp(prefix=f".tmp-{version}-", dir=path)
        try:
            archive.write_out(tmp, verbose=verbose)
            os.makedirs(os.path.join(tmp, "assets.extra"), exist_ok=True)
            with open(os.path.join(tmp, METADATA_FILE), "w", encoding="utf-8") as f:
                json.dump(metadata, f, indent=2)
            faults.no_space("export_enospc", path=os.path.join(tmp, "saved_model.pb"))
            atomic.replace_folder(tmp, target)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial version would keep the disk full
            if atomic.is_disk_full(err) and not isinstance(err, atomic.DiskFullError):
                raise atomic.DiskFullError(target, needed, atomic.free_bytes(path)) from None
            raise
        return target


def _index_size(index) -> int:
    """About the bytes an index adds to a version: rows, keys and labels."""
    return index.embeddings.nbytes + sum(len(key) for key in index.keys) + 16 * index.size


def _add_retrieval(archive, search, index, embed, serve_bytes, specs) -> dict:
    """Add ``retrieve`` and ``retrieve_pixels`` (``specs``: the inputs of the two
    embedding signatures) to ``archive``; returns what the metadata records of the index."""
    default_k = tf.constant(search.k, tf.int32)  # a SignatureDef default: k is optional

    def retrieve(image_bytes, k=default_k):
        return search.search(serve_bytes(image_bytes)[OUTPUT_KEY], k)

    def retrieve_pixels(images, k=default_k):
        return search.search(embed(images)[OUTPUT_KEY], k)

    k_spec = tf.TensorSpec([], tf.int32, name=K_INPUT)
    bytes_spec, pixels_spec = specs
    archive.add_endpoint(RETRIEVE_SIGNATURE, retrieve, input_signature=[bytes_spec, k_spec])
    archive.add_endpoint(RETRIEVE_PIXELS_SIGNATURE, retrieve_pixels,
                         input_signature=[pixels_spec, k_spec])
    archive.add_variable_collection(INDEX_COLLECTION, search.variables)
    return {"backend": search.backend, "k": search.k, "size": index.size,
            "dim": index.dim, "dtype": "float32", "source": index.source,
            "chunk_rows": getattr(search, "chunk_rows", None),
            FINGERPRINT_KEY: index.model_fingerprint,
            "index_sha256": variables_digest(search.variables)}


def load_retriever(path):
    """The ``retrieve`` signature of an export (a version folder, or the base folder:
    its newest version; load only models you trust), after checking that its index is
    the one exported with its model.

    Returns ``retrieve(image_bytes, k=None)`` -> ``{"keys", "scores", "labels"}`` (numpy,
    ``keys`` as str), with ``retrieve.pixels(images, k=None)`` and ``retrieve.metadata``.
    Raises :class:`IndexMismatchError`, :class:`DamagedIndexError` or ``ValueError``
    (no ``retrieve`` signature). Cost: loading the SavedModel and a pass over the index.
    """
    folder = find_saved_model(path)
    meta = read_export_metadata(folder)
    retrieval = meta.get("retrieval")
    if retrieval is None:
        raise ValueError(f"{folder!r} has no retrieve signature; export it with an index "
                         "(tfaploss export --index ...)")
    if retrieval.get(FINGERPRINT_KEY) != meta.get(FINGERPRINT_KEY):
        raise IndexMismatchError(
            f"the index in {folder!r} was embedded by the model with fingerprint "
            f"{str(retrieval.get(FINGERPRINT_KEY))[:16]}..., not by the model it is "
            f"served with ({str(meta.get(FINGERPRINT_KEY))[:16]}...); export them together "
            "again")
    load_op_libraries(retrieval["backend"])
    try:
        loaded = tf.saved_model.load(folder)
    except tf.errors.DataLossError as err:
        raise DamagedIndexError(f"the SavedModel in {folder!r} is damaged: "
                                f"{err.message}") from None
    if variables_digest(getattr(loaded, INDEX_COLLECTION)) != retrieval["index_sha256"]:
        raise DamagedIndexError(
            f"the index stored in {folder!r} is not the one exported with its model (its "
            "digest differs from the metadata's index_sha256); export it again")

    def run(signature, inputs, k):
        fn = loaded.signatures[signature]
        out = fn(**inputs, k=tf.constant(retrieval["k"] if k is None else k, tf.int32))
        result = {name: value.numpy() for name, value in out.items()}
        result[KEYS_OUTPUT] = result[KEYS_OUTPUT].astype(str)
        return result

    def retrieve(image_bytes, k=None):
        return run(RETRIEVE_SIGNATURE, {"image_bytes": tf.constant(image_bytes)}, k)

    retrieve.pixels = lambda images, k=None: run(
        RETRIEVE_PIXELS_SIGNATURE, {"images": tf.cast(images, tf.float32)}, k)
    retrieve.metadata = meta
    retrieve.loaded = loaded  # keep the SavedModel alive
    return retrieve
