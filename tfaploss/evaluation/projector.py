"""Pictures of an embedding space: TensorBoard's embedding projector
(:func:`export_projector`), and a UMAP plot (:func:`umap_figure`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tfaploss.durable import atomic, faults

__all__ = ["VIZ_INSTALL", "export_projector", "umap_figure"]

VIZ_INSTALL = 'pip install "tfaploss[viz]"'
#: The checkpoint prefix and the one tensor the projector shows.
CHECKPOINT = "embeddings.ckpt"
TENSOR_NAME = "embedding/.ATTRIBUTES/VARIABLE_VALUE"


def _check(embeddings, labels):
    embeddings = np.asarray(embeddings, dtype=np.float32)
    if embeddings.ndim != 2 or not len(embeddings):
        raise ValueError("export_projector: embeddings must be a non-empty (N, D) array; "
                         f"received shape {embeddings.shape}.")
    labels = np.asarray(labels).reshape(len(labels), -1) if labels is not None else None
    if labels is not None and len(labels) != len(embeddings):
        raise ValueError(f"export_projector: {len(labels)} labels for {len(embeddings)} "
                         "embeddings; pass one label per embedding.")
    return embeddings, labels


def _tsv_cell(value) -> str:
    # A tab or newline inside a cell would shift every later row of metadata.tsv.
    return " ".join(str(value).split())


def _metadata_text(labels: np.ndarray) -> str:
    rows = ["\t".join(_tsv_cell(v) for v in row) for row in labels]
    if labels.shape[1] > 1:  # the projector reads a header row only with 2+ columns
        rows.insert(0, "\t".join(["label"] + [f"level_{i}" for i in
                                              range(1, labels.shape[1])]))
    return "\n".join(rows) + "\n"


def _config_text(tensor_name: str, tensor_path: str | None, metadata: str | None) -> str:
    """The ``ProjectorConfig`` text, written by hand: TensorBoard need not be installed,
    and the names are fixed ones that protobuf's text format would not escape."""
    lines = ["embeddings {", f'  tensor_name: "{tensor_name}"']
    if metadata:
        lines.append(f'  metadata_path: "{metadata}"')
    if tensor_path:
        lines.append(f'  tensor_path: "{tensor_path}"')
    return "\n".join(lines + ["}"]) + "\n"


def _write_checkpoint(embeddings: np.ndarray, log_dir: Path) -> bool:
    """The embeddings as a TensorFlow checkpoint and the ``checkpoint`` file naming it;
    False without TensorFlow."""
    try:
        import tensorflow as tf
    except ImportError:
        return False
    tmp = atomic.temp_name(log_dir / CHECKPOINT)
    try:
        written = tf.train.Checkpoint(embedding=tf.Variable(embeddings)).write(str(tmp))
        faults.no_space("projector_enospc", path=f"{written}.index")
    except Exception as err:
        for path in tf.io.gfile.glob(f"{tmp}*"):  # half-written files keep the disk full
            if tf.io.gfile.isdir(path):
                tf.io.gfile.rmtree(path)
            else:
                tf.io.gfile.remove(path)
        if atomic.is_disk_full(err) and not isinstance(err, atomic.DiskFullError):
            raise atomic.DiskFullError(log_dir / CHECKPOINT, embeddings.nbytes,
                                       atomic.free_bytes(log_dir)) from None
        raise
    # The index names its shards by the prefix it is read with: all renamed, index last.
    shards = sorted(Path(p) for p in tf.io.gfile.glob(f"{written}.data-*"))
    for shard in shards:
        os.replace(shard, log_dir / (CHECKPOINT + shard.name[len(tmp.name):]))
    os.replace(f"{written}.index", log_dir / f"{CHECKPOINT}.index")
    atomic.atomic_write_text(log_dir / "checkpoint",
                             f'model_checkpoint_path: "{CHECKPOINT}"\n'
                             f'all_model_checkpoint_paths: "{CHECKPOINT}"\n')
    return True


def export_projector(embeddings, labels, log_dir, *, checkpoint: bool | None = None) -> Path:
    """Write embeddings for TensorBoard's embedding projector into ``log_dir``.

    Files: the embeddings (checkpoint ``embeddings.ckpt``, or ``tensors.tsv`` without
    TensorFlow), ``metadata.tsv`` (one row of labels per embedding, a header with
    several columns) and ``projector_config.pbtxt``, each written whole or not at all.

    Args:
        embeddings: (N, D) array.
        labels: (N,) or (N, L) labels, or None (no metadata).
        log_dir: the folder (created if needed).
        checkpoint: write a TensorFlow checkpoint (True) or ``tensors.tsv`` (False);
            None: a checkpoint when TensorFlow is installed.

    Returns:
        The path of ``projector_config.pbtxt``.
    """
    embeddings, labels = _check(embeddings, labels)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    metadata = None
    if labels is not None:
        metadata = "metadata.tsv"
        atomic.atomic_write_text(log_dir / metadata, _metadata_text(labels),
                                 fault="projector")
    tensor_path = None
    if checkpoint is False or not _write_checkpoint(embeddings, log_dir):
        if checkpoint:
            raise ImportError("export_projector(checkpoint=True) needs TensorFlow; "
                              "pass checkpoint=None to write tensors.tsv instead.")
        tensor_path = "tensors.tsv"
        atomic.atomic_write(log_dir / tensor_path, lambda tmp: np.savetxt(
            tmp, embeddings, delimiter="\t", fmt="%.7g"), fault="projector")
    config = log_dir / "projector_config.pbtxt"
    atomic.atomic_write_text(config, _config_text(
        TENSOR_NAME if tensor_path is None else "embeddings", tensor_path, metadata),
        fault="projector")
    return config


def umap_figure(embeddings, labels, path, *, n_neighbors: int = 15, seed: int = 0,
                title: str | None = None) -> Path:
    """A 2-D UMAP of ``embeddings`` (cosine metric), one colour per label (their first
    column if 2-D), written to the PNG ``path``; needs the ``viz`` extra.
    ``n_neighbors``, ``seed``: UMAP's neighbourhood size and random state.
    """
    try:
        import umap
    except ImportError:
        raise ImportError(f"umap_figure needs umap-learn, which is not installed: "
                          f"{VIZ_INSTALL}") from None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(f"umap_figure needs matplotlib, which is not installed: "
                          f"{VIZ_INSTALL}") from None
    embeddings, labels = _check(embeddings, labels)
    points = umap.UMAP(n_neighbors=min(n_neighbors, len(embeddings) - 1), metric="cosine",
                       random_state=seed).fit_transform(embeddings)
    fig = Figure(figsize=(6, 6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours = None if labels is None else np.unique(labels[:, 0], return_inverse=True)[1]
    ax.scatter(points[:, 0], points[:, 1], c=colours, cmap="tab20", s=6)
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title)
    return atomic.atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"),
                               fault="figure")
