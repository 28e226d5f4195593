"""The per-image work every job does: read, decode, validate, crop, resize, re-encode
(pure PIL, no Beam, no TensorFlow)."""

from __future__ import annotations

import io
import logging
import math
import os
import warnings

from PIL import Image, ImageFile, ImageOps

from tfaploss.pipelines import image_headers

LOG = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# The formats PIL may decode (an MPO opens as JPEG): a ".jpg" holding EPS, PSD or any
# of PIL's other formats is refused rather than handed to a reader nobody tested.
DECODED_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "WEBP", "TIFF")

# Failure codes used in dead letters and counted in the manifest.
MISSING_FILE = "missing_file"
EMPTY_FILE = "empty_file"
TRUNCATED = "truncated"
UNDECODABLE = "undecodable"
TOO_SMALL = "too_small"
TOO_LARGE = "too_large"
BAD_BOX = "bad_box"
DUPLICATE_ID = "duplicate_id"
BAD_ANNOTATION = "bad_annotation"
UNSAFE_PATH = "unsafe_path"          # a listed name that leaves the input folder
BAD_FILE_NAME = "bad_file_name"      # a file name that is not valid UTF-8
UNREADABLE_FOLDER = "unreadable_folder"

_ORIENTATION = 0x0112


class ImageError(Exception):
    """An input image that cannot be used; ``code`` is one of the failure codes."""

    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


def dead_letter(record: dict, code: str, detail: str) -> dict:
    """The dead-letter entry of a work-list ``record`` that failed with ``code``."""
    return {"id": record.get("id", ""), "path": record.get("relpath", record.get("path", "")),
            "reason": code, "detail": detail}


def read_bytes(path: str, root: str | None = None) -> bytes:
    """Read a whole file from a local path or any Beam filesystem URL; a local path whose
    real location is outside ``root`` raises ``ImageError(UNSAFE_PATH)``."""
    try:
        if "://" not in path:
            if root is not None:
                real = os.path.realpath(path)
                if os.path.commonpath([real, root]) != root:
                    raise ImageError(UNSAFE_PATH, f"{path} resolves to {real}, outside {root}")
            with open(path, "rb") as f:
                return f.read()
        from apache_beam.io.filesystem import CompressionTypes
        from apache_beam.io.filesystems import FileSystems

        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            return f.read()
    except OSError as e:  # Beam filesystems raise their own IOError for missing objects
        raise ImageError(MISSING_FILE, f"cannot read {path}: {e}") from e


def _apply_orientation(img: Image.Image) -> Image.Image:
    """``ImageOps.exif_transpose`` only when there is something to transpose: it parses
    and copies even at orientation 1 (10 % of the per-image time)."""
    no_blocks = not {"exif", "xmp", "XML:com.adobe.xmp"} & set(img.info)
    if no_blocks and (img.format not in ("TIFF", "WEBP", "PNG")
                      or _ORIENTATION not in img.getexif()):
        return img
    try:
        return ImageOps.exif_transpose(img)
    except Exception as e:  # noqa: BLE001 - a broken EXIF block should not lose the image
        LOG.debug("ignoring unreadable EXIF orientation: %s", e)
        return img


