"""The pixel count an encoded image declares, read from its header with TF ops.

A small file can declare a huge image (a 285 KB PNG of 10000 x 10000 costs 1.3 GB
decoded), so the serving graph reads the declared size *before* decoding and refuses
images over ``max_pixels``; :func:`tfaploss.export.image_ops.decode_images` checks the
decoded sizes again. Formats are recognised by ``DecodeImage``'s magic bytes, and each
header is read the way TensorFlow's decoder reads it (each format's walk below says
how), so a header cannot show this walk one size and the decoder another (as
:mod:`tfaploss.pipelines.image_headers`; docs/reliability.md, "Image headers that lie").

Cost: linear in the file's size: candidate positions are selected with vector ops and
chains followed by pointer doubling (``ceil(log2(chain))`` gathers), so 250 000 tiny
segments cost what their bytes cost (at most 0.2 s for the worst 1 MB input).
"""

from __future__ import annotations

import tensorflow as tf

UNRECOGNISED = 0.0  # not an image format DecodeImage knows: the decoder reports it
UNREADABLE = -1.0  # a known format whose size could not be read: refused as undecodable

MAX_JPEG_SCANS = 100  # libjpeg's default progression has 10 scans; encoders stay below 32
MAX_JPEG_SCAN_PIXELS = 1e9  # scans x pixels: 25 scans of 40 MP (10 take 0.4 s, 50 take 2 s)

_PAD = 32


class _Bytes:
    """Random access to the bytes of one scalar string tensor, zero past its end."""

    def __init__(self, data):
        self.n = tf.cast(tf.strings.length(data), tf.int64)
        padded = tf.strings.join([data, tf.constant(b"\0" * _PAD)])
        self.raw = tf.io.decode_raw(padded, tf.uint8)  # n + _PAD bytes
        self.last = self.n + _PAD - 1

    def at(self, i):
        i = tf.clip_by_value(tf.cast(i, tf.int64), 0, self.last)
        return tf.cast(tf.gather(self.raw, i), tf.int64)

    def be16(self, i):
        return self.at(i) * 256 + self.at(i + 1)

    def le16(self, i):
        return self.at(i) + self.at(i + 1) * 256

    def be32(self, i):
        return self.be16(i) * 65536 + self.be16(i + 2)

    def le24(self, i):
        return self.le16(i) + self.at(i + 2) * 65536

    def le32(self, i):
        return self.le16(i) + self.le16(i + 2) * 65536

    def starts_with(self, offset: int, magic: bytes):
        return tf.reduce_all([tf.equal(self.at(offset + k), c) for k, c in enumerate(magic)])

    def shifted(self, k: int):
        """The bytes (uint8) of positions ``k .. k + n - 1``: ``shifted(k)[p] = b[p + k]``."""
        return self.raw[k:k + self.n]


def _f(value):
    return tf.constant(value, tf.float64)


def _area(width, height):
    # float64: two 32-bit sides overflow int64; the count only needs comparing.
    return tf.cast(width, tf.float64) * tf.cast(height, tf.float64)


def _follow(nxt, value=None):
    """Follow every chain ``i -> nxt[i] -> ...`` (int32, forward; fixed points end the
    chains) by pointer doubling: where each ends and, with ``value`` (float64, 0 at the
    fixed points), the sum of ``value`` over its nodes. Cost: ``len(nxt) *
    ceil(log2(longest chain))`` gathers.
    """
    bound = tf.cast(tf.math.ceil(tf.math.log(tf.cast(tf.size(nxt), tf.float64) + 2) / 0.69),
                    tf.int32) + 1
    state = (nxt,) if value is None else (nxt, value)

    def jump(k, moved, j, *sums):
        jj = tf.gather(j, j)
        sums = [s + tf.gather(s, j) for s in sums]  # none without a value
        return (k + 1, tf.reduce_any(tf.not_equal(jj, j)), jj, *sums)

    _, _, j, *sums = tf.while_loop(lambda k, moved, *_: moved & (k < bound), jump,
                                   (tf.constant(0), tf.constant(True), *state))
    return j, (sums[0] if sums else None)


