"""Images whose headers lie about their size, crafted for the serving and job tests and
for ``tests/reliability/stress_images.py``.

Each :class:`Hostile` is real image bytes (made with PIL) with bytes patched or added,
plus the outcome expected through the serving signature and through a job:
``"refused"`` (an error naming the image, a dead letter with its reason) or
``"decoded"`` (within the pixel limit). ``big=True`` builds the ~1 MB variants (the
benchmark's inputs); the default keeps them small enough for the tests, except where
the point is the size (thousands of tiny segments).

The lies, per format:

* JPEG: frame headers (SOF) that are not the frame: inside APP1, COM, behind an
  ``FF 00`` stuffing pair, several of them; a quarter of a million tiny segments; stray,
  fill and stuffing bytes by the megabyte; segments whose length runs past the end;
  two frame headers; an EOI first; thousands of repeated scans (a CPU bomb of 40 KB).
* BMP: the 12-byte core header (valid and lying), header sizes no reader knows,
  zero and negative sizes, a top-down image.
* PNG: a 1 x 1 IHDR over a megabyte of IDAT that inflates to a gigabyte, a huge IHDR,
  two IHDRs, a short IHDR, an APNG frame larger than the image, 87 000 tiny chunks.
* GIF: a 1 x 1 screen around a 30000² frame, a huge second frame, 2000 frames, a
  megabyte of 1-byte sub-blocks or of comment, a frame far outside the screen, an
  unknown block.
* WebP: VP8 and VP8L bitstreams declaring 16383², a VP8X canvas smaller or larger than
  its bitstream, an animation frame larger than its canvas.
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image

HUGE = 20000  # 20000² = 400 MP: over the serving (40 MP) and job (100 MP) limits


@dataclass(frozen=True)
class Hostile:
    name: str
    data: bytes
    serving: str  # "refused" or "decoded"
    job: str      # "refused" or "decoded"


def encode(fmt, width=48, height=32, seed=0, frames=1, **save) -> bytes:
    """PIL's encoding of random RGB pixels (``frames`` > 1: an animation)."""
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
              for _ in range(frames)]
    buffer = io.BytesIO()
    if frames > 1:
        save.update(save_all=True, append_images=images[1:])
    images[0].save(buffer, format=fmt, **save)
    return buffer.getvalue()


# ------------------------------------------------------------------------------ JPEG

def segment(marker: int, payload: bytes) -> bytes:
    """A JPEG marker segment: FF, marker, big-endian length (2 + payload), payload."""
    return bytes([0xFF, marker]) + struct.pack(">H", 2 + len(payload)) + payload


def sof(width: int, height: int, marker: int = 0xC0) -> bytes:
    """A start-of-frame segment for a 3-component 8-bit frame."""
    return segment(marker, struct.pack(">BHHB", 8, height, width, 3)
                   + b"".join(bytes([i, 0x11, 0]) for i in (1, 2, 3)))


def jpeg_segments(data: bytes):
    """``[(start, end, marker)]`` of the segments before the first scan of a well-formed
    JPEG (PIL's output), then the position of its SOS."""
    out, pos = [], 2
    while data[pos + 1] != 0xDA:
        end = pos + 2 + struct.unpack(">H", data[pos + 2:pos + 4])[0]
        out.append((pos, end, data[pos + 1]))
        pos = end
    return out, pos


def with_frame(data: bytes, width: int, height: int) -> bytes:
    """``data`` with its frame header saying ``width x height`` (the scan is unchanged:
    libjpeg would decode the rest of a larger frame as grey)."""
    for start, _, marker in jpeg_segments(data)[0]:
        if marker in (0xC0, 0xC1, 0xC2):
            return data[:start + 5] + struct.pack(">HH", height, width) + data[start + 9:]
    raise ValueError("no frame header")


def without_frame(data: bytes) -> tuple[bytes, bytes]:
    """``(frame segment, data without it)``."""
    for start, end, marker in jpeg_segments(data)[0]:
        if marker in (0xC0, 0xC1, 0xC2):
            return data[start:end], data[:start] + data[end:]
    raise ValueError("no frame header")


def after_soi(data: bytes, inserted: bytes) -> bytes:
    return data[:2] + inserted + data[2:]


