"""Figures for retrieval evaluation, PNG on matplotlib's Agg canvas (no pyplot: headless,
and the caller's matplotlib state is left alone); matplotlib is the ``viz`` extra."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tfaploss import extras
from tfaploss.durable import atomic

GREEN = "#1a9850"
RED = "#d73027"


def _new_figure(width: float, height: float):
    extras.import_extra("viz", "drawing a figure", "matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str) -> None:
    """Write ``fig`` as PNG to ``path``, whole or absent (fault point ``figure``)."""
    atomic.atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"), fault="figure")


def _displayable(img) -> np.ndarray:
    """HWC (or HW) image -> float RGB in [0, 1] for imshow, whatever its scaling."""
    img = np.asarray(img, dtype=np.float64)
    if img.ndim == 3 and img.shape[-1] == 1:
        img = img[..., 0]
    lo, hi = float(img.min()), float(img.max())
    if lo >= 0.0 and hi <= 1.0:
        return img
    if lo >= 0.0 and hi <= 255.0:
        return img / 255.0
    return (img - lo) / max(hi - lo, 1e-12)  # e.g. ImageNet-normalised pixels


def _show(ax, img, colour=None, title=None):
    img = _displayable(img)
    ax.imshow(img, cmap="gray" if img.ndim == 2 else None, vmin=0, vmax=1)
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(colour is not None)
        if colour is not None:
            spine.set_edgecolor(colour)
            spine.set_linewidth(4)
    if title:
        ax.set_title(title, fontsize=8)


def plot_retrieval_examples(query_images, result_images, relevant, path: str,
                            scores=None, query_titles: Sequence[str] | None = None) -> str:
    """Save a grid to the PNG ``path``: each row a query (``query_images`` (n, H, W, C),
    any scaling) then its top-k ``result_images`` (n, k, H, W, C), framed green where
    ``relevant`` (n, k), else red; optional ``scores`` (n, k) and ``query_titles``.
    """
    relevant = np.asarray(relevant, bool)
    n, k = relevant.shape
    if len(query_images) != n or len(result_images) != n:
        raise ValueError(f"got {len(query_images)} query images and {len(result_images)} "
                         f"result rows for {n} rows of `relevant`.")
    fig = _new_figure(1.4 * (k + 1), 1.5 * n)
    axes = fig.subplots(n, k + 1, squeeze=False)
    for r in range(n):
        _show(axes[r, 0], query_images[r], None,
              query_titles[r] if query_titles is not None else "query")
        for c in range(k):
            title = f"{scores[r][c]:.3f}" if scores is not None else f"#{c + 1}"
            _show(axes[r, c + 1], result_images[r][c], GREEN if relevant[r, c] else RED, title)
    fig.tight_layout()
    _save(fig, path)
    return path


def plot_per_query_ap(aps, path: str, names: Sequence[str] | None = None,
                      title: str = "per-query AP") -> str:
    """Save a bar chart of per-query AP (NaN = query without positives, shown empty)."""
    aps = np.asarray(aps, dtype=np.float64)
    fig = _new_figure(max(6.0, 0.18 * len(aps)), 3.2)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(aps))
    ax.bar(x, np.nan_to_num(aps), color="#4575b4")
    valid = ~np.isnan(aps)
    if valid.any():
        ax.axhline(aps[valid].mean(), color="k", linestyle="--", linewidth=1,
                   label=f"mAP {aps[valid].mean():.3f}")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_xlim(-0.6, len(aps) - 0.4)
    ax.set_ylabel("AP")
    ax.set_title(title)
    if names is not None:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=90, fontsize=6)
    fig.tight_layout()
    _save(fig, path)
    return path
