"""The per-image transforms and the hand-written tf.train.Example encoder."""

import io

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tests.support import miniature as mini
from tfaploss.pipelines import images as I
from tfaploss.pipelines import tf_example as X


def _bytes(img, fmt="JPEG", **kw):
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _decode(jpeg):
    return np.asarray(Image.open(io.BytesIO(jpeg)))


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK", "P", "RGBA", "LA", "I;16"])
def test_every_mode_becomes_rgb(mode):
    base = Image.new("RGB", (40, 30), (200, 120, 40))
    if mode == "I;16":
        img = Image.new("I;16", (40, 30), 0x8000)
    elif mode == "P":
        img = base.convert("P", palette=Image.Palette.ADAPTIVE)
    else:
        img = base.convert(mode)
    fmt = "JPEG" if mode in ("RGB", "L", "CMYK") else "PNG"
    jpeg, h, w = I.process_image_bytes(_bytes(img, fmt))
    out = _decode(jpeg)
    assert out.shape == (30, 40, 3) and (h, w) == (30, 40)
    if mode in ("RGB", "CMYK", "P", "RGBA"):
        np.testing.assert_allclose(out[15, 20], (200, 120, 40), atol=8)
    if mode == "I;16":
        np.testing.assert_allclose(out[15, 20], (128, 128, 128), atol=2)


def test_alpha_is_composited_on_white():
    img = Image.new("RGBA", (10, 10), (255, 0, 0, 0))
    out = _decode(I.process_image_bytes(_bytes(img, "PNG"))[0])
    np.testing.assert_allclose(out[5, 5], (255, 255, 255), atol=2)


def test_exif_rotation_and_resize_keep_aspect(tmp_path):
    path = str(tmp_path / "exif.jpg")
    mini.write_image(path, 0, "exif")
    with open(path, "rb") as f:
        data = f.read()
    jpeg, h, w = I.process_image_bytes(data, max_side=16)
    assert (h, w) == (16, 12)  # stored 32x24, displayed 24x32, longer side -> 16
    big = Image.new("RGB", (800, 600), (10, 200, 30))
    jpeg, h, w = I.process_image_bytes(_bytes(big), max_side=512, jpeg_quality=80)
    assert (h, w) == (384, 512)
    np.testing.assert_allclose(_decode(jpeg)[100, 100], (10, 200, 30), atol=6)
    assert I.process_image_bytes(_bytes(Image.new("RGB", (8, 8))), max_side=512)[1:] == (8, 8)


def test_crop_box_in_source_pixels():
    a = np.zeros((24, 32, 3), np.uint8)
    a[:, 16:] = 255
    jpeg, h, w = I.process_image_bytes(_bytes(Image.fromarray(a), "PNG"),
                                       bbox=[16.5, 2.0, 40.0, 10.2])
    assert (h, w) == (9, 16)  # x 16..32 (clipped), y 2..11
    assert _decode(jpeg).min() > 240
    with pytest.raises(I.ImageError, match="bad_box"):
        I.process_image_bytes(_bytes(Image.fromarray(a), "PNG"), bbox=[40, 0, 50, 5])


@pytest.mark.parametrize("data, code", [
    (b"", "empty_file"),
    (b"this is not an image", "undecodable"),
    (_bytes(Image.new("RGB", (64, 64), (1, 2, 3)))[:300], "truncated"),
])
def test_bad_bytes_get_a_code(data, code):
    with pytest.raises(I.ImageError) as info:
        I.process_image_bytes(data)
    assert info.value.code == code


def test_size_sanity_limits(tmp_path):
    data = _bytes(Image.new("RGB", (40, 3)))
    with pytest.raises(I.ImageError, match="too_small: 40x3 is below --min_side=4"):
        I.process_image_bytes(data, min_side=4)
    with pytest.raises(I.ImageError, match="too_large"):
        I.process_image_bytes(data, max_pixels=100)
    with pytest.raises(I.ImageError, match="missing_file"):
        I.read_bytes(str(tmp_path / "nonexistent" / "x.jpg"))


