"""One character of one font face -> a small image: the worker side of
:mod:`tfaploss.pipelines.glyphs` (pure Pillow; how it is placed: docs/pipelines.md)."""

from __future__ import annotations

import functools
import hashlib
import io
import os
import random

from PIL import Image, ImageDraw, ImageFont

from tfaploss.pipelines import images as I

NO_INK = "no_ink"            # dead-letter code: a glyph that rendered nothing
UNREADABLE_FONT = "unreadable_font"

SUPERSAMPLE = 2  # render at this many times the canvas, then scale down
# Ink: a pixel at least this dark (of 255). FreeType leaves coverage of 1-3 along a
# contour of zero area (points on a line), which nobody can see.
INK_LEVEL = 32
PROBE_EM = 24  # pixels per em of the planning check for ink (:func:`has_ink`)


def jitter(seed: int, face_id: str, cp: int, *, scale: float, shift: float,
           stroke: float) -> dict:
    """The seeded jitter of one image (SHA-256 of the arguments): ``scale`` in
    ``[1 - scale, 1]``, ``shift_x``/``shift_y`` in ``[-shift, shift]`` canvas widths,
    ``stroke`` in ``[0, stroke]`` canvas pixels."""
    rng = seeded_rng(seed, face_id, cp)
    return {"scale": round(1.0 - scale * rng.random(), 6),
            "shift_x": round(shift * (2 * rng.random() - 1), 6),
            "shift_y": round(shift * (2 * rng.random() - 1), 6),
            "stroke": round(stroke * rng.random(), 6)}


def seeded_rng(*parts) -> random.Random:
    """A ``random.Random`` seeded by SHA-256 of ``parts`` (never Python's ``hash``)."""
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def open_face(path: str, index: int, em: int = PROBE_EM) -> ImageFont.FreeTypeFont:
    """Face ``index`` of ``path`` as FreeType opens it (cached), or ``ImageError``."""
    # Keyed by process: FreeType reads a face through its own file handle, whose
    # position a forked worker would share with its parent and siblings.
    return _open_font(path, index, em, os.getpid())


@functools.lru_cache(maxsize=256)
def _open_font(path: str, index: int, size: int, pid: int) -> ImageFont.FreeTypeFont:
    try:
        return ImageFont.truetype(path, size, index=index)
    except OSError as e:
        raise I.ImageError(UNREADABLE_FONT, f"FreeType cannot open face {index} of "
                                            f"{path}: {e}") from e


def close_fonts() -> None:
    """Forget the faces opened in this process (closing their files)."""
    _open_font.cache_clear()


def has_ink(path: str, index: int, cp: int) -> bool:
    """Whether FreeType draws any ink for ``cp`` at :data:`PROBE_EM` pixels per em (an
    outline may still draw nothing)."""
    extrema = open_face(path, index).getmask(chr(cp)).getextrema()
    return extrema is not None and extrema[1] >= INK_LEVEL


def render(path: str, index: int, cp: int, *, canvas: int, margin: float,
           scale: float = 1.0, shift_x: float = 0.0, shift_y: float = 0.0,
           stroke: float = 0.0) -> Image.Image:
    """Render code point ``cp`` of face ``index`` of ``path`` into a grayscale ``canvas x
    canvas`` image (docs/pipelines.md); ``ImageError`` ``no_ink`` when it draws nothing."""
    em = SUPERSAMPLE * canvas
    font = open_face(path, index, em)
    char = chr(cp)
    # Stroke widths are whole pixels before Pillow 11.1: at 2x, half a canvas pixel.
    stroke_px = max(0, round(stroke * SUPERSAMPLE))
    left, top, right, bottom = font.getbbox(char, stroke_width=stroke_px)
    pad = 2 + stroke_px
    w, h = max(1, right - left + 2 * pad), max(1, bottom - top + 2 * pad)
    big = Image.new("L", (w, h), 0)
    ImageDraw.Draw(big).text((pad - left, pad - top), char, font=font, fill=255,
                             stroke_width=stroke_px, stroke_fill=255)
    if big.getextrema()[1] < INK_LEVEL:
        raise I.ImageError(NO_INK, f"U+{cp:04X} of face {index} of {path} draws nothing")
    big = big.crop(big.getbbox())
    box = canvas * (1.0 - 2.0 * margin)  # the square the em fills at scale 1
    factor = min(box * scale / em, box / max(big.size))
    size = (max(1, min(canvas, round(big.size[0] * factor))),
            max(1, min(canvas, round(big.size[1] * factor))))
    small = big.resize(size, Image.Resampling.LANCZOS)
    x = _place(canvas, size[0], shift_x)
    y = _place(canvas, size[1], shift_y)
    out = Image.new("L", (canvas, canvas), 255)
    out.paste(0, (x, y, x + size[0], y + size[1]), mask=small)
    return out


def _place(canvas: int, size: int, shift: float) -> int:
    return min(max(0, round((canvas - size) / 2 + shift * canvas)), canvas - size)


def render_png(path: str, index: int, cp: int, **kwargs) -> bytes:
    """:func:`render`, PNG-encoded: the render recipe of a glyphs record."""
    buf = io.BytesIO()
    render(path, index, cp, **kwargs).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()