def _in(x, values):
    return tf.reduce_any(tf.stack([tf.equal(x, v) for v in values]), axis=0)


def _between(x, low, high):
    return (x >= low) & (x <= high)


def _index_of(sorted_positions, targets):
    """The index of each target in ``sorted_positions`` (int32), or ``len`` if absent."""
    count = tf.size(sorted_positions, out_type=tf.int32)
    i = tf.searchsorted(sorted_positions, targets, side="left", out_type=tf.int32)
    there = tf.gather(tf.concat([sorted_positions, [-1]], 0), i)
    return tf.where(tf.equal(there, targets), i, count)


def _jpeg(b: _Bytes):
    """The first start-of-frame, walking the segments as libjpeg's ``next_marker`` does
    (a frame header inside an EXIF thumbnail or a comment does not count)."""
    # A marker is the byte after an FF (at position j >= 3: libjpeg reads SOI at 0-1 and
    # looks for the next marker from 2 on) that is neither FF (fill), 00 (stuffing) nor
    # a marker without a length (RSTn, TEM), which libjpeg passes over. From a marker
    # at j, libjpeg looks for the next one from the end of its segment, j + 1 + length;
    # the first marker there is the first candidate >= j + 2 + length.
    where = tf.where(tf.equal(b.shifted(0), 0xFF))[:, 0] + 1
    marker = tf.gather(b.raw, where)
    skipped = _in(marker, (0x00, 0xFF, 0x01)) | _between(marker, 0xD0, 0xD7)
    keep = ~skipped & (where >= 3) & (where < b.n)
    where, marker = tf.boolean_mask(where, keep), tf.boolean_mask(marker, keep)
    length = tf.maximum(b.be16(where + 1), 2)  # libjpeg skips nothing for a length < 2
    segment = (_between(marker, 0xE0, 0xEF)  # APPn
               | _in(marker, (0xFE, 0xC4, 0xCC, 0xDB, 0xDC, 0xDD)))  # COM DHT DAC DQT DNL DRI
    frame = _between(marker, 0xC0, 0xCF) & ~_in(marker, (0xC4, 0xC8, 0xCC))
    count = tf.size(where, out_type=tf.int32)
    following = tf.searchsorted(where, where + 2 + length, side="left", out_type=tf.int32)
    # Anything else ends the walk: SOFn (found), SOS/EOI/SOI/unknown (libjpeg refuses).
    nxt = tf.concat([tf.where(segment, following, tf.range(count)), [count]], 0)
    end = _follow(nxt)[0][0]
    at = tf.gather(tf.concat([where, [0]], 0), end)
    found = tf.gather(tf.concat([frame, [False]], 0), end)
    height, width = b.be16(at + 4), b.be16(at + 6)
    pixels = _area(width, height)
    # libjpeg passes over the image once per scan (1000 repeated scans in 40 KB cost
    # ~10 s). Every FF DA pair is a scan (entropy-coded data stuffs its FF bytes), or a
    # scan of an embedded thumbnail: counting them all errs on the side of refusing.
    scans = tf.reduce_sum(tf.cast(tf.equal(marker, 0xDA), tf.float64))
    ok = (found & (width > 0) & (height > 0) & (scans <= MAX_JPEG_SCANS)
          & (scans * pixels <= MAX_JPEG_SCAN_PIXELS))
    return tf.where(ok, pixels, _f(UNREADABLE))


