"""Encoding one cache entry's images: a training image (and its loss mask and edit sources) fitted to
its bucket through the VAE, and the source images a text encoder reads with a caption."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .buckets import fit_to_bucket
from .images import image_alpha, open_image, open_mask
from .masks import latent_mask

if TYPE_CHECKING:
    import torch

    from ..family import CacheEncoder as Family


def encode_latent(family: "Family", vae: Any, spec: Any) -> dict[str, "torch.Tensor"]:
    """The latent entry of ``spec`` (a cache.LatentSpec)."""
    import numpy as np
    import torch

    path = spec.item.path
    mask = open_mask(spec.item.mask) if spec.item.mask else image_alpha(path) if spec.alpha_mask else None
    fit = fit_to_bucket(open_image(path), spec.item.bucket, crop=spec.crop, seed=spec.crop_seed, mask=mask)
    if spec.flip:
        fit = fit.flipped()
    pixels = torch.from_numpy(np.asarray(fit.image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)[None]
    out = family.encode_image(vae, pixels, std=True) if spec.posterior_std else family.encode_image(vae, pixels)
    if fit.mask is not None:  # weights per latent pixel, stored with the latents they weight
        out["loss_mask"] = latent_mask(fit.mask, tuple(out["latents"].shape[-2:]))
    if spec.item.controls:  # edit pairs: each source fitted to the target's bucket (same crop and flip)
        out["control_latents"] = torch.stack([_control(family, vae, spec, c) for c in spec.item.controls])
    # SDXL micro-conditioning, (h, w) / (top, left) as in the SDXL paper; harmless for other families.
    out["time_ids"] = torch.tensor([*fit.original_size, *fit.crop_top_left, *fit.target_size], dtype=torch.float32)
    return out


def source_views(spec: Any) -> list[Any]:
    """The source images of a text entry's (a cache.TextSpec's) image, fitted to its bucket as its latents' sources are
    (same crop; unflipped: flipped pairs are refused where the text encoder reads the sources)."""
    assert spec.item is not None
    return [fit_to_bucket(open_image(c), spec.item.bucket, crop=spec.crop, seed=spec.crop_seed).image
            for c in spec.item.controls]


def _control(family: "Family", vae: Any, spec: Any, path: Path) -> "torch.Tensor":
    import numpy as np
    import torch

    fit = fit_to_bucket(open_image(path), spec.item.bucket, crop=spec.crop, seed=spec.crop_seed)
    if spec.flip:
        fit = fit.flipped()
    pixels = torch.from_numpy(np.asarray(fit.image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)[None]
    return family.encode_image(vae, pixels)["latents"]
