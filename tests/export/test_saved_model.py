"""SavedModel export for TF Serving (tfaploss.export)."""

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import keras
import numpy as np
import pytest
import sklearn.datasets
import tensorflow as tf
from PIL import Image

from tests.reliability import hostile_images
from tfaploss import models
from tfaploss.export import export_saved_model, next_version, resize_and_center_crop

SIZE = (32, 32)
# Real photographs shipped with scikit-learn (JPEG files, 427x640).
PHOTOS = Path(sklearn.datasets.__file__).parent / "images"


def _jpeg_bytes():
    return [(PHOTOS / name).read_bytes() for name in ("china.jpg", "flower.jpg")]


def _png_bytes(height=50, width=30, mode="L"):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (height, width), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def _reference(model, encoded):
    """model.predict on the same pixels the serving function decodes."""
    images = [resize_and_center_crop(tf.io.decode_image(b, channels=3,
                                                        expand_animations=False), SIZE)
              for b in encoded]
    return model.predict(np.stack([i.numpy() for i in images]), verbose=0)


# Run in a child process with Keras blocked (TensorFlow tolerates its absence): the
# SavedModel must work on TensorFlow alone, without keras, tfaploss or models.
_LOAD_SCRIPT = """
import sys
sys.modules['keras'] = None
sys.modules['tf_keras'] = None
import json, numpy as np, tensorflow as tf
d, out, *inputs = sys.argv[1:]
fn = tf.saved_model.load(d).signatures['serving_default']
data = [open(path, 'rb').read() for path in inputs]
res = fn(image_bytes=tf.constant(data))
np.save(out, res['embedding'].numpy())
mods = [m for m in ('keras', 'tfaploss') if sys.modules.get(m)]
print(json.dumps({'imported': mods, 'keys': sorted(res)}))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    keras.utils.set_random_seed(0)
    model = models.build_embedding_model("small_cnn", pooling="gem", embedding_dim=16,
                                         freeze_bn=True, input_shape=(*SIZE, 3))
    model.get_layer("head").bias.assign(np.linspace(-0.5, 0.5, 16).astype("float32"))
    base = tmp_path_factory.mktemp("export") / "retrieval"
    version_dir = export_saved_model(model, base, image_size=SIZE)

    # The two slow subprocesses start now and run while the other tests do; their
    # output goes to files so that a full pipe can never block them.
    work = tmp_path_factory.mktemp("child")
    encoded = _jpeg_bytes() + [_png_bytes()]
    inputs = []
    for i, data in enumerate(encoded):
        inputs.append(work / f"image{i}")
        inputs[-1].write_bytes(data)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}

    def start(name, argv):
        with open(work / f"{name}.out", "w") as out, open(work / f"{name}.err", "w") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=work)
        return proc, work / f"{name}.out", work / f"{name}.err"

    child = start("load", [sys.executable, "-c", _LOAD_SCRIPT, version_dir,
                           str(work / "out.npy"), *map(str, inputs)])
    cli = Path(sys.executable).with_name("saved_model_cli")
    cli = str(cli) if cli.exists() else shutil.which("saved_model_cli")
    cli_proc = None
    if cli:
        cli_proc = start("cli", [cli, "show", "--dir", version_dir, "--tag_set", "serve",
                                 "--signature_def", "serving_default"])
    procs = {"load": (child, encoded, work / "out.npy"), "cli": cli_proc}
    yield model, base, version_dir, procs
    for entry in (child, cli_proc):
        if entry is not None and entry[0].poll() is None:
            entry[0].kill()
            entry[0].wait()


def _finish(entry):
    proc, out, err = entry
    proc.wait(timeout=300)
    assert proc.returncode == 0, err.read_text()[-2000:]
    return out.read_text()


def test_layout_and_versions(exported, tmp_path):
    model, base, version_dir, _ = exported
    assert Path(version_dir) == base / "1"
    assert (base / "1" / "saved_model.pb").is_file()
    assert (base / "1" / "variables").is_dir()
    meta = json.loads((base / "1" / "assets.extra" / "tfaploss_export.json").read_text())
    assert meta["image_size"] == list(SIZE) and meta["embedding_dim"] == 16
    assert sorted(os.listdir(base)) == ["1"]  # no temporary directory left behind
    assert next_version(base) == 2
    with pytest.raises(FileExistsError, match="already exists"):
        export_saved_model(model, base, image_size=SIZE, version=1)
    with pytest.raises(ValueError, match="image_size=\\(64, 64\\)"):
        export_saved_model(model, tmp_path / "m", image_size=(64, 64))


@pytest.mark.long
def test_a_full_disk_leaves_no_version_and_the_rerun_exports_the_same(exported, tmp_path,
                                                                      monkeypatch):
    """ENOSPC while the version is written: one DiskFullError naming it, no temporary
    folder, no version; space freed, the same export as one that never failed. Too
    little space for an overwrite: refused before tracing, the served version kept."""
    from tfaploss.durable import atomic, faults

    model, _, version_dir, _ = exported
    base = tmp_path / "m"

    def files(folder):
        return {str(p.relative_to(folder)): p.read_bytes() for p in Path(folder).rglob("*")
                if p.is_file() and p.name not in ("saved_model.pb", "fingerprint.pb")}
    # (the graph and its fingerprint name functions by ids that vary from run to run)

    with faults.armed("export_enospc"), pytest.raises(atomic.DiskFullError) as err:
        export_saved_model(model, base, image_size=SIZE)
    assert str(base / "1") in str(err.value) and "needed" in str(err.value)
    assert os.listdir(base) == []
    export_saved_model(model, base, image_size=SIZE)
    assert files(base / "1") == files(version_dir)
    before = files(base)
    monkeypatch.setattr(atomic, "free_bytes", lambda folder: 1000)
    with pytest.raises(atomic.DiskFullError, match="1000 bytes free"):
        export_saved_model(model, base, image_size=SIZE, version=1, overwrite=True)
    assert os.listdir(base) == ["1"] and files(base) == before


def test_what_a_killed_export_left_is_cleaned_up_and_exports_take_turns(exported, tmp_path,
                                                                        caplog):
    """An export killed outright leaves its ``.tmp-*`` staging folder; one killed
    between the two renames of an overwrite (no atomic exchange) leaves ``.N.previous``
    and no ``N``. The next export removes the first and puts the version back, before it
    picks its version number. A second export while one holds the folder is refused."""
    from tfaploss.durable import locks

    model, _, version_dir, _ = exported
    base = tmp_path / "m"
    base.mkdir()
    for name in (".tmp-2-abcd1234", ".tmp-3-0000ffff"):  # two killed exports
        (base / name / "variables").mkdir(parents=True)
        (base / name / "variables" / "variables.data-00000-of-00001").write_bytes(b"x" * 99)
    shutil.copytree(version_dir, base / ".1.previous")  # version 1, mid-replace
    (base / ".tmp-notes.txt").write_text("a file of the user's, not a staging folder")
    with caplog.at_level("WARNING", logger="tfaploss.export.saved_model"):
        out = export_saved_model(model, base, image_size=SIZE)
    assert Path(out) == base / "2"  # version 1 came back first, so the next one is 2
    assert sorted(os.listdir(base)) == [".tmp-notes.txt", "1", "2"]
    assert (base / "1" / "saved_model.pb").read_bytes() == \
        (Path(version_dir) / "saved_model.pb").read_bytes()
    assert "removed 2 staging folder(s)" in caplog.text

    with locks.exclusive(base, "a test holding the folder"), \
            pytest.raises(locks.LockHeldError, match="SavedModel export folder"):
        export_saved_model(model, base, image_size=SIZE)
    assert sorted(os.listdir(base)) == [".tmp-notes.txt", "1", "2"]


def test_pixels_signature_matches_model(exported):
    model, _, version_dir, _ = exported
    loaded = tf.saved_model.load(version_dir)
    x = np.random.default_rng(1).uniform(0, 255, (2, *SIZE, 3)).astype("float32")
    served = loaded.signatures["embed_pixels"](images=tf.constant(x))["embedding"].numpy()
    np.testing.assert_allclose(served, model.predict(x, verbose=0), atol=1e-5)


def test_corrupt_bytes_give_invalid_argument_naming_the_index(exported):
    _, _, version_dir, _ = exported
    fn = tf.saved_model.load(version_dir).signatures["serving_default"]
    good = _jpeg_bytes()[0]
    truncated = good[: len(good) // 3]
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        fn(image_bytes=tf.constant([good, b"this is not an image", good, truncated]))
    message = info.value.message
    assert "could not decode the image(s) at index(es)] [1 3]" in message
    # The same function keeps serving good requests.
    assert fn(image_bytes=tf.constant([good]))["embedding"].shape == (1, 16)


def _png_declaring(width, height, complete=False):
    """A grey PNG whose IHDR declares ``width x height``. Its IDAT is 64 KiB of
    compressed zeros, or with ``complete`` every row (a real decompression bomb: 97 KB
    for 10000 x 10000, which decodes to 300 MB, 1.5 GB peak in the old serving graph)."""
    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    if complete:
        packer, row = zlib.compressobj(9), b"\0" * (width + 1)
        idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    else:
        idat = zlib.compress(b"\0" * (1 << 16), 9)
    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def _encoded(fmt, height=37, width=53, frames=1, seed=0, **save):
    return hostile_images.encode(fmt, width=width, height=height, seed=seed, frames=frames,
                                 **save)


def test_decompression_bomb_is_refused_before_decoding(exported):
    _, _, version_dir, _ = exported
    fn = tf.saved_model.load(version_dir).signatures["serving_default"]
    bomb = _png_declaring(10000, 10000, complete=True)
    assert len(bomb) < 100_000
    good = _jpeg_bytes()[0]
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        fn(image_bytes=tf.constant([good, bomb, good, bomb, b"not an image"]))
    message = info.value.message
    # Refused by the size check, which runs before (and instead of) any decoding: the
    # undecodable index 4 is not even reached.
    assert "the image(s) at index(es)] [1 3] [declare] [100000000 100000000]" in message
    assert "max_pixels=40000000" in message and "could not decode" not in message
    assert fn(image_bytes=tf.constant([good]))["embedding"].shape == (1, 16)


def test_every_format_within_the_limit_embeds_as_before(exported):
    model, _, version_dir, _ = exported
    fn = tf.saved_model.load(version_dir).signatures["serving_default"]
    encoded = [_encoded("PNG"), _encoded("GIF"), _encoded("BMP"), _encoded("WEBP"),
               _encoded("GIF", frames=3, seed=1), _jpeg_bytes()[1]]
    served = fn(image_bytes=tf.constant(encoded))["embedding"].numpy()
    np.testing.assert_allclose(served, _reference(model, encoded), atol=1e-5)


def test_declared_pixels_reads_each_header():
    from tfaploss.export import declared_pixels

    def pixels(data):
        return float(declared_pixels(tf.constant(data)))

    area = 37 * 53
    for fmt, save in (("PNG", {}), ("JPEG", {}), ("JPEG", {"progressive": True}),
                      ("BMP", {}), ("WEBP", {}), ("WEBP", {"lossless": True})):
        assert pixels(_encoded(fmt, **save)) == area, (fmt, save)
    assert pixels(_encoded("GIF")) == 2 * area  # logical screen + its one frame
    assert pixels(_encoded("GIF", frames=3, seed=2)) == 4 * area
    # An animated WebP declares its canvas: libwebp keeps every frame inside it, and
    # TensorFlow refuses animations with channels=3 before decoding anything.
    assert pixels(_encoded("WEBP", frames=3, seed=2)) == area
    assert pixels(_jpeg_bytes()[0]) == 427 * 640
    # A JPEG whose APP1 segment (an EXIF thumbnail, say) holds a start-of-frame marker
    # of 9999 x 9999, and stray bytes before the next marker: the real frame counts.
    jpeg = _encoded("JPEG")
    fake_sof = b"\xff\xc0\x00\x11\x08" + struct.pack(">HH", 9999, 9999) + b"\0" * 10
    app1 = b"\xff\xe1" + struct.pack(">H", 2 + len(fake_sof)) + fake_sof
    assert pixels(jpeg[:2] + app1 + b"junk" + jpeg[2:]) == area
    assert pixels(_png_declaring(10000, 10000)) == 1e8
    assert pixels(_png_declaring(2**32 - 1, 2**32 - 1)) > 1e19  # no int64 overflow
    assert pixels(b"this is not an image") == 0 and pixels(b"") == 0
    assert pixels(b"\x89PNG\r\n\x1a\n") == -1  # a PNG without its IHDR: unreadable


def test_max_pixels_option(tmp_path):
    from tfaploss.export import decode_images

    small, large = _encoded("PNG", 20, 20), _encoded("PNG", 50, 30)
    out = decode_images(tf.constant([small]), (16, 16), max_pixels=400)
    assert out.shape == (1, 16, 16, 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="max_pixels=400") as info:
        decode_images(tf.constant([small, large]), (16, 16), max_pixels=400)
    # eager mode prints the index and the declared size on their own lines
    assert "index(es)'\n1\nb'declare'\n1500\n" in info.value.message
    with pytest.raises(ValueError, match="max_pixels"):
        decode_images(tf.constant([small]), (16, 16), max_pixels=0)
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.GlobalAveragePooling2D()])
    with pytest.raises(ValueError, match="max_pixels"):
        export_saved_model(model, tmp_path / "m", image_size=(16, 16), max_pixels=-5)


def test_a_request_of_many_allowed_images_is_refused_before_decoding(exported):
    _, _, version_dir, _ = exported
    fn = tf.saved_model.load(version_dir).signatures["serving_default"]
    # Five 36-megapixel PNGs, each under the 40 MP limit, 180 MP in all (default limit:
    # 4 x 40 MP). Their data is cut short, so any decoding would say "could not decode".
    many = [_png_declaring(6000, 6000) for _ in range(5)]
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        fn(image_bytes=tf.constant(many))
    message = info.value.message
    assert "[declare] [180000000] [pixels in all, more than max_request_pixels=160000000" \
        in message
    assert "could not decode" not in message and "index(es)" not in message
    with open(os.path.join(version_dir, "assets.extra", "tfaploss_export.json")) as f:
        assert json.load(f)["max_request_pixels"] == 160_000_000
    good = _jpeg_bytes()
    assert fn(image_bytes=tf.constant(good * 4))["embedding"].shape == (8, 16)


def test_max_request_pixels_option(tmp_path):
    from tfaploss.export import decode_images

    small = _encoded("PNG", 20, 20)
    cut = small[:-30]  # its header declares 400 pixels; its data cannot be decoded
    out = decode_images(tf.constant([small, small]), (16, 16), max_pixels=400,
                        max_request_pixels=800)  # at the limit: allowed
    assert out.shape == (2, 16, 16, 3)
    for request in ([small, small, small], [small, small, cut]):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="pixels in all, more than max_request_pixels=800") as info:
            decode_images(tf.constant(request), (16, 16), max_pixels=400,
                          max_request_pixels=800)
        assert "'declare'\n1200\n" in info.value.message
        assert "could not decode" not in info.value.message
    # The default: 4 x max_pixels.
    assert decode_images(tf.constant([small] * 4), (16, 16), max_pixels=400).shape[0] == 4
    with pytest.raises(tf.errors.InvalidArgumentError, match="max_request_pixels=1600"):
        decode_images(tf.constant([small] * 5), (16, 16), max_pixels=400)
    for bad in (399, 0, 1.5e9, True):
        with pytest.raises(ValueError, match="max_request_pixels"):
            decode_images(tf.constant([small]), (16, 16), max_pixels=400,
                          max_request_pixels=bad)
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.GlobalAveragePooling2D()])
    with pytest.raises(ValueError, match="max_request_pixels"):
        export_saved_model(model, tmp_path / "m", image_size=(16, 16), max_pixels=400,
                           max_request_pixels=100)
    assert "4 x ``max_pixels``" in export_saved_model.__doc__


def test_whitening_is_applied_at_export(exported, tmp_path):
    model, _, _, _ = exported
    rng = np.random.default_rng(2)
    train = model.predict(rng.uniform(0, 255, (40, *SIZE, 3)).astype("float32"), verbose=0)
    whitening = models.fit_pca_whitening(train, dim=8)
    version_dir = export_saved_model(model, tmp_path / "w", image_size=SIZE,
                                     whitening=whitening, version=3)
    assert version_dir.endswith(os.path.join("w", "3"))
    fn = tf.saved_model.load(version_dir).signatures["serving_default"]
    encoded = _jpeg_bytes()
    served = fn(image_bytes=tf.constant(encoded))["embedding"].numpy()
    reference = whitening(_reference(model, encoded)).numpy()
    assert served.shape == (2, 8)
    np.testing.assert_allclose(served, reference, atol=1e-5)


def test_resize_and_center_crop():
    # A tall image at the crop width: no resampling, the central rows are kept.
    tall = np.arange(64 * 32 * 3, dtype=np.float32).reshape(64, 32, 3)
    out = resize_and_center_crop(tall, (32, 32), crop_fraction=1.0).numpy()
    np.testing.assert_array_equal(out, tall[16:48])
    # Already at the crop size with crop_fraction 1: bit-exact pixels.
    square = np.random.default_rng(3).integers(0, 256, (32, 32, 3)).astype(np.uint8)
    np.testing.assert_array_equal(resize_and_center_crop(square, (32, 32), 1.0).numpy(),
                                  square.astype(np.float32))
    # 427x640 photo -> short side 32 / 0.875 = 37 (rounded), centre 32x32 crop; a
    # constant image stays constant.
    flat = np.full((427, 640, 3), 100, np.uint8)
    out = resize_and_center_crop(flat, (32, 32)).numpy()
    assert out.shape == (32, 32, 3)
    np.testing.assert_allclose(out, 100.0, atol=1e-3)
    with pytest.raises(ValueError, match="crop_fraction"):
        resize_and_center_crop(flat, (32, 32), crop_fraction=1.5)


@pytest.mark.parametrize("size", [32, 224])
def test_serving_preprocessing_matches_the_evaluation_pipeline(size):
    from tfaploss.data import center_crop

    for encoded in _jpeg_bytes() + [_png_bytes(45, 70)]:
        decoded = tf.io.decode_image(encoded, channels=3, expand_animations=False)
        np.testing.assert_allclose(resize_and_center_crop(decoded, (size, size)).numpy(),
                                   center_crop(tf.constant(encoded), size).numpy(),
                                   atol=1e-3)


def test_serving_default_on_jpeg_bytes_matches_predict_without_keras(exported):
    model, _, _, procs = exported
    child, encoded, out = procs["load"]
    stdout = _finish(child)
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report == {"imported": [], "keys": ["embedding"]}
    served = np.load(out)
    assert served.shape == (3, 16) and served.dtype == np.float32
    np.testing.assert_allclose(served, _reference(model, encoded), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)


def test_saved_model_cli_lists_string_input(exported):
    entry = exported[3]["cli"]
    assert entry is not None, "saved_model_cli ships with tensorflow and must be installed"
    stdout = _finish(entry)
    text = stdout
    inputs, outputs = text.split("outputs", 1)
    assert "inputs['image_bytes']" in inputs and "dtype: DT_STRING" in inputs
    assert "shape: (-1)" in inputs
    assert "outputs['embedding']" in "outputs" + outputs and "DT_FLOAT" in outputs
    assert "shape: (-1, 16)" in outputs


def test_the_docs_warn_to_load_only_trusted_models():
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text(encoding="utf-8")
    serve = readme.split("## Serve", 1)[1].split("\n## ", 1)[0]
    assert "**Load only models you trust**" in serve and "docs/evaluation.md" in serve
    section = (root / "docs" / "evaluation.md").read_text(encoding="utf-8")
    warning = section.split("**Load only models you trust.**", 1)
    assert len(warning) == 2, "docs/evaluation.md must carry the trusted-models warning"
    paragraph = warning[1].split("\n\n", 1)[0]
    assert "tfaploss evaluate" in paragraph and "tfaploss.pipelines.embed" in paragraph
    assert "SavedModel" in paragraph and "run other code" in paragraph


def test_the_image_formats_are_listed_alike():
    """``export --help``, the export docstring and docs/serving.md name the formats the
    signature decodes, in one wording."""
    import re

    from tfaploss import cli
    from tfaploss.export import saved_model
    from tfaploss.export.image_ops import IMAGE_FORMATS

    wording = ", ".join(IMAGE_FORMATS[:-1]) + " or " + IMAGE_FORMATS[-1]
    parser = cli.build_parser()
    export = parser._subparsers._group_actions[0].choices["export"]
    texts = {"export --help": export.format_help(),
             "export_saved_model": saved_model.export_saved_model.__doc__,
             "docs/serving.md": (Path(__file__).resolve().parents[2] / "docs" / "serving.md")
             .read_text(encoding="utf-8")}
    for where, text in texts.items():
        assert wording in re.sub(r"\s+", " ", text), where
