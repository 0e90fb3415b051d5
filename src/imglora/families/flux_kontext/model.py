"""FLUX.1 Kontext's loss: FLUX.1's flow matching, with the source image's packed latent tokens
appended after the noisy ones, as ``FluxKontextPipeline`` builds its input: the same 2×2 packing,
position ids ``(1, row, column)`` (the first id 1 marks them as the reference), the transformer's
prediction for the noisy tokens only. The source tokens are clean (never noised) and take no loss."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import ModelSourceError
from ..flux.model import FluxTrainable, image_ids, pack_latents
from ..flux.model import synthetic_batch as flux_batch


class KontextTrainable(FluxTrainable):
    def __init__(self, transformer: Any, settings: Any, train: Any = None):
        if not transformer.config.guidance_embeds:
            raise ModelSourceError("this transformer has no guidance embedding (a FLUX.1-schnell one); FLUX.1 Kontext "
                                   "[dev] is built on FLUX.1-dev: give black-forest-labs/FLUX.1-Kontext-dev or its "
                                   "flux1-kontext-dev.safetensors")
        super().__init__(transformer, settings, train)
        self.facts = {"variant": "kontext-dev"}

    def reference_tokens(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        control = batch["control_latents"][:, 0]  # [n, C, h, w]: Kontext takes one source image
        _, _, h, w = control.shape
        ids = image_ids(h, w, control.device)
        ids[:, 0] = 1
        return pack_latents(control), ids


def synthetic_batch(trainable: Any, resolution: int, cfg: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """FLUX.1's synthetic batch with a source image of the target's size (twice the image tokens)."""
    batch = flux_batch(trainable, resolution, cfg, device)
    g = torch.Generator().manual_seed(1)
    batch["control_latents"] = torch.randn(batch["latents"][:, None].shape, generator=g).to(device)
    return batch
