"""buckets.py: bucket sets, assignment by aspect ratio, and fitting an image into its bucket."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from imglora.data.buckets import FitResult, assign_bucket, fit_to_bucket, flip, make_buckets


@pytest.mark.parametrize("resolution, step", [(1024, 64), (1024, 16), (768, 32), (512, 64)])
def test_bucket_set_properties(resolution, step):
    buckets = make_buckets(resolution, step)
    assert buckets == sorted(set(buckets))
    assert (resolution, resolution) in buckets
    for w, h in buckets:
        assert w * h <= resolution**2
        assert w % step == 0 and h % step == 0
        assert 256 <= w <= 2048 and 256 <= h <= 2048
        assert (h, w) in buckets  # symmetric: portrait and landscape treated alike
    # Maximal: the tallest bucket of each width cannot grow by a step without breaking a limit.
    for width in {w for w, _ in buckets}:
        tallest = max(h for w, h in buckets if w == width)
        assert width * (tallest + step) > resolution**2 or tallest + step > 2048


def test_known_sdxl_buckets():
    buckets = make_buckets(1024, 64)
    # The SDXL paper's training buckets around 1:1 .. 16:9, and both extremes.
    for bucket in [(1024, 1024), (1152, 896), (1216, 832), (1344, 768), (1280, 768), (832, 1216),
                   (768, 1344), (256, 2048), (2048, 256)]:
        assert bucket in buckets


def test_small_resolutions_clamp_min_side():
    assert make_buckets(128, 16) == [(128, 128)]  # min_side 256 lowered to 128
    assert make_buckets(128, 64) == [(128, 128)]
    small = make_buckets(128, 16, min_side=64)
    assert (128, 128) in small and (192, 80) in small and len(small) > 5
    assert all(w * h <= 128 * 128 and w >= 64 and h >= 64 for w, h in small)
    # A resolution that is not a multiple of the step still yields buckets, just no square.
    assert make_buckets(100, 64) == [(64, 128), (128, 64)]


def test_invalid_step():
    with pytest.raises(ValueError):
        make_buckets(128, 0)
    with pytest.raises(ValueError):
        make_buckets(64, 128)


def test_assign_bucket_by_aspect_ratio():
    buckets = make_buckets(1024, 64)
    assert assign_bucket(1500, 1000, buckets) == (1216, 832)  # 3:2 -> 1.46
    assert assign_bucket(1000, 1500, buckets) == (832, 1216)  # 2:3
    assert assign_bucket(777, 777, buckets) == (1024, 1024)
    assert assign_bucket(4000, 100, buckets) == (2048, 256)  # extreme: the widest bucket


def test_assign_bucket_ties():
    # Equal aspect ratio: the larger area wins (less upscaling), whatever the list order.
    assert assign_bucket(50, 50, [(128, 128), (96, 96)]) == (128, 128)
    assert assign_bucket(50, 50, [(96, 96), (128, 128)]) == (128, 128)
    # Mirror-image buckets are equally far from 1:1 and equally large: the wider one wins.
    assert assign_bucket(50, 50, [(64, 128), (128, 64)]) == (128, 64)
    assert assign_bucket(50, 50, [(128, 64), (64, 128)]) == (128, 64)


def _bands(widths_colours, height=128):
    """Vertical colour bands, left to right, to see which columns a crop kept."""
    im = Image.new("RGB", (sum(w for w, _ in widths_colours), height))
    left = 0
    for width, colour in widths_colours:
        im.paste(colour, (left, 0, left + width, height))
        left += width
    return im


def test_fit_to_bucket_center_crop():
    # 256x128 into 128x128: no resize needed, 128 columns to drop, 64 from each side.
    im = _bands([(64, (255, 0, 0)), (128, (0, 255, 0)), (64, (0, 0, 255))])
    fit = fit_to_bucket(im, (128, 128))
    assert isinstance(fit, FitResult)
    assert fit.image.size == (128, 128) and fit.image.mode == "RGB"
    assert fit.original_size == (128, 256)  # (h, w)
    assert fit.crop_top_left == (0, 64)  # (top, left)
    assert fit.target_size == (128, 128)
    assert fit.resized_size == (128, 256)
    assert np.all(np.asarray(fit.image) == (0, 255, 0))


def test_fit_to_bucket_resizes_to_cover_then_crops():
    fit = fit_to_bucket(Image.new("RGB", (300, 200), "white"), (128, 96))
    # Cover: scale max(128/300, 96/200) = 0.48 -> 144x96, then 16 spare columns.
    assert fit.resized_size == (96, 144)
    assert fit.crop_top_left == (0, 8)
    assert fit.image.size == (128, 96)
    assert fit.original_size == (200, 300) and fit.target_size == (96, 128)

    tall = fit_to_bucket(Image.new("RGB", (40, 90), "white"), (64, 128))  # upscaled
    assert tall.image.size == (64, 128)
    assert tall.resized_size == (144, 64) and tall.crop_top_left == (8, 0)


def test_random_crop_is_deterministic_per_seed():
    im = _bands([(400, (9, 9, 9))])

    def offset(seed):
        return fit_to_bucket(im, (128, 128), crop="random", seed=seed).crop_top_left

    assert offset(7) == offset(7)
    offsets = {offset(seed) for seed in range(20)}
    assert len(offsets) > 5  # the seed matters
    assert all(top == 0 and 0 <= left <= 272 for top, left in offsets)


def test_flip_and_flipped_fit():
    im = _bands([(32, (255, 0, 0)), (224, (0, 255, 0))])
    assert flip(im).getpixel((255, 0)) == (255, 0, 0)

    fit = fit_to_bucket(im, (128, 128), crop="random", seed=3)
    flipped = fit.flipped()
    top, left = fit.crop_top_left
    assert flipped.crop_top_left == (top, 256 - left - 128)
    # The mirrored offset describes the same pixels in the mirrored resized image.
    region = flip(im).crop((256 - left - 128, 0, 256 - left, 128))
    assert np.array_equal(np.asarray(flipped.image), np.asarray(region))
    assert flipped.original_size == fit.original_size and flipped.target_size == fit.target_size


def test_fit_to_bucket_rejects_bad_arguments():
    with pytest.raises(ValueError, match="crop"):
        fit_to_bucket(Image.new("RGB", (10, 10)), (8, 8), crop="top")
    with pytest.raises(ValueError, match="RGB"):
        fit_to_bucket(Image.new("L", (10, 10)), (8, 8))
