"""images.py: every supported mode comes out RGB and upright; every bad file is a BadImageError."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
from PIL import ExifTags, Image

from imglora.data.images import BadImageError, image_size, open_image
from imglora.util.hashing import sha256_file as file_sha256
from imglora.errors import ImgloraError

RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def _close(pixel, expected, tol=8):
    return all(abs(a - b) <= tol for a, b in zip(pixel, expected))


def _pixels(im):
    """Every pixel, row by row, as RGB tuples."""
    return [tuple(p) for p in np.asarray(im).reshape(-1, 3).tolist()]


def _two_halves(width=60, height=40):
    """Left half red, right half blue: shows where the image's left edge ended up."""
    im = Image.new("RGB", (width, height), BLUE)
    im.paste(RED, (0, 0, width // 2, height))
    return im


def _exif(orientation):
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation
    return exif


def _bytes_of(im, fmt, **kwargs):
    buf = io.BytesIO()
    im.save(buf, fmt, **kwargs)
    return buf.getvalue()


def test_exif_rotated_jpeg_is_upright(tmp_path):
    path = tmp_path / "rotated.jpg"
    # Orientation 6: the stored pixels must be turned 90 degrees clockwise to display upright,
    # which moves the stored left edge (red) to the top.
    _two_halves().save(path, quality=95, exif=_exif(6))

    assert image_size(path) == (40, 60)
    im = open_image(path)
    assert im.mode == "RGB" and im.size == (40, 60)
    assert _close(im.getpixel((20, 5)), RED)
    assert _close(im.getpixel((20, 55)), BLUE)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt", ["png", "jpg", "webp"])
def test_image_size_matches_open_image_for_every_orientation(tmp_path, orientation, fmt):
    path = tmp_path / f"o{orientation}.{fmt}"
    _two_halves().save(path, exif=_exif(orientation))
    expected = (40, 60) if orientation in (5, 6, 7, 8) else (60, 40)
    assert image_size(path) == expected
    assert open_image(path).size == expected


def test_rgba_is_composited_onto_white(tmp_path):
    im = Image.new("RGBA", (3, 1))
    im.putpixel((0, 0), (255, 0, 0, 0))  # transparent: its colour must not show
    im.putpixel((1, 0), (0, 0, 255, 255))
    im.putpixel((2, 0), (0, 0, 0, 128))
    im.save(tmp_path / "a.png")
    out = open_image(tmp_path / "a.png")
    assert out.mode == "RGB"
    assert out.getpixel((0, 0)) == WHITE
    assert out.getpixel((1, 0)) == BLUE
    assert _close(out.getpixel((2, 0)), (127, 127, 127), tol=1)


def test_la_and_palette_transparency_become_white(tmp_path):
    la = Image.new("LA", (2, 1))
    la.putpixel((0, 0), (0, 0))
    la.putpixel((1, 0), (100, 255))
    la.save(tmp_path / "la.png")
    assert _pixels(open_image(tmp_path / "la.png")) == [WHITE, (100, 100, 100)]

    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 10, 200, 30])  # index 0 black, index 1 green
    pal.putpixel((1, 0), 1)
    pal.save(tmp_path / "p.png", transparency=0)
    assert _pixels(open_image(tmp_path / "p.png")) == [WHITE, (10, 200, 30)]


def test_greyscale_and_palette_without_alpha(tmp_path):
    Image.new("L", (2, 2), 77).save(tmp_path / "l.png")
    assert open_image(tmp_path / "l.png").getpixel((1, 1)) == (77, 77, 77)

    pal = Image.new("P", (1, 1))
    pal.putpalette([12, 34, 56])
    pal.save(tmp_path / "p.png")
    assert open_image(tmp_path / "p.png").getpixel((0, 0)) == (12, 34, 56)


