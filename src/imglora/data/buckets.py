"""Aspect-ratio buckets: train each image near its own shape instead of squashing it to a square.

SIZE CONVENTIONS -- two orders are in use, on purpose, and mixing them up silently trains on
transposed conditioning:

* ``(width, height)``: buckets, ``make_buckets``, ``assign_bucket`` and everything PIL
  (``Image.size``, ``Image.resize``).
* ``(height, width)`` and ``(top, left)``: the three fields of ``FitResult`` that feed SDXL's
  micro-conditioning (``add_time_ids`` = original_size + crop_top_left + target_size, each as
  (h, w) / (top, left), as in the SDXL paper and diffusers), plus ``FitResult.resized_size``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from PIL import Image

CROP_MODES = ("center", "random")


def make_buckets(
    resolution: int, step: int, min_side: int = 256, max_side: int = 2048
) -> list[tuple[int, int]]:
    """All maximal ``(width, height)`` buckets with area <= ``resolution**2``, sorted.

    Both sides are multiples of ``step`` within ``[min_side, max_side]``; for each width the
    bucket takes the largest such height that keeps the area within budget, so every bucket
    spends (nearly) the same number of pixels, and each such bucket's transpose is added so the
    set is symmetric. ``min_side`` is lowered to ``resolution`` and
    ``max_side`` raised to it when they exclude it, so small test resolutions still work, the
    list is never empty, and the square ``(resolution, resolution)`` is present whenever
    ``resolution`` is a multiple of ``step``.
    """
    if step <= 0 or resolution < step:
        raise ValueError(f"need 0 < step <= resolution, got step={step}, resolution={resolution}")
    # Smallest side: min_side rounded up to the step, but never above the square's side.
    lo = max(step, min(_round_up(min_side, step), resolution // step * step))
    hi = max(max_side, resolution) // step * step
    max_area = resolution * resolution
    buckets = set()
    for width in range(lo, hi + 1, step):
        height = min(max_area // width // step * step, hi)
        if height >= lo:
            # The transpose too (as kohya does): the sweep alone is lopsided -- width 768 gets
            # height 1344 but height 768 gets width 1280 -- and would bucket portrait photos
            # differently from the same photos turned landscape.
            buckets.update({(width, height), (height, width)})
    return sorted(buckets)


def assign_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The ``(width, height)`` bucket whose aspect ratio is closest to the image's.

    Distance is measured in log space so that 2:1 and 1:2 are equally far from 1:1. Ties go to
    the larger area (less upscaling), then to the wider bucket, so the choice is deterministic.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if not buckets:
        raise ValueError("no buckets to choose from")
    target = math.log(width / height)

    def key(bucket: tuple[int, int]) -> tuple[float, int, int]:
        # Rounded so that float noise cannot break a tie between mirror-image buckets.
        distance = round(abs(math.log(bucket[0] / bucket[1]) - target), 9)
        return (distance, -bucket[0] * bucket[1], -bucket[0])

    return min(buckets, key=key)


@dataclass(frozen=True)
class FitResult:
    """An image fitted to a bucket, plus the SDXL micro-conditioning that describes the fit.

    Every size here is ``(height, width)`` and the crop is ``(top, left)`` -- the reverse of PIL.

    image:          RGB, exactly the bucket's size.
    original_size:  (h, w) of the image before resizing.
    crop_top_left:  (top, left) of the crop, in pixels of the resized image.
    target_size:    (h, w) of the bucket.
    resized_size:   (h, w) of the image after resizing, before cropping.
    """

    image: Image.Image
    original_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    target_size: tuple[int, int]
    resized_size: tuple[int, int]
    mask: Image.Image | None = None  # the loss mask, resized and cropped as the image ("L", bucket size)

    def flipped(self) -> FitResult:
        """The same fit mirrored left-right, with the crop's left edge mirrored to match.

        After a flip the kept region starts ``resized_w - left - target_w`` pixels from the left
        of the (mirrored) resized image; keeping the old offset would describe a different crop.
        """
        top, left = self.crop_top_left
        mirrored_left = self.resized_size[1] - left - self.target_size[1]
        return replace(self, image=flip(self.image), crop_top_left=(top, mirrored_left),
                       mask=None if self.mask is None else flip(self.mask))


def fit_to_bucket(
    img: Image.Image, bucket: tuple[int, int], crop: str = "center", seed: int = 0,
    mask: Image.Image | None = None,
) -> FitResult:
    """Resize ``img`` to cover the ``(width, height)`` bucket, keeping its aspect, then crop.

    ``crop="center"`` crops equally from both sides; ``crop="random"`` draws the offset from
    ``random.Random(seed)``, so the same seed always gives the same crop (a latent cache keyed
    on the seed stays valid). A ``mask`` of the image's size goes through the same resize (an area
    average: each pixel's weight is the mean of the weights it covers, with no Lanczos ringing) and
    crop.
    """
    if mask is not None and mask.size != img.size:
        raise ValueError(f"the mask is {mask.size[0]}x{mask.size[1]}, its image {img.size[0]}x{img.size[1]}")
    if crop not in CROP_MODES:
        raise ValueError(f"crop must be one of {CROP_MODES}, got {crop!r}")
    if img.mode != "RGB":
        raise ValueError(f"expected an RGB image (see images.open_image), got mode {img.mode!r}")
    bucket_w, bucket_h = bucket
    width, height = img.size
    scale = max(bucket_w / width, bucket_h / height)
    # max() guards against rounding leaving the covering side one pixel short.
    resized_w = max(bucket_w, round(width * scale))
    resized_h = max(bucket_h, round(height * scale))
    if (resized_w, resized_h) != (width, height):
        img = img.resize((resized_w, resized_h), Image.Resampling.LANCZOS)

    spare_w, spare_h = resized_w - bucket_w, resized_h - bucket_h
    if crop == "center":
        top, left = spare_h // 2, spare_w // 2
    else:
        rng = random.Random(seed)
        top, left = rng.randint(0, spare_h), rng.randint(0, spare_w)
    box = (left, top, left + bucket_w, top + bucket_h)
    if mask is not None:
        if mask.size != (resized_w, resized_h):
            mask = mask.resize((resized_w, resized_h), Image.Resampling.BOX)
        mask = mask.crop(box)
    return FitResult(
        image=img.crop(box),
        original_size=(height, width),
        crop_top_left=(top, left),
        target_size=(bucket_h, bucket_w),
        resized_size=(resized_h, resized_w),
        mask=mask,
    )


def flip(img: Image.Image) -> Image.Image:
    """Mirror ``img`` left-right."""
    return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step