def decode_image(data: bytes, *, min_side: int = 1, max_pixels: int = 100_000_000,
                 draft_side: int = 0) -> Image.Image:
    """Decode ``data`` into an RGB PIL image with its EXIF orientation applied (alpha
    composited on white); ``draft_side`` > 0 lets the JPEG decoder scale down by a power
    of two while staying at least that large. Raises :class:`ImageError`.

    No more than ``max_pixels`` pixels are ever decoded: the size the codec's walk reads
    (:func:`~tfaploss.pipelines.image_headers.read_size`) and PIL's must both pass and
    agree. Only the first frame of an animation is decoded.
    """
    if not data:
        raise ImageError(EMPTY_FILE, "file is empty (0 bytes)")
    try:
        declared = image_headers.read_size(data)
    except image_headers.HeaderError as e:
        raise ImageError(TRUNCATED if e.truncated else UNDECODABLE, f"refused header: {e}") from e
    if declared is not None and declared[1] * declared[2] > max_pixels:
        raise ImageError(TOO_LARGE, f"the {declared[0]} header declares {declared[1]}x"
                                    f"{declared[2]}, more than --max_pixels={max_pixels}")
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=DECODED_FORMATS)
            w, h = img.size
            if w * h > max_pixels:
                raise ImageError(TOO_LARGE, f"{w}x{h} has more than --max_pixels={max_pixels}")
            if declared is not None and (w, h) != declared[1:]:
                raise ImageError(UNDECODABLE, f"PIL reads {w}x{h} where the {declared[0]} "
                                              f"decoder reads {declared[1]}x{declared[2]}")
            if draft_side and img.format == "JPEG" and max(w, h) > draft_side:
                scale = draft_side / max(w, h)
                img.draft("RGB", (max(1, math.ceil(w * scale)), max(1, math.ceil(h * scale))))
            img.load()
            w, h = img.size
            if w * h > max_pixels:  # a plugin whose load() changed the size
                raise ImageError(TOO_LARGE, f"{w}x{h} has more than --max_pixels={max_pixels}")
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(TOO_LARGE, str(e)) from e
    except Image.UnidentifiedImageError as e:
        raise ImageError(UNDECODABLE, "not a recognised image format") from e
    except OSError as e:
        if "truncated" in str(e).lower():
            raise ImageError(TRUNCATED, str(e)) from e
        raise ImageError(UNDECODABLE, str(e)) from e
    except (SyntaxError, ValueError, EOFError) as e:
        raise ImageError(UNDECODABLE, str(e) or type(e).__name__) from e
    img = to_rgb(_apply_orientation(img))
    if min(img.size) < min_side:
        raise ImageError(TOO_SMALL, f"{img.size[0]}x{img.size[1]} is below --min_side={min_side}")
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB; transparent pixels become white."""
    if img.mode == "RGB":
        return img
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit grayscale: keep the top 8 bits instead of clipping at 255.
        img = img.point(lambda v: v / 256).convert("L")
    return img.convert("RGB")


def crop_box(img: Image.Image, bbox) -> Image.Image:
    """Crop to ``[x0, y0, x1, y1]`` (source pixels), clipped to the image."""
    x0, y0, x1, y1 = (float(v) for v in bbox)
    w, h = img.size
    left, top = max(0, math.floor(x0)), max(0, math.floor(y0))
    right, bottom = min(w, math.ceil(x1)), min(h, math.ceil(y1))
    if right <= left or bottom <= top:
        raise ImageError(BAD_BOX, f"box {list(bbox)} is empty inside a {w}x{h} image")
    return img.crop((left, top, right, bottom))


def resize_max_side(img: Image.Image, max_side: int) -> Image.Image:
    """Downscale so that the longer side is ``max_side`` (aspect kept; never upscales)."""
    w, h = img.size
    if not max_side or max(w, h) <= max_side:
        return img
    scale = max_side / max(w, h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return img.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)


def encode_jpeg(img: Image.Image, quality: int) -> bytes:
    # comment=b"": PIL would copy the source's comment (a GIF's or a JPEG's COM) into the
    # output, and fail on one of more than 64 KiB.
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality, optimize=False, comment=b"")
    return buf.getvalue()


def process_image_bytes(data: bytes, *, max_side: int = 0, jpeg_quality: int = 90,
                        min_side: int = 1, max_pixels: int = 100_000_000,
                        bbox=None) -> tuple[bytes, int, int]:
    """The whole per-image transform: ``(jpeg_bytes, height, width)``, or
    :class:`ImageError`."""
    # Decoding at reduced scale is only safe when no crop box needs full resolution.
    img = decode_image(data, min_side=min_side, max_pixels=max_pixels,
                       draft_side=max_side if bbox is None else 0)
    if bbox is not None:
        img = crop_box(img, bbox)
    img = resize_max_side(img, max_side)
    return encode_jpeg(img, jpeg_quality), img.size[1], img.size[0]


def safe_relpath(name: str) -> str | None:
    """Why the dataset-given relative path ``name`` may not be joined to a root (it
    would leave its folder), or None."""
    if not isinstance(name, str) or not name.strip():
        return "empty name"
    if "\x00" in name:
        return "name holds a NUL byte"
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "absolute path"
    if "\\" in name:
        return "backslash in name"
    if "://" in name:
        return "URL instead of a relative name"
    if any(part == ".." for part in name.split("/")):
        return "'..' leaves the folder"
    return None