def test_16_bit_greyscale_is_scaled_not_clipped(tmp_path):
    values = np.array([[0, 257 * 100, 40000, 65535]], dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"  # the path under test
    out = open_image(tmp_path / "g16.png")
    # 40000 / 65535 * 255 = 155.6 -> 156; Pillow's own convert would give 255 for all but 0.
    assert [p[0] for p in _pixels(out)] == [0, 100, 156, 255]


def test_32_bit_integer_mode_is_treated_as_16_bit(tmp_path):
    Image.fromarray(np.array([[30000, -5, 70000]], dtype=np.int32)).save(tmp_path / "i.tif")
    assert Image.open(tmp_path / "i.tif").mode == "I"
    assert [p[0] for p in _pixels(open_image(tmp_path / "i.tif"))] == [117, 0, 255]


def test_cmyk_jpeg_becomes_rgb(tmp_path):
    Image.new("CMYK", (16, 16), (0, 255, 255, 0)).save(tmp_path / "c.jpg", quality=95)
    out = open_image(tmp_path / "c.jpg")
    assert out.mode == "RGB"
    assert _close(out.getpixel((8, 8)), RED)


def test_unsupported_mode_is_refused(tmp_path):
    path = tmp_path / "f.tif"
    Image.fromarray(np.full((2, 2), 0.5, dtype=np.float32)).save(path)
    with pytest.raises(BadImageError, match="unsupported pixel mode 'F'") as info:
        open_image(path)
    assert str(info.value).startswith(f"{path}: ")


def _bad_files(tmp_path):
    """name -> path of files that open_image must refuse."""
    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    png, jpg = (_bytes_of(Image.fromarray(noise), fmt) for fmt in ("PNG", "JPEG"))
    contents = {
        "empty.png": b"",
        "garbage.jpg": b"this is a text file, not a JPEG\n" * 10,
        "truncated.png": png[: len(png) // 2],
        "truncated.jpg": jpg[: len(jpg) // 2],
    }
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
    return {name: tmp_path / name for name in contents}


@pytest.mark.parametrize(
    "name, reason",
    [
        ("empty.png", "the file is empty"),
        ("garbage.jpg", "not an image file"),
        ("truncated.png", "truncated or corrupt"),
        ("truncated.jpg", "truncated or corrupt"),
    ],
)
def test_bad_files_raise_bad_image_error_naming_the_file(tmp_path, name, reason):
    path = _bad_files(tmp_path)[name]
    with pytest.raises(BadImageError) as info:
        open_image(path)
    err = info.value
    assert isinstance(err, ImgloraError)
    assert err.path == path and reason in err.reason
    assert str(err).startswith(f"{path}: {err.reason}. ")
    assert "data.skip_bad_images" in str(err)  # says what to do


def test_image_size_reads_only_the_header_unless_asked_to_verify(tmp_path):
    files = _bad_files(tmp_path)
    for name in ("truncated.png", "truncated.jpg"):
        assert image_size(files[name]) == (64, 64)  # the header is intact
        with pytest.raises(BadImageError, match="truncated"):
            image_size(files[name], verify=True)
    for name in ("empty.png", "garbage.jpg"):
        with pytest.raises(BadImageError):
            image_size(files[name])


def test_missing_file(tmp_path):
    with pytest.raises(BadImageError, match="file not found"):
        open_image(tmp_path / "nope.png")


@pytest.mark.parametrize("pixels", [40 * 40, 100 * 100], ids=["warning", "error"])
def test_decompression_bomb_is_refused(tmp_path, monkeypatch, pixels):
    # Pillow warns above MAX_IMAGE_PIXELS and raises above twice that; both must be refused.
    path = tmp_path / "bomb.png"
    side = int(pixels**0.5)
    Image.new("RGB", (side, side)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for read in (open_image, image_size):
        with pytest.raises(BadImageError, match="too large") as info:
            read(path)
        assert str(info.value).startswith(f"{path}: ")


def test_file_sha256(tmp_path):
    data = bytes(range(256)) * 5000
    (tmp_path / "f.bin").write_bytes(data)
    assert file_sha256(tmp_path / "f.bin") == hashlib.sha256(data).hexdigest()
    assert file_sha256(tmp_path / "f.bin", chunk_size=7) == hashlib.sha256(data).hexdigest()
