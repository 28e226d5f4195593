"""Fuzz: the SavedModel's ``serving_default`` signature on mutated image bytes.

One tiny export per module (16 x 16 images, a pooling model, ``max_pixels`` = 2^20 so
that what the headers declare stays cheap to decode), and seeds made by PIL in every
format the signature takes: JPEG (baseline and progressive), PNG, GIF, BMP, WebP (lossy
and lossless). Each case mutates one seed:

* a size field of its header (PNG's IHDR, JPEG's frame header, GIF's screen and first
  frame, BMP's width and height, WebP's VP8 / VP8L / VP8X sizes) set to 0, 1, a power
  of two minus one up to the field's width, or any value the field holds;
* the file cut short, bits flipped, bytes inserted or deleted, or the header of one
  seed glued to the body of another.

Sent alone or after a good image in one request, each mutated file is either embedded
(finite embeddings, one per image) or refused with ONE ``InvalidArgumentError`` from the
signature's own checks, which names the mutated image's index (1 when it follows the
good one; never the good one) or the request's total; never another exception, a
crash or a hang. Each case is bounded in time and in the memory it adds to the process.
"""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz import harness
from tests.fuzz.profiles import examples
from tests.reliability.hostile_images import encode
from tests.support.timing import speed_factor

tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.tensorflow

SIZE = (16, 16)
MAX_PIXELS = 1 << 20
SOFT_S = 5.0  # a case: ~10-50 ms on an idle core; a 1 MP decode ~0.1 s
# A 1 MP image decodes to 3 MB (uint8) and 12 MB (float32) per copy; the request
# allows 4 MP. Anything near this bound decoded past the budget.
RSS_MB = 256.0
_SPEED = speed_factor()


def _seeds() -> dict[str, bytes]:
    return {"JPEG": encode("JPEG", 24, 16), "JPEG progressive": encode(
        "JPEG", 24, 16, seed=1, progressive=True), "PNG": encode("PNG", 24, 16, seed=2),
        "GIF": encode("GIF", 24, 16, seed=3), "BMP": encode("BMP", 24, 16, seed=4),
        "WebP": encode("WEBP", 24, 16, seed=5),
        "WebP lossless": encode("WEBP", 24, 16, seed=6, lossless=True)}


SEEDS = _seeds()


def _jpeg_frame(data: bytes) -> int:
    pos = 2
    while data[pos + 1] not in (0xC0, 0xC1, 0xC2):
        pos += 2 + struct.unpack(">H", data[pos + 2:pos + 4])[0]
    return pos


def _gif_frame(data: bytes) -> int:
    pos = 13 + (6 << (data[10] & 7) if data[10] & 0x80 else 0)
    while data[pos] == 0x21:  # extensions: label, then sub-blocks up to a 0
        pos += 2
        while data[pos]:
            pos += data[pos] + 1
        pos += 1
    assert data[pos] == 0x2C
    return pos


def size_fields(name: str, data: bytes) -> list[tuple[int, int, str]]:
    """``(offset, bytes, byte order)`` of the size fields of a seed's header."""
    if name.startswith("JPEG"):
        frame = _jpeg_frame(data)
        return [(frame + 5, 2, "big"), (frame + 7, 2, "big")]
    if name == "PNG":
        return [(16, 4, "big"), (20, 4, "big")]
    if name == "GIF":
        frame = _gif_frame(data)
        return [(6, 2, "little"), (8, 2, "little"), (frame + 5, 2, "little"),
                (frame + 7, 2, "little"), (frame + 1, 2, "little"), (frame + 3, 2, "little")]
    if name == "BMP":
        return [(14, 4, "little"), (18, 4, "little"), (22, 4, "little")]
    if name == "WebP":  # VP8: 14-bit sizes (2 bits of scale) after the start code
        return [(4, 4, "little"), (16, 4, "little"), (26, 2, "little"), (28, 2, "little")]
    return [(4, 4, "little"), (16, 4, "little"), (21, 4, "little")]  # VP8L: packed bits