def repeated_scans(width: int, height: int, repeats: int) -> bytes:
    """A progressive JPEG of one colour whose last (14-byte) scan is repeated
    ``repeats`` times: libjpeg passes over the whole image once per scan."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (120, 60, 200)).save(buffer, "JPEG", progressive=True)
    data = buffer.getvalue()
    _, pos = jpeg_segments(data)
    scans = []  # each scan: its SOS, entropy-coded data, and the tables before the next
    while data[pos + 1] == 0xDA:
        q = pos + 2 + struct.unpack(">H", data[pos + 2:pos + 4])[0]
        while not (data[q] == 0xFF and data[q + 1] not in range(0xD0, 0xD8)
                   and data[q + 1] != 0):
            q += 1
        while data[q + 1] not in (0xDA, 0xD9):
            q += 2 + struct.unpack(">H", data[q + 2:q + 4])[0]
        scans.append(data[pos:q])
        pos = q
    return data[:pos] + scans[-1] * repeats + data[pos:]


def _jpeg_cases(big: bool):
    base = encode("JPEG")
    huge = with_frame(base, HUGE, HUGE)
    fake = sof(16, 16)
    tiny = 250_000 if big else 30_000
    cases = [
        Hostile("JPEG: 16x16 SOF inside APP1, real frame 20000x20000",
                after_soi(huge, segment(0xE1, b"Exif\0\0" + fake)), "refused", "refused"),
        Hostile("JPEG: 16x16 SOF inside COM, real frame 20000x20000",
                after_soi(huge, segment(0xFE, fake)), "refused", "refused"),
        Hostile("JPEG: SOFs inside APP1, APP2 and COM, real frame 20000x20000",
                after_soi(huge, segment(0xE1, fake) + segment(0xE2, fake + fake)
                          + segment(0xFE, b"x" + fake)), "refused", "refused"),
        Hostile("JPEG: FF 00 stuffing, then the real 20000x20000 frame",
                _after_stuffing(base), "refused", "refused"),
        Hostile(f"JPEG: {tiny} 4-byte APP0 segments before a 48x32 frame",
                after_soi(base, b"\xff\xe0\x00\x02" * tiny), "decoded", "refused"),
        Hostile(f"JPEG: {tiny} 4-byte COM segments before a 20000x20000 frame",
                after_soi(huge, b"\xff\xfe\x00\x02" * tiny), "refused", "refused"),
        Hostile("JPEG: APP1 whose length runs past the end of the file",
                base[:2] + b"\xff\xe1\xff\xf0" + b"\0" * 200, "refused", "refused"),
        Hostile("JPEG: zero- and one-byte segment lengths",
                after_soi(base, b"\xff\xe3\x00\x00\xff\xfe\x00\x01"), "decoded", "decoded"),
        Hostile("JPEG: 1 MB of stray bytes between segments",
                base[:2] + b"\xff\x00" + b"\x11" * (1 << 20) + base[2:], "decoded", "refused"),
        Hostile("JPEG: 1 MB of FF fill bytes", after_soi(base, b"\xff" * (1 << 20)),
                "decoded", "refused"),
        Hostile("JPEG: 500000 FF 00 stuffing pairs", after_soi(base, b"\xff\x00" * 500_000),
                "decoded", "refused"),
        Hostile("JPEG: EOI before the frame header", after_soi(base, b"\xff\xd9"),
                "refused", "refused"),
        Hostile("JPEG: a 20000x20000 frame, EOI, then a 48x32 image",
                b"\xff\xd8" + sof(HUGE, HUGE) + b"\xff\xd9" + base, "refused", "refused"),
        Hostile("JPEG: a second frame header of 20000x20000",
                _second_frame(base), "refused", "refused"),
        Hostile("JPEG: frame header of 0x0", with_frame(base, 0, 0), "refused", "refused"),
        Hostile("JPEG: lossless (SOF3) frame of 20000x20000",
                _sof_marker(huge, 0xC3), "refused", "refused"),
        Hostile("JPEG: 200x200, 2000 repeated scans" if not big
                else "JPEG: 200x200, 70000 repeated scans",
                repeated_scans(200, 200, 70_000 if big else 2000), "refused", "refused"),
    ]
    return cases


def _after_stuffing(base: bytes) -> bytes:
    # libjpeg skips the FF 00 pair and takes the FF C0 after it as the frame. A walker
    # that takes FF 00 for a segment jumps by the "length" FF C0 (65472 bytes) and lands
    # on a 16x16 frame header inside the COM segment that follows.
    frame, rest = without_frame(with_frame(base, HUGE, HUGE))
    head = b"\xff\xd8\xff\x00" + frame
    landing = 2 + 2 + 0xFFC0
    pad = landing - (len(head) + 4)
    com = segment(0xFE, b"\0" * pad + sof(16, 16) + b"\0" * 16)
    return head + com + rest[2:]


def _second_frame(base: bytes) -> bytes:
    segments, _ = jpeg_segments(base)
    end = next(e for _, e, marker in segments if marker == 0xC0)
    return base[:end] + sof(HUGE, HUGE) + base[end:]


def _sof_marker(data: bytes, marker: int) -> bytes:
    start = next(s for s, _, m in jpeg_segments(data)[0] if m == 0xC0)
    return data[:start + 1] + bytes([marker]) + data[start + 2:]


# ------------------------------------------------------------------------------- BMP

def bmp(width: int, height: int, header: int = 40, bits: int = 24,
        pixels: bytes | None = None) -> bytes:
    """A BMP with a ``header``-byte DIB header (12: BITMAPCOREHEADER, 16-bit sizes)."""
    row = (abs(width) * bits // 8 + 3) // 4 * 4 if width > 0 else 0
    if pixels is None:
        pixels = bytes(range(256)) * (row * abs(height) // 256 + 1)
        pixels = pixels[:row * abs(height)] if row * abs(height) < 1 << 20 else b"\0" * 64
    if header == 12:
        dib = struct.pack("<IHHHH", 12, width & 0xFFFF, height & 0xFFFF, 1, bits)
    else:
        dib = struct.pack("<IiiHHIIiiII", 40, width, height, 1, bits, 0, len(pixels),
                          2835, 2835, 0, 0)
        dib = struct.pack("<I", header) + dib[4:] + b"\0" * max(0, header - 40)
    offset = 14 + len(dib)
    return b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset) + dib + pixels


def _bmp_cases(big: bool):
    cases = [
        Hostile("BMP: 12-byte core header, 7x5", bmp(7, 5, 12), "refused", "decoded"),
        Hostile("BMP: 12-byte core header declaring 65535x65535",
                bmp(65535, 65535, 12, pixels=b"\0" * 64), "refused", "refused"),
        Hostile("BMP: 40-byte header declaring 50000x50000",
                bmp(50000, 50000, pixels=b"\0" * 64), "refused", "refused"),
        Hostile("BMP: top-down (height -5)", bmp(7, -5), "decoded", "decoded"),
        Hostile("BMP: 124-byte (V5) header, 7x5", bmp(7, 5, 124), "decoded", "decoded"),
    ]
    for size in (16, 20, 100, 0, 2**31 + 40):
        data = bmp(7, 5)
        cases.append(Hostile(f"BMP: {size}-byte DIB header",
                             data[:14] + struct.pack("<I", size) + data[18:],
                             "refused", "refused"))
    for width, height in ((0, 5), (7, 0), (-5, 5), (7, -2**31)):
        data = bmp(7, 5)
        cases.append(Hostile(f"BMP: size {width}x{height}",
                             data[:18] + struct.pack("<ii", width, height) + data[26:],
                             "refused", "refused"))
    return cases


# ------------------------------------------------------------------------------- PNG

def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def ihdr(width: int, height: int, depth: int = 8, colour: int = 0) -> bytes:
    return chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0))


def png(*chunks: bytes) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks) + chunk(b"IEND", b"")


def zeros_deflated(total: int) -> bytes:
    """A zlib stream of ``total`` zero bytes (~1/1000 of that compressed)."""
    packer, block = zlib.compressobj(9), b"\0" * min(total, 1 << 24)
    out = [packer.compress(block) for _ in range(max(1, total // len(block)))]
    return b"".join(out) + packer.flush()


def _png_cases(big: bool):
    real = encode("PNG", 32, 32)
    chunks = real[8:-12]  # IHDR ... IDAT, without IEND
    row = b"\0" * 10001
    packer = zlib.compressobj(9)
    rows = b"".join(packer.compress(row) for _ in range(10000)) + packer.flush()
    frame = struct.pack(">IIIIIHHBB", 1, HUGE, HUGE, 0, 0, 1, 10, 0, 0)
    apng = png(chunks[:25], chunk(b"acTL", struct.pack(">II", 2, 0)),
               chunk(b"fcTL", struct.pack(">IIIIIHHBB", 0, 32, 32, 0, 0, 1, 10, 0, 0)),
               chunks[25:], chunk(b"fcTL", frame),
               chunk(b"fdAT", struct.pack(">I", 2) + zlib.compress(b"\0" * 1000)))
    tiny = 87_000 if big else 20_000
    return [
        Hostile("PNG: IHDR 1x1 over an IDAT inflating to " + ("1 GB" if big else "64 MB"),
                png(ihdr(1, 1), chunk(b"IDAT", zeros_deflated((1 << 30) if big else 1 << 26))),
                "refused", "refused"),
        Hostile("PNG: IHDR of (2^31-1)x(2^31-1)",
                png(ihdr(2**31 - 1, 2**31 - 1), chunk(b"IDAT", zlib.compress(b"\0" * 64))),
                "refused", "refused"),
        Hostile("PNG: 10000x10000 of real rows in 97 KB",
                png(ihdr(10000, 10000), chunk(b"IDAT", rows)), "refused", "refused"),
        Hostile("PNG: two IHDRs, 1x1 then 30000x30000",
                png(ihdr(1, 1), ihdr(30000, 30000), chunk(b"IDAT", zlib.compress(b"\0\0"))),
                "refused", "refused"),
        Hostile("PNG: 12-byte IHDR", png(chunk(b"IHDR", struct.pack(">IIBBBB", 1, 1, 8, 0, 0, 0)),
                                         chunk(b"IDAT", zlib.compress(b"\0\0"))),
                "refused", "refused"),
        Hostile("APNG: 32x32 image with a 20000x20000 frame", apng, "decoded", "decoded"),
        Hostile(f"PNG: {tiny} tEXt chunks before the image data",
                png(chunks[:25], chunk(b"tEXt", b"a\0") * tiny, chunks[25:]), "decoded",
                "refused"),
    ]


# ------------------------------------------------------------------------------- GIF

def gif_frame(width: int, height: int, left: int = 0, top: int = 0,
              pixels: int | None = None) -> bytes:
    """An image descriptor (no local colour table) with LZW data for ``pixels`` zeros
    (default: the whole frame; fewer leaves the frame short, which giflib refuses)."""
    pixels = width * height if pixels is None else pixels
    # 2-bit codes: clear (4), then literal 0 repeated, then end (5); at 9 bits a code
    # the table fills, so keep to clear + literals, re-clearing every 2 codes.
    bits = []
    for _ in range(pixels):
        bits.append((4, 3))
        bits.append((0, 3))
    bits.append((5, 3))
    value = length = 0
    out = bytearray()
    for code, size in bits:
        value |= code << length
        length += size
        while length >= 8:
            out.append(value & 0xFF)
            value >>= 8
            length -= 8
    if length:
        out.append(value & 0xFF)
    blocks = b"".join(bytes([len(out[i:i + 255])]) + bytes(out[i:i + 255])
                      for i in range(0, len(out), 255))
    return (b"," + struct.pack("<HHHHB", left, top, width, height, 0) + b"\x02" + blocks
            + b"\0")


def gif(width: int, height: int, *blocks: bytes) -> bytes:
    """A GIF89a with a 2-colour global table, the given blocks, and the trailer."""
    return (b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff"
            + b"".join(blocks) + b";")


def _gif_cases(big: bool):
    small = gif_frame(4, 4)
    many = 2000
    sub_blocks = (1 << 20) // 2 if big else 200_000
    frames = 70_000 if big else 5_000
    return [
        Hostile("GIF: screen 1x1, frame 30000x30000",
                gif(1, 1, gif_frame(30000, 30000, pixels=16)), "refused", "refused"),
        Hostile("GIF: 4x4 frame, then a 30000x30000 frame",
                gif(4, 4, small, gif_frame(30000, 30000, pixels=16)), "refused", "decoded"),
        Hostile(f"GIF: {many} frames of 200x200 (80 MP in all)",
                gif(200, 200, gif_frame(200, 200), *[gif_frame(200, 200, pixels=0)] * many),
                "refused", "decoded"),
        Hostile(f"GIF: {sub_blocks} 1-byte sub-blocks before a 4x4 frame",
                gif(4, 4, b"!\xfe" + b"\x01x" * sub_blocks + b"\0", small), "decoded",
                "refused"),
        Hostile("GIF: a 1.1 MB comment before a 4x4 frame",
                gif(4, 4, b"!\xfe" + (b"\xff" + b"c" * 255) * 4400 + b"\0", small), "decoded",
                "refused"),
        Hostile("GIF: 1x1 frame at (60000, 60000) of a 4x4 screen",
                gif(4, 4, gif_frame(1, 1, 60000, 60000)), "decoded", "refused"),
        Hostile("GIF: unknown block 0x99 before the frame", gif(4, 4, b"\x99", small),
                "refused", "refused"),
        Hostile(f"GIF: {frames} 1x1 frames", gif(1, 1, *[gif_frame(1, 1)] * frames),
                "decoded", "decoded"),
    ]


# ------------------------------------------------------------------------------ WebP

def riff(*chunks: bytes) -> bytes:
    body = b"WEBP" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def webp_chunk(kind: bytes, data: bytes) -> bytes:
    return kind + struct.pack("<I", len(data)) + data + b"\0" * (len(data) % 2)


def webp_first_chunk(data: bytes) -> tuple[bytes, bytes]:
    size = struct.unpack("<I", data[16:20])[0]
    return data[12:16], data[20:20 + size]


def vp8x(width: int, height: int, flags: int = 0) -> bytes:
    return webp_chunk(b"VP8X", bytes([flags, 0, 0, 0]) + (width - 1).to_bytes(3, "little")
                      + (height - 1).to_bytes(3, "little"))


def _webp_cases(big: bool):
    lossy = encode("WEBP", 64, 48)
    lossless = encode("WEBP", 64, 48, lossless=True)
    kind, payload = webp_first_chunk(lossy)
    assert kind == b"VP8 "
    vp8_huge = riff(webp_chunk(b"VP8 ", payload[:6] + struct.pack("<HH", 16383, 16383)
                               + payload[10:]))
    kind, lossless_payload = webp_first_chunk(lossless)
    assert kind == b"VP8L"
    bits = (16383) | (16383 << 14)
    vp8l_huge = riff(webp_chunk(b"VP8L", lossless_payload[:1] + struct.pack("<I", bits)[:4]
                                + lossless_payload[5:]))
    frame = struct.pack("<I", 0)[:3] * 2 + (HUGE - 1).to_bytes(3, "little") * 2 + b"\0\0\0\0"
    animated = riff(vp8x(64, 48, flags=0x02), webp_chunk(b"ANIM", b"\0" * 6),
                    webp_chunk(b"ANMF", frame + webp_chunk(b"VP8 ", payload)))
    return [
        Hostile("WebP: VP8 bitstream declaring 16383x16383", vp8_huge, "refused", "refused"),
        Hostile("WebP: VP8L bitstream declaring 16384x16384", vp8l_huge, "refused",
                "refused"),
        Hostile("WebP: VP8X canvas 1x1 around a 64x48 bitstream",
                riff(vp8x(1, 1), webp_chunk(b"VP8 ", payload)), "refused", "refused"),
        Hostile("WebP: VP8X canvas 16777216x256 around a 64x48 bitstream",
                riff(vp8x(1 << 24, 256), webp_chunk(b"VP8 ", payload)), "refused", "refused"),
        Hostile("WebP: animation frame of 20000x20000 on a 64x48 canvas", animated,
                "refused", "decoded"),
        Hostile("WebP: VP8X around a 64x48 bitstream (valid)",
                riff(vp8x(64, 48), webp_chunk(b"VP8 ", payload)), "decoded", "decoded"),
    ]


def cases(big: bool = False) -> list[Hostile]:
    """Every crafted input; ``big``: the ~1 MB variants."""
    return (_jpeg_cases(big) + _bmp_cases(big) + _png_cases(big) + _gif_cases(big)
            + _webp_cases(big))