def _png(b: _Bytes):
    """The ``IHDR``, and ``IDAT`` data no larger than the raw image it must inflate to
    (a 1 MB ``IDAT`` behind a 1 x 1 ``IHDR`` cost ~6 s)."""
    width, height = b.be32(16), b.be32(20)
    depth, colour, interlaced = b.at(24), b.at(25), b.at(28)
    channels = tf.gather(tf.constant([1, 0, 3, 1, 2, 0, 4], tf.int64),
                         tf.clip_by_value(colour, 0, 6))
    ok = (b.starts_with(12, b"IHDR") & tf.equal(b.be32(8), 13) & (b.n >= 33)
          & (width > 0) & (height > 0) & (colour <= 6) & (channels > 0)
          & _in(depth, (1, 2, 4, 8, 16)))
    # The raw image libpng inflates: a filter byte per row, rows rounded up to a byte;
    # interlacing adds at most a filter byte and a rounding byte per row of each pass.
    rows = _area(height, 1)
    raw = rows * (1 + tf.math.ceil(_area(width, channels * depth) / 8))
    raw += tf.where(interlaced > 0, 4 * rows + 64, _f(0))
    # Chunks: length (4), type (4 ASCII letters), data, CRC (4). Candidates are the
    # positions followed by four letters; the chain starts at IHDR (8) and ends at IEND
    # or where no chunk follows (libpng stops there, with an error).
    c = b.raw
    letter = _between(c, 65, 90) | _between(c, 97, 122)
    name = letter[4:4 + b.n] & letter[5:5 + b.n] & letter[6:6 + b.n] & letter[7:7 + b.n]
    where = tf.where(name)[:, 0]
    count = tf.size(where, out_type=tf.int32)
    kind, size = b.be32(where + 4), b.be32(where)
    following = _index_of(where, where + 12 + size)
    goes_on = (following < count) & ~tf.equal(kind, int.from_bytes(b"IEND", "big"))
    nxt = tf.concat([tf.where(goes_on, following, tf.range(count)), [count]], 0)
    idat = tf.where(goes_on & tf.equal(kind, int.from_bytes(b"IDAT", "big")),
                    tf.cast(size, tf.float64), _f(0))
    _, compressed = _follow(nxt, tf.concat([idat, [0.0]], 0))
    compressed = compressed[_index_of(where, tf.constant([8], tf.int64))[0]]
    # Deflate stores incompressible data with 5 bytes per 64 KiB block, and a sane
    # encoder's Huffman blocks expand it by at most 1/8: more is padding for libpng to
    # inflate (up to ~1000x its size), not image.
    ok &= compressed <= raw * 1.25 + 4096
    return tf.where(ok, _area(width, height), _f(UNREADABLE))


def _color_table(flags):
    flags = tf.cast(flags, tf.int64)
    return tf.where(flags >= 128, 6 * tf.bitwise.left_shift(tf.ones_like(flags), flags % 8),
                    tf.zeros_like(flags))


def _gif(b: _Bytes):
    """The screen plus every frame's descriptor (giflib allocates every frame, and
    TensorFlow sizes its output by the largest)."""
    canvas = _area(b.le16(6), b.le16(8))
    first = 13 + _color_table(b.at(10))
    n32 = tf.cast(b.n, tf.int32)
    # 1. Sub-block chains: from a size byte s at q the chain goes on at q + 1 + s, and a
    #    size 0 ends it. For every position, where the 0 that ends its chain is (n when
    #    the file ends first).
    size = tf.cast(b.shifted(0), tf.int32)
    positions = tf.range(n32)
    step = tf.where(tf.equal(size, 0), positions, tf.minimum(positions + 1 + size, n32))
    chain_end = _follow(tf.concat([step, [n32]], 0))[0]
    # 2. Blocks: 0x21 extension (label, then a chain), 0x2C image (9 bytes, colour table,
    #    LZW code size, then a chain); anything else (the 0x3B trailer) ends the walk, as
    #    giflib stops or refuses there. Candidates: the positions holding 0x21 or 0x2C.
    kinds = b.shifted(0)
    where = tf.where((tf.equal(kinds, 0x21) | tf.equal(kinds, 0x2C))
                     & (tf.range(b.n) >= first))[:, 0]
    count = tf.size(where, out_type=tf.int32)
    image = tf.equal(tf.gather(kinds, where), 0x2C)
    data = tf.where(image, where + 11 + _color_table(b.at(where + 9)), where + 2)
    after = tf.gather(chain_end, tf.cast(tf.minimum(data, b.n), tf.int32)) + 1
    following = _index_of(where, tf.cast(after, tf.int64))
    goes_on = following < count
    nxt = tf.concat([tf.where(goes_on, following, tf.range(count)), [count]], 0)
    area = tf.where(image, _area(b.le16(where + 5), b.le16(where + 7)), _f(0))
    ends, frames = _follow(nxt, tf.concat([tf.where(goes_on, area, _f(0)), [0.0]], 0))
    start = _index_of(where, tf.reshape(first, [1]))[0]
    # The block that ends the walk counts too: the last frame before the trailer, or a
    # frame whose data runs past the end, which giflib allocates before it fails.
    total = frames[start] + tf.concat([area, [0.0]], 0)[ends[start]]
    return canvas + total


