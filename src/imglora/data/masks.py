"""Loss masks: a greyscale image per training image (``mask_dir``, same file stem) or the image's own
alpha channel (``alpha_mask``), found and checked when the dataset is scanned, and brought to the
latents' size when the image is encoded.

White (255) trains a pixel fully, black (0) not at all, grey in between; transparent = black. The
mask is resized and cropped with its image into the bucket (``buckets.fit_to_bucket``), then
averaged over each latent pixel's 8×8 image pixels, so the loss is weighted per latent pixel (as
kohya sd-scripts' masked loss, which averages the mask over the latent grid the same way).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from .dataset import IMAGE_EXTENSIONS, DatasetItem, _first
from .images import BadImageError, image_alpha, image_size, open_mask

if TYPE_CHECKING:
    import torch
    from PIL import Image


def attach_masks(items: list[DatasetItem], root: Path, mask_dir: Path, key: str,
                 problems: list[str], warnings: list[str]) -> list[DatasetItem]:
    """Each item with its mask from ``mask_dir`` (the same relative folder and stem as the image,
    else the same stem at the top of ``mask_dir``), checked: readable, the image's size, not all
    black. A missing mask is a warning (that image trains on every pixel); a bad one a problem."""
    if not mask_dir.is_dir():
        problems.append(f"{mask_dir}: {key} is not a folder; it must hold one mask image per training image")
        return items
    out, missing = [], []
    for item in items:
        mask = find_mask(item.path, root, mask_dir)
        if mask is None:
            missing.append(item.path.name)
            out.append(item)
            continue
        if _check_mask(item, mask, problems):
            out.append(replace(item, mask=mask))
    if missing:
        warnings.append(f"{len(missing)} image(s) have no mask in {mask_dir} and train on every pixel: "
                        f"{_first(missing)}; add <same name>.png there (white = train, black = ignore)")
    return out


def find_mask(image: Path, root: Path, mask_dir: Path) -> Path | None:
    rel = image.relative_to(root)
    for folder in dict.fromkeys((mask_dir / rel.parent, mask_dir)):
        for ext in IMAGE_EXTENSIONS:
            for candidate in (folder / f"{image.stem}{ext}", folder / f"{image.stem}{ext.upper()}"):
                if candidate.is_file():
                    return candidate
    return None


def _check_mask(item: DatasetItem, mask: Path, problems: list[str]) -> bool:
    try:
        size = image_size(mask)
        if size != item.size:
            problems.append(f"{mask}: the mask is {size[0]}x{size[1]} but its image {item.path.name} is "
                            f"{item.size[0]}x{item.size[1]}; a mask must have its image's size (resize it with "
                            "the image, or export both again)")
            return False
        grey = open_mask(mask)
    except BadImageError as exc:
        problems.append(str(exc))
        return False
    if grey.getextrema()[1] == 0:
        problems.append(f"{mask}: the mask is all black, so {item.path.name} would train on nothing; white marks "
                        "what to train (invert the mask if it is the wrong way round), or remove the image")
        return False
    return True


def check_alpha(items: list[DatasetItem], problems: list[str], warnings: list[str]) -> None:
    """With ``alpha_mask``: an image without transparency trains on every pixel (a warning); a fully
    transparent one on nothing (a problem)."""
    opaque = []
    for item in items:
        try:
            alpha = image_alpha(item.path)
        except BadImageError as exc:
            problems.append(str(exc))
            continue
        if alpha is None:
            opaque.append(item.path.name)
        elif alpha.getextrema()[1] == 0:
            problems.append(f"{item.path}: the image is fully transparent, so with alpha_mask it would train on "
                            "nothing; remove it or give it an alpha channel that keeps the subject")
    if opaque:
        warnings.append(f"{len(opaque)} image(s) have no alpha channel and train on every pixel (alpha_mask): "
                        f"{_first(opaque)}; save them as PNG with transparency where the loss should be ignored")


def latent_mask(mask: "Image.Image", size: tuple[int, int]) -> "torch.Tensor":
    """``[1, h, w]`` float32 in [0, 1]: the bucket-sized mask averaged over each latent pixel."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    pixels = torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)[None, None]
    return F.interpolate(pixels, size=tuple(size), mode="area")[0].contiguous()
