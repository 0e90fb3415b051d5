"""Reading image files: RGB out, EXIF orientation applied, every failure a ``BadImageError``.

Sizes are PIL's ``(width, height)`` throughout this module.

Orientation is read from the metadata Pillow parses while opening the file (never by decoding the
pixels) and applied by ``open_image`` with the same helper ``image_size`` uses, so the size
``image_size`` reports is always the size ``open_image`` returns. (``ImageOps.exif_transpose``
would decode a PNG to look for an eXIf chunk after the pixel data, which the header-only
``image_size`` cannot see; the two could then disagree and an image would land in the wrong
bucket.)
"""

from __future__ import annotations

import os
import struct
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, UnidentifiedImageError

from imglora.errors import ImgloraError

DEFAULT_FIX = (
    "Re-save it as PNG or JPEG with an image editor, or remove it from the dataset "
    "(data.skip_bad_images = true skips such files with a warning)"
)

# What Pillow raises on malformed input besides OSError. Plugins parse untrusted bytes with
# struct/index arithmetic, so these escape from corrupt files too.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError, TypeError)

# EXIF orientation value -> the transpose that undoes it (as in ImageOps.exif_transpose).
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_SIDES = {5, 6, 7, 8}

# Modes that convert("RGB") maps correctly. LAB/HSV/F convert without error but wrongly, so they
# are refused rather than silently producing false colours.
_PLAIN_MODES = {"1", "L", "P", "RGB", "RGBX", "CMYK", "YCbCr"}
_ALPHA_MODES = {"LA", "PA", "RGBA", "RGBa"}
# Integer greyscale with more than 8 bits. convert("L") clips these to white, so they are scaled.
# "I" is what older Pillows (and TIFF) give for 16-bit greyscale; its values are taken as 16-bit.
_WIDE_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N"}


class BadImageError(ImgloraError):
    """An image file that cannot be used. The message names the file, the reason and the fix."""

    def __init__(self, path: str | os.PathLike, reason: str, fix: str = DEFAULT_FIX):
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}. {fix}")


def open_image(path: str | os.PathLike) -> Image.Image:
    """Decode ``path`` fully into an RGB image, upright, transparency composited onto white."""
    path = Path(path)
    with _reading(path), Image.open(path) as im:
        orientation = _orientation(im)
        im.load()  # decodes every pixel, so a truncated file fails here and not mid-training
        rgb = _to_rgb(im, path)
    if orientation in _TRANSPOSE:
        rgb = rgb.transpose(_TRANSPOSE[orientation])
    return rgb


def open_mask(path: str | os.PathLike) -> Image.Image:
    """A loss mask: greyscale ("L", 0 = ignore .. 255 = train), upright as ``open_image`` turns its image.
    A colour mask is read by its brightness; one with transparency, transparent = ignore."""
    path = Path(path)
    with _reading(path), Image.open(path) as im:
        orientation = _orientation(im)
        im.load()
        if im.mode in _WIDE_MODES:
            grey = _wide_to_rgb(im).convert("L")
        elif im.mode in _ALPHA_MODES or "transparency" in im.info:
            rgba = im.convert("RGBA")
            black = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
            grey = Image.alpha_composite(black, rgba).convert("L")
        else:
            grey = im.convert("L")
    return grey.transpose(_TRANSPOSE[orientation]) if orientation in _TRANSPOSE else grey


def image_alpha(path: str | os.PathLike) -> Image.Image | None:
    """The image's alpha channel ("L", 0 = transparent), upright, or None when it has no transparency."""
    path = Path(path)
    with _reading(path), Image.open(path) as im:
        orientation = _orientation(im)
        if not (im.mode in _ALPHA_MODES or "transparency" in im.info):
            return None
        im.load()
        alpha = im.convert("RGBA").getchannel("A")
    return alpha.transpose(_TRANSPOSE[orientation]) if orientation in _TRANSPOSE else alpha


def image_size(path: str | os.PathLike, *, verify: bool = False) -> tuple[int, int]:
    """``(width, height)`` of ``path`` as ``open_image`` would return it, from the header only.

    A header can be intact while the pixel data is cut short. ``verify=True`` also decodes the
    pixels to catch that (JPEGs at 1/8 scale, which still reads the whole stream but is several
    times faster than a full decode).
    """
    path = Path(path)
    with _reading(path), Image.open(path) as im:
        width, height = im.size
        swap = _orientation(im) in _SWAPS_SIDES
        if verify:
            im.draft(None, (1, 1))  # a no-op for formats without reduced-scale decoding
            im.load()
    return (height, width) if swap else (width, height)


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Turn everything that can go wrong while reading ``path`` into a ``BadImageError``."""
    _check_file(path)
    try:
        with warnings.catch_warnings():
            # Pillow only warns between MAX_IMAGE_PIXELS and twice that; either way the image is
            # too large to be a sane training image and would stall the cache step, so refuse it.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise BadImageError(
            path,
            f"image is too large to decode safely ({exc})",
            "Downscale it (2048 px on the long side is plenty), or remove it from the dataset",
        ) from exc
    except UnidentifiedImageError as exc:
        raise BadImageError(path, "not an image file (or a format Pillow cannot read)") from exc
    except _DECODE_ERRORS as exc:
        raise BadImageError(path, f"the file is truncated or corrupt ({exc})") from exc


def _check_file(path: Path) -> None:
    """Fail with a precise reason for the cases Pillow would report as 'cannot identify'."""
    try:
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise BadImageError(path, "file not found", "Check the path") from exc
    except OSError as exc:
        raise BadImageError(path, f"cannot read the file ({exc.strerror})", "Check it") from exc
    if not path.is_file():
        raise BadImageError(path, "not a regular file", "Remove it from the dataset folder")
    if size == 0:
        raise BadImageError(path, "the file is empty (0 bytes)")


def _orientation(im: Image.Image) -> int:
    """EXIF orientation (1..8, 1 = upright) from the metadata parsed at open time.

    Calls the base ``Image.getexif``: the PNG override decodes the whole image first, which would
    make ``image_size`` slow and could see a tag ``image_size`` cannot.
    """
    value = Image.Image.getexif(im).get(ExifTags.Base.Orientation, 1)
    return value if isinstance(value, int) else 1


def _to_rgb(im: Image.Image, path: Path) -> Image.Image:
    if im.mode in _WIDE_MODES:
        return _wide_to_rgb(im)
    if im.mode in _ALPHA_MODES or (im.mode in _PLAIN_MODES and "transparency" in im.info):
        # Transparent areas become white, not the black (or leftover colour) that dropping the
        # alpha channel would leave; a model trained on those learns black halos.
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if im.mode in _PLAIN_MODES:
        return im if im.mode == "RGB" else im.convert("RGB")
    raise BadImageError(
        path,
        f"unsupported pixel mode {im.mode!r}",
        "Convert it to 8-bit RGB (PNG or JPEG), or remove it from the dataset",
    )


def _wide_to_rgb(im: Image.Image) -> Image.Image:
    """Scale 16-bit greyscale to 8 bits (0..65535 -> 0..255, rounded)."""
    values = np.asarray(im).astype(np.int64).clip(0, 65535)
    grey = ((values * 255 + 32767) // 65535).astype(np.uint8)
    return Image.fromarray(grey).convert("RGB")
