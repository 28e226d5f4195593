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
from tfaploss.export.image_ops import (
    DEFAULT_MAX_PIXELS,
    check_max_pixels,
    check_max_request_pixels,
    decode_images,
)

BYTES_SIGNATURE = "serving_default"
PIXELS_SIGNATURE = "embed_pixels"
OUTPUT_KEY = "embedding"
METADATA_FILE = os.path.join("assets.extra", "tfaploss_export.json")

logger = logging.getLogger(__name__)


def _versions(path) -> list[int]:
    """The integer-named sub-directories of ``path`` (TF Serving's version folders)."""
    return [int(d) for d in os.listdir(path) if d.isdigit()] if os.path.isdir(path) else []


def recover_export_folder(path) -> list[str]:
    """Undo what exports killed outright left in ``path``; returns what it removed.

    A version whose replacement was killed between its two renames (where the atomic
    exchange is unavailable) is put back or its old copy dropped
    (:func:`tfaploss.durable.atomic.recover_folder`), and ``.tmp-*`` staging folders
    are deleted: the caller holds the folder's lock, so no export is writing them.
    """
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


def next_version(path) -> int:
    """1 + the largest integer-named sub-directory of ``path`` (1 when none)."""
    return max(_versions(path), default=0) + 1


def export_size(model) -> int:
    """About the bytes a SavedModel of ``model`` takes: its variables as stored, plus
    1 MB for the graph and assets (a ResNet-50's graph is ~0.6 MB)."""
    import numpy as np

    return sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
               for w in model.weights) + (1 << 20)


def find_saved_model(path) -> str:
    """The SavedModel folder ``path`` names: ``path`` itself when it holds
    ``saved_model.pb``, else its newest version folder (as TF Serving serves it).

    Raises:
      FileNotFoundError: ``path`` holds neither ``saved_model.pb`` nor a version folder.
    """
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, "saved_model.pb")):
        return path
    versions = _versions(path)
    if not versions:
        raise FileNotFoundError(f"{path!r} is not a SavedModel folder (no saved_model.pb, "
                                "no version folders)")
    return os.path.join(path, str(max(versions)))


def load_pixels_embedder(path):
    """A callable images -> embeddings over the ``embed_pixels`` signature of a
    SavedModel written by :func:`export_saved_model`.

    Args:
      path: a version folder or the model base folder (its newest version is loaded,
        see :func:`find_saved_model`). Load only models you trust: a SavedModel can run
        arbitrary graph code.

    Returns:
      ``(embed, image_size)``: ``embed(images)`` takes float RGB pixels ``[N, h, w, 3]``
      in [0, 255] and returns float32 ``[N, D]``; ``image_size`` is the signature's
      image height.

    Example::

        embed, size = load_pixels_embedder("serving/sop")
        embeddings = embed(images)
    """
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
        raise ValueError(
            "export_saved_model: the model must take (B, H, W, 3) images; its input_shape "
            f"is {shape}"
        )
    for got, want in zip(shape[1:3], image_size):
        if got is not None and got != want:
            raise ValueError(
                f"export_saved_model: image_size={tuple(image_size)} does not match the "
                f"model's input size {shape[1:3]}"
            )