@st.composite
def mutated(draw, name: str):
    """``(bytes, what was done)``: one mutation of the seed ``name`` (module docstring)."""
    data = SEEDS[name]
    kind = draw(st.sampled_from(["size", "size", "cut", "flip", "insert", "delete",
                                 "splice"]))
    b = bytearray(data)
    if kind == "size":
        offset, width, order = draw(st.sampled_from(size_fields(name, data)))
        value = draw(st.sampled_from([0, 1, 2, 17] + [2 ** k - 1 for k in range(
            8, 8 * width + 1, 4)]) | st.integers(0, 2 ** (8 * width) - 1))
        b[offset:offset + width] = value.to_bytes(width, order)
        return bytes(b), f"{name}: field at {offset} = {value}"
    if kind == "cut":
        at = draw(st.integers(0, len(b) - 1))
        return bytes(b[:at]), f"{name}: cut at {at} of {len(b)}"
    if kind == "flip":
        spots = draw(st.lists(st.tuples(st.integers(0, len(b) - 1), st.integers(0, 7)),
                              min_size=1, max_size=8))
        for at, bit in spots:
            b[at] ^= 1 << bit
        return bytes(b), f"{name}: {len(spots)} bit(s) flipped from byte {spots[0][0]}"
    if kind == "insert":
        at = draw(st.integers(0, len(b)))
        extra = draw(st.binary(min_size=1, max_size=64) | st.sampled_from(
            [b"\xff" * 64, b"\xff\xd8", b"\xff\xda\x00\x02", b"\x00" * 64, b"IDAT", b"\x21\xff"]))
        return bytes(b[:at]) + extra + bytes(b[at:]), f"{name}: {len(extra)} bytes at {at}"
    if kind == "delete":
        at = draw(st.integers(0, len(b) - 1))
        n = draw(st.integers(1, 64))
        return bytes(b[:at] + b[at + n:]), f"{name}: {n} bytes deleted at {at}"
    other = draw(st.sampled_from(sorted(SEEDS)))
    cut = draw(st.integers(0, min(len(b), len(SEEDS[other])) - 1))
    return bytes(b[:cut]) + SEEDS[other][cut:], f"{name}: header to {cut}, then {other}"


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    import keras

    from tfaploss.export import export_saved_model

    model = keras.Sequential([keras.Input((*SIZE, 3)), keras.layers.GlobalAveragePooling2D()])
    version = export_saved_model(model, tmp_path_factory.mktemp("export") / "m",
                                 image_size=SIZE, max_pixels=MAX_PIXELS)
    fn = tf.saved_model.load(version).signatures["serving_default"]
    for data in SEEDS.values():  # trace and warm every branch the seeds reach
        assert fn(image_bytes=tf.constant([data]))["embedding"].shape == (1, 3)
    return fn


@pytest.mark.parametrize("name", sorted(SEEDS))
@settings(max_examples=examples("serving"))
@given(data=st.data())
def test_mutated_image_bytes_embed_or_are_refused(serve, name, data):
    payload, what = data.draw(mutated(name))
    after_good = data.draw(st.booleans())
    request = [SEEDS["PNG"], payload] if after_good else [payload]
    with harness.case("serving", soft_s=SOFT_S * _SPEED, rss_mb=RSS_MB,
                      label=what + (" (after a good image)" if after_good else "")) as case:
        try:
            out = serve(image_bytes=tf.constant(request))["embedding"].numpy()
        except tf.errors.InvalidArgumentError as err:
            case.outcome = "refused: " + _refusal(err.message, len(request) - 1, what)
        else:
            assert out.shape == (len(request), 3) and np.isfinite(out).all(), (what, out)
            case.outcome = "embedded"


def _refusal(message: str, index: int, what: str) -> str:
    """Why the signature refused the request, checked to name the mutated image."""
    assert message.count("image_bytes:") == 1, (what, message)
    named = re.search(r"index\(es\)\]? \[([\d ]+)\]", message)
    if named:
        assert named.group(1).split() == [str(index)], (what, message)
        return "undecodable" if "could not decode" in message else "over max_pixels"
    assert "max_request_pixels" in message, (what, message)
    return "over max_request_pixels"
