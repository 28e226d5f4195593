"""The size an image's decoder will allocate, read from its header before PIL sees it
(:func:`read_size`, walking the header as the decoder does). The rules per format and
the caps: docs/pipelines.md. Cost: linear in the file (~10 ms for the worst 1 MB
input); pure Python.
"""

from __future__ import annotations

import re

MAX_SEGMENTS = 10_000        # JPEG segments / PNG chunks / GIF sub-blocks before the image
MAX_EXTRANEOUS = 65_536      # JPEG bytes between segments that are not markers
MAX_GIF_EXTENSIONS = 1 << 20  # GIF extension bytes before the first image (PIL joins
#                              a comment's sub-blocks one by one: quadratic)
MAX_JPEG_SCANS = 100         # libjpeg's default progression has 10 scans
MAX_JPEG_SCAN_PIXELS = 1e9   # scans x pixels: 25 scans of a 40 MP image, 11 of 89 MP

BMP_HEADERS = (12, 40, 52, 56, 64, 108, 124)

# A marker: FF followed by a code that is neither fill (FF), stuffing (00), nor one
# without a length (TEM 01, RST0-7 D0-D7), which libjpeg passes over. Two bytes, so the
# search is linear however many FF bytes the file holds.
_JPEG_MARKER = re.compile(rb"\xff[^\x00\x01\xd0-\xd7\xff]")
_JPEG_SEGMENTS = {0xC4, 0xCC, 0xDB, 0xDC, 0xDD, 0xFE, *range(0xE0, 0xF0)}
_JPEG_FRAMES = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


class HeaderError(ValueError):
    """A header the decoder would misread or that is refused; the message says why.
    ``truncated``: the file ends inside it."""

    def __init__(self, message: str, truncated: bool = False):
        super().__init__(message)
        self.truncated = truncated


def _uint(size: int, order: str):
    """A reader of the ``size``-byte unsigned integer at ``data[at:]``."""
    return lambda data, at: int.from_bytes(data[at:at + size], order)


_be16, _be32 = _uint(2, "big"), _uint(4, "big")
_le16, _le24, _le32 = _uint(2, "little"), _uint(3, "little"), _uint(4, "little")


def read_size(data: bytes) -> tuple[str, int, int] | None:
    """``(format, width, height)`` the decoder will allocate for ``data``'s first frame.

    None for bytes that are not JPEG, PNG, GIF, BMP or WebP. Raises
    :class:`HeaderError` for a header that is malformed, that the decoder would read
    differently, or that exceeds the caps (``MAX_*``).
    """
    if data[:3] == b"\xff\xd8\xff":
        return ("JPEG", *_jpeg(data))
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return ("PNG", *_png(data))
    if data[:3] == b"GIF":
        return ("GIF", *_gif(data))
    if data[:2] == b"BM":
        return ("BMP", *_bmp(data))
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ("WEBP", *_webp(data))
    return None


def _jpeg(data: bytes) -> tuple[int, int]:
    n = len(data)
    pos, segments, extraneous, frame = 2, 0, 0, None
    while True:
        found = _JPEG_MARKER.search(data, pos)
        if found is None:
            raise HeaderError("JPEG: the file ends before its first scan", truncated=True)
        extraneous += found.start() - pos
        segments += 1
        if extraneous > MAX_EXTRANEOUS or segments > MAX_SEGMENTS:
            raise HeaderError(f"JPEG: more than {MAX_SEGMENTS} segments or {MAX_EXTRANEOUS} "
                              "stray bytes before the first scan")
        at = found.start() + 1
        marker = data[at]
        if marker == 0xDA:
            if frame is None:
                raise HeaderError("JPEG: a scan before any frame header")
            break
        if marker not in _JPEG_SEGMENTS and marker not in _JPEG_FRAMES:
            name = {0xD8: "a second SOI", 0xD9: "EOI"}.get(marker, f"marker FF{marker:02X}")
            raise HeaderError(f"JPEG: {name} before the first scan (libjpeg refuses it)")
        length = max(_be16(data, at + 1), 2)
        if at + 1 + length > n:
            raise HeaderError(f"JPEG: segment FF{marker:02X} at byte {at - 1} runs past the "
                              "end of the file", truncated=True)
        if marker in _JPEG_FRAMES:
            if frame is not None:
                raise HeaderError("JPEG: a second frame header (libjpeg refuses it)")
            height, width = _be16(data, at + 4), _be16(data, at + 6)
            if length < 8 or not (width and height):
                raise HeaderError(f"JPEG: frame header of {width}x{height}")
            frame = width, height
        pos = at + 1 + length
    width, height = frame
    scans = data.count(b"\xff\xda")  # entropy-coded data stuffs FF: only real SOS (and
    # thumbnails' ones) match, which errs on the side of refusing
    if scans > MAX_JPEG_SCANS or scans * width * height > MAX_JPEG_SCAN_PIXELS:
        raise HeaderError(f"JPEG: {scans} scans of {width}x{height} (at most "
                          f"{MAX_JPEG_SCANS}, and scans x pixels at most "
                          f"{MAX_JPEG_SCAN_PIXELS:.0e}): each scan is a pass over the image")
    return frame