def export_saved_model(
    model,
    path,
    image_size=(224, 224),
    version=None,
    whitening=None,
    crop_fraction=DEFAULT_CROP_FRACTION,
    resize_method="bilinear",
    antialias=True,
    max_pixels=DEFAULT_MAX_PIXELS,
    max_request_pixels=None,
    overwrite=False,
    verbose=False,
):
    """Write ``model`` as a TF Serving SavedModel in ``path/<version>/``.

    Signatures (``saved_model_cli show --dir path/<version> --all`` lists them):

    - ``serving_default``: ``image_bytes`` string ``[None]`` (encoded JPEG, PNG, GIF, BMP or
      WebP files; the ``_bytes`` suffix lets TF Serving's REST API take
      ``{"b64": ...}``) -> ``{"embedding": float32 [None, D]}``. Each image is decoded
      to RGB and preprocessed like evaluation: resized keeping its aspect so that
      ``image_size`` covers ``crop_fraction`` of the short side (224 / 0.875 = 256),
      then centre-cropped to ``image_size``
      (``tfaploss.export.resize_and_center_crop``). A batch holding an undecodable
      input fails with ``INVALID_ARGUMENT`` naming its index(es), and so does one whose
      header declares more than ``max_pixels`` pixels, or whose images declare more than
      ``max_request_pixels`` in all (both checked before decoding).
    - ``embed_pixels``: ``images`` float32 ``[None, h, w, 3]``, RGB pixels in
      [0, 255] already at ``image_size`` -> ``{"embedding": ...}`` (no resizing).

    The model itself normalises the pixels (``build_embedding_model`` puts the
    ImageNet normalisation inside it). The SavedModel needs only TensorFlow:
    ``tf.saved_model.load(dir).signatures["serving_default"](image_bytes=...)``.

    Args:
        model: a Keras model from raw ``(B, H, W, 3)`` images in [0, 255] to
            embeddings (e.g. from ``tfaploss.models.build_embedding_model``).
        path: the model's base directory (TF Serving's ``--model_base_path``).
        image_size: ``(height, width)`` the served images are cropped to.
        version: integer version directory; ``None`` takes 1 + the largest existing.
        whitening: optional ``tfaploss.models.PCAWhitening`` (from ``tfaploss.models.fit_pca_whitening``)
            appended to the model before export.
        crop_fraction: see above; 1.0 keeps the whole short side.
        resize_method, antialias: passed to ``tf.image.resize``.
        max_pixels: largest width x height (as the image header declares it; all frames
            of a GIF together) that ``serving_default`` decodes; default 40 megapixels
            (see ``tfaploss.export.image_ops.DEFAULT_MAX_PIXELS`` for why).
        max_request_pixels: largest total of those sizes over one request's images;
            default ``None``: 4 x ``max_pixels`` (160 megapixels by default; see
            ``tfaploss.export.image_ops.REQUEST_PIXELS_PER_MAX_PIXELS`` for why). At
            least ``max_pixels``.
        overwrite: replace an existing ``path/<version>``; otherwise it is an error.
        verbose: print Keras's summary of the exported endpoints.

    Returns:
        The version directory (``str``) holding ``saved_model.pb`` and ``variables/``.

    The version is written to a temporary directory and renamed into place, so a
    server polling ``path`` never loads a half-written version. One export at a time
    holds ``path``'s lock (a second gets :class:`~tfaploss.durable.locks.LockHeldError`),
    and each first cleans up what a killed export left (:func:`recover_export_folder`).
    Cost: one trace of the model per signature.
    """
    image_size = tuple(int(s) for s in image_size)
    max_pixels = check_max_pixels(max_pixels)
    max_request_pixels = check_max_request_pixels(max_request_pixels, max_pixels)
    if whitening is not None:
        from tfaploss.models.whitening import with_whitening

        model = with_whitening(model, whitening)
    _check_model(model, image_size)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    # One export at a time per folder, so that what a killed export left behind is known
    # to be stale and is cleaned up before the version number is chosen.
    with locks.exclusive(path, "SavedModel export folder"):
        recover_export_folder(path)
        version = next_version(path) if version is None else int(version)
        if version < 0:
            raise ValueError(f"export_saved_model: `version` must be >= 0; received {version!r}")
        target = os.path.join(path, str(version))
        if os.path.exists(target) and not overwrite:
            raise FileExistsError(
                f"export_saved_model: {target} already exists; pass another `version`, "
                "version=None for the next one, or overwrite=True"
            )

        needed = export_size(model)
        atomic.check_space(target, needed)  # before tracing, before TensorFlow writes a byte

        height, width = image_size

        def embed(images):
            return {OUTPUT_KEY: tf.cast(model(images, training=False), tf.float32)}

        def serve_bytes(image_bytes):
            images = decode_images(image_bytes, image_size, crop_fraction, resize_method,
                                   antialias, max_pixels, max_request_pixels)
            return embed(images)

        def serve_pixels(images):
            return embed(images)

        archive = keras.export.ExportArchive()
        archive.track(model)
        archive.add_endpoint(
            BYTES_SIGNATURE, serve_bytes,
            input_signature=[tf.TensorSpec([None], tf.string, name="image_bytes")],
        )
        archive.add_endpoint(
            PIXELS_SIGNATURE, serve_pixels,
            input_signature=[tf.TensorSpec([None, height, width, 3], tf.float32, name="images")],
        )

        tmp = tempfile.mkdtemp(prefix=f".tmp-{version}-", dir=path)
        try:
            archive.write_out(tmp, verbose=verbose)
            os.makedirs(os.path.join(tmp, "assets.extra"), exist_ok=True)
            with open(os.path.join(tmp, METADATA_FILE), "w", encoding="utf-8") as f:
                json.dump(
                    {
                        "signatures": {
                            BYTES_SIGNATURE: {"input": "image_bytes", "output": OUTPUT_KEY},
                            PIXELS_SIGNATURE: {"input": "images", "output": OUTPUT_KEY},
                        },
                        "image_size": list(image_size),
                        "crop_fraction": crop_fraction,
                        "resize_method": resize_method,
                        "antialias": antialias,
                        "max_pixels": max_pixels,
                        "max_request_pixels": max_request_pixels,
                        "embedding_dim": int(model.output_shape[-1]),
                        "whitening": whitening is not None,
                        "model_name": model.name,
                    },
                    f,
                    indent=2,
                )
            faults.no_space("export_enospc", path=os.path.join(tmp, "saved_model.pb"))
            atomic.replace_folder(tmp, target)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial version would keep the disk full
            if atomic.is_disk_full(err) and not isinstance(err, atomic.DiskFullError):
                raise atomic.DiskFullError(target, needed, atomic.free_bytes(path)) from None
            raise
        return target