def _bmp(b: _Bytes):
    """Only the header sizes that put a signed 32-bit width and height at bytes 18 and
    22, where TensorFlow reads them whatever the header."""
    def signed32(v):
        return tf.where(v >= 2**31, v - 2**32, v)

    header = b.le32(14)
    width, height = signed32(b.le32(18)), signed32(b.le32(22))
    ok = (_in(header, (40, 52, 56, 64, 108, 124)) & (b.n >= 14 + header)
          & (width > 0) & tf.not_equal(height, 0))
    return tf.where(ok, _area(width, tf.abs(height)), _f(UNREADABLE))


def _webp(b: _Bytes):
    # The canvas of the first chunk (at 12, its data at 20): VP8, VP8L or VP8X.
    vp8 = b.starts_with(12, b"VP8 ") & b.starts_with(23, b"\x9d\x01\x2a")
    vp8l = b.starts_with(12, b"VP8L") & tf.equal(b.at(20), 0x2F)
    vp8x = b.starts_with(12, b"VP8X")
    lossy = _area(b.le16(26) % 16384, b.le16(28) % 16384)
    b1, b2, b3 = b.at(22), b.at(23), b.at(24)
    lossless = _area(1 + b.at(21) + (b1 % 64) * 256, 1 + b1 // 64 + b2 * 4 + (b3 % 16) * 1024)
    canvas = _area(1 + b.le24(24), 1 + b.le24(27))
    pixels = tf.where(vp8, lossy, tf.where(vp8l, lossless, tf.where(vp8x, canvas,
                                                                     _f(UNREADABLE))))
    # libwebp refuses a canvas of 2^32 pixels or more, and a lossy frame of size 0.
    return tf.where((pixels > 0) & (pixels < 2.0**32), pixels, _f(UNREADABLE))


def declared_pixels(data):
    """Pixels the encoded image ``data`` (a scalar string) declares, as float64.

    ``UNRECOGNISED`` (0) when the bytes are not JPEG, PNG, GIF, BMP or WebP (the
    decoder will refuse them), ``UNREADABLE`` (-1) for a recognised format whose size
    could not be read or whose structure is refused (see the module docstring). No
    pixel data is decoded.
    """
    b = _Bytes(data)
    branches = [
        (b.starts_with(0, b"\x89PNG\r\n\x1a\n"), lambda: _png(b)),
        (b.starts_with(0, b"\xff\xd8\xff"), lambda: _jpeg(b)),
        (b.starts_with(0, b"GIF"), lambda: _gif(b)),
        (b.starts_with(0, b"BM"), lambda: _bmp(b)),
        (b.starts_with(0, b"RIFF") & b.starts_with(8, b"WEBP"), lambda: _webp(b)),
    ]
    return tf.case(branches, default=lambda: tf.constant(UNRECOGNISED, tf.float64),
                   exclusive=False)