def _png(data: bytes) -> tuple[int, int]:
    if len(data) < 33 or _be32(data, 8) != 13 or data[12:16] != b"IHDR":
        raise HeaderError("PNG: no 13-byte IHDR chunk first")
    width, height = _be32(data, 16), _be32(data, 20)
    depth, colour, interlaced = data[24], data[25], data[28]
    if not (0 < width < 2**31 and 0 < height < 2**31) or colour not in _PNG_CHANNELS or (
            depth not in (1, 2, 4, 8, 16)):
        raise HeaderError(f"PNG: IHDR of {width}x{height}, depth {depth}, colour {colour}")
    raw = height * (1 + -(-width * _PNG_CHANNELS[colour] * depth // 8))
    raw += 4 * height + 64 if interlaced else 0
    pos, chunks, compressed, in_idat = 33, 0, 0, False
    while pos + 8 <= len(data):
        size, kind = _be32(data, pos), data[pos + 4:pos + 8]
        if kind == b"IDAT":
            in_idat = True
            compressed += size
        elif in_idat or kind == b"IEND":
            break
        else:
            chunks += 1
            if kind == b"IHDR":
                raise HeaderError("PNG: a second IHDR")
            if chunks > MAX_SEGMENTS:
                raise HeaderError(f"PNG: more than {MAX_SEGMENTS} chunks before the image "
                                  "data")
        pos += 12 + size
    if compressed > raw * 1.25 + 4096:
        raise HeaderError(f"PNG: {compressed} bytes of image data for a {width}x{height} "
                          f"image of {raw} raw bytes (data a decoder inflates for nothing)")
    return width, height


def _gif_table(flags: int) -> int:
    return 3 << ((flags & 7) + 1) if flags & 0x80 else 0


def _gif(data: bytes) -> tuple[int, int]:
    if len(data) < 13:
        raise HeaderError("GIF: no logical screen descriptor", truncated=True)
    width, height = _le16(data, 6), _le16(data, 8)
    pos, blocks, start = 13 + _gif_table(data[10]), 0, 13 + _gif_table(data[10])
    while True:
        kind = data[pos:pos + 1]
        if kind == b",":
            x0, y0, w, h = (_le16(data, pos + k) for k in (1, 3, 5, 7))
            # PIL grows the image to hold the first frame where it lies
            return max(width, x0 + w), max(height, y0 + h)
        if kind != b"!":
            raise HeaderError("GIF: no image before " + (
                "the trailer" if kind == b";" else "the end" if not kind
                else f"an unknown block 0x{kind[0]:02X} (giflib refuses it)"),
                truncated=not kind)
        pos += 2
        while True:  # the extension's sub-blocks
            blocks += 1
            if blocks > MAX_SEGMENTS * 10 or pos - start > MAX_GIF_EXTENSIONS:
                raise HeaderError(f"GIF: more than {MAX_SEGMENTS * 10} sub-blocks or "
                                  f"{MAX_GIF_EXTENSIONS} bytes of extensions before the "
                                  "first image")
            if pos >= len(data):
                raise HeaderError("GIF: the file ends inside an extension", truncated=True)
            size = data[pos]
            pos += 1 + size
            if not size:
                break


def _bmp(data: bytes) -> tuple[int, int]:
    header = _le32(data, 14)
    if header not in BMP_HEADERS:
        raise HeaderError(f"BMP: a {header}-byte DIB header (read: "
                          f"{', '.join(map(str, BMP_HEADERS))})")
    if len(data) < 14 + header:
        raise HeaderError("BMP: the file ends inside its header", truncated=True)
    if header == 12:  # BITMAPCOREHEADER: unsigned 16-bit sizes
        width, height = _le16(data, 18), _le16(data, 20)
    else:
        width, height = _le32(data, 18), _le32(data, 22)
        width = width - 2**32 if width >= 2**31 else width
        height = height - 2**32 if height >= 2**31 else height
    if width <= 0 or height == 0 or height == -2**31:
        raise HeaderError(f"BMP: a size of {width}x{height}")
    return width, abs(height)


def _webp(data: bytes) -> tuple[int, int]:
    kind = data[12:16]
    if kind == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = _le16(data, 26) & 0x3FFF, _le16(data, 28) & 0x3FFF
    elif kind == b"VP8L" and data[20:21] == b"\x2f":
        bits = _le32(data, 21)
        width, height = 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    elif kind == b"VP8X":
        width, height = 1 + _le24(data, 24), 1 + _le24(data, 27)
    else:
        raise HeaderError(f"WebP: first chunk {kind!r} is not VP8, VP8L or VP8X")
    if not (width and height) or width * height >= 2**32:
        raise HeaderError(f"WebP: a size of {width}x{height}")
    return width, height