def test_hand_written_example_parses_in_tensorflow():
    record = {"id": "a/b", "path": "images/a/b.jpg", "relpath": "a/b.jpg", "index": 7, "label": 3,
              "super_label": -1, "class_text": "n01", "bbox": [1.5, 2.0, 3.25, 300.0]}
    raw = X.image_example(record, b"\xff\xd8jpeg", 300, 2**40)
    ex = tf.train.Example.FromString(raw)
    f = ex.features.feature
    assert f["image/encoded"].bytes_list.value == [b"\xff\xd8jpeg"]
    assert f["image/id"].bytes_list.value == [b"a/b"]
    assert f["image/path"].bytes_list.value == [b"a/b.jpg"]
    assert f["image/index"].int64_list.value == [7]
    assert f["image/width"].int64_list.value == [2**40]
    assert f["image/class/super_label"].int64_list.value == [-1]
    assert f["image/class/text"].bytes_list.value == [b"n01"]
    assert list(f["image/bbox"].float_list.value) == [1.5, 2.0, 3.25, 300.0]
    # byte-identical to TensorFlow's own serialisation of the same features
    assert tf.train.Example.FromString(raw).SerializeToString(deterministic=True) == raw
    assert X.serialize_example({"k": []}) == tf.train.Example(features=tf.train.Features(
        feature={"k": tf.train.Feature(int64_list=tf.train.Int64List())})).SerializeToString()


def test_class_chunks_are_balanced():
    assert X.class_chunks(5, 8) == [(0, 5)]
    assert X.class_chunks(9, 8) == [(0, 4), (4, 9)]
    sizes = [b - a for a, b in X.class_chunks(100, 32)]
    assert sum(sizes) == 100 and min(sizes) >= 16 and max(sizes) <= 32 and len(sizes) == 4
    raw = X.class_chunk_examples(4, [(f"i{n}", 1, b"j") for n in range(9)], 8)
    parsed = [tf.train.Example.FromString(r).features.feature for r in raw]
    assert [list(p["image/id"].bytes_list.value) for p in parsed] == [
        [b"i0", b"i1", b"i2", b"i3"], [b"i4", b"i5", b"i6", b"i7", b"i8"]]
    assert [p["class/num_images"].int64_list.value[0] for p in parsed] == [9, 9]
    assert [p["class/chunk"].int64_list.value[0] for p in parsed] == [0, 1]


def test_tfrecord_framing_is_byte_identical_to_tensorflow(tmp_path):

    records = [b"", b"x", X.serialize_example({"k": [1, 2]}), bytes(range(256)) * 300]
    path = str(tmp_path / "tf.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        for r in records:
            w.write(r)
    buf = io.BytesIO()
    assert X.write_tfrecords(buf, records) == 4
    with open(path, "rb") as f:
        assert buf.getvalue() == f.read()


@pytest.mark.parametrize("fmt, exif", [("JPEG", None), ("JPEG", 1), ("JPEG", 6), ("PNG", None),
                                       ("PNG", 3), ("WEBP", 8), ("TIFF", 6)])
def test_orientation_fast_path_gives_what_exif_transpose_gives(fmt, exif):
    from PIL import ImageOps

    a = np.zeros((24, 32, 3), np.uint8)
    a[:6, :6] = (255, 0, 0)
    a[6:, 10:] = (10, 200, 30)
    kw = {}
    if exif is not None:
        e = Image.Exif()
        e[0x0112] = exif
        kw["exif"] = e.tobytes()
    data = _bytes(Image.fromarray(a), fmt, **kw)
    got = I.process_image_bytes(data, max_side=16)
    img = Image.open(io.BytesIO(data))
    if fmt == "JPEG":
        img.draft("RGB", (16, 12))  # what decode_image asks for 32x24 -> max_side 16
    img = ImageOps.exif_transpose(img)  # the path before the fast one: always called
    img = I.resize_max_side(img.convert("RGB"), 16)
    assert got == (I.encode_jpeg(img, 90), img.size[1], img.size[0])
