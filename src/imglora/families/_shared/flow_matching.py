"""Flow matching on packed latents, as FLUX.1 trains and the families trained the same way (Chroma,
Qwen-Image): the latents packed in 2×2 patches, noise levels drawn by kohya sd-scripts' options, the
noisy point between data and noise, and the loss of a prediction of ``noise - x0``; and the preset
keys of that objective (a family's section inherits ``FlowMatchingObjective``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from ...config import setting
from ...util.rng import draws
from . import weighting


@dataclass(frozen=True)
class FlowMatchingObjective:
    """The keys of a flow-matching objective on packed latents: how timesteps are drawn and how the
    loss is weighted over them (FLUX.1's, and the families trained the same way)."""

    timestep_sampling: Literal["sigmoid", "logit_normal", "uniform", "shift"] = setting(
        "shift", help="How training timesteps are drawn.", moved_from="train.timestep_sampling")
    sigmoid_scale: float = setting(1.0, help="Scale of the normal draw for sigmoid/shift sampling.", min=0.0,
                                   max=100.0, min_exclusive=True, moved_from="train.sigmoid_scale")
    discrete_flow_shift: float = setting(3.1582, help="Shift for timestep_sampling = \"shift\".", min=0.0,
                                         max=100.0, min_exclusive=True, moved_from="train.discrete_flow_shift")
    resolution_dependent_shift: bool = setting(False, help="Derive the shift from the image size as FLUX.1-dev "
                                                           "inference does.",
                                               moved_from="train.resolution_dependent_shift")
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = setting(
        "none", help="Weighting of the flow-matching loss over noise levels (as SD3 / kohya).",
        moved_from="train.loss_weighting")


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] → [B, (H/2)(W/2), 4C]: FLUX sees 2×2 latent patches as tokens."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def resolution_shift_mu(image_seq_len: int) -> float:
    """FLUX.1-dev's inference shift: linear in the token count from (256, 0.5) to (4096, 1.15)."""
    return 0.5 + (1.15 - 0.5) * (image_seq_len - 256) / (4096 - 256)


def sample_sigmas(n: int, settings: Any, image_seq_len: int, generator: Any, device: torch.device,
                  shift_mu: Callable[[int], float] = resolution_shift_mu) -> torch.Tensor:
    """Noise levels σ ∈ (0, 1) for flow matching (kohya sd-scripts' options, same formulas).
    ``generator``: a ``torch.Generator`` or an ``imglora.util.rng`` per-sample source; ``shift_mu``: the
    model's resolution-dependent shift (FLUX.1-dev's by default)."""
    rng = draws(generator)
    kind = settings.timestep_sampling
    if kind == "uniform":
        return rng.rand((n,), device=device)
    if kind == "logit_normal":  # SD3's default: sigmoid of a standard normal
        return torch.sigmoid(rng.randn((n,), device=device))
    s = torch.sigmoid(settings.sigmoid_scale * rng.randn((n,), device=device))
    if kind == "sigmoid":
        return s
    if settings.resolution_dependent_shift:
        mu = shift_mu(image_seq_len)
        return math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    shift = settings.discrete_flow_shift
    return s * shift / (1 + (shift - 1) * s)


def flow_matching_loss(settings: Any, batch: dict[str, torch.Tensor], pred: torch.Tensor, noise: torch.Tensor,
                       x0: torch.Tensor, sigma: torch.Tensor, train: Any = None,
                       layout: Callable[[torch.Tensor], torch.Tensor] = pack_latents) -> torch.Tensor:
    """The loss of a prediction of ``noise - x0`` on tokens: per element (``train.loss_type``, the
    loss mask in the latents' token ``layout``: 2×2 patches by default), per item (weighted over
    noise levels), per batch (loss weights)."""
    latents = batch["latents"]
    mask = batch.get("loss_mask")
    if mask is not None:  # [n, 1, h, w] -> the token layout of the latents, one weight per element
        mask = layout(mask.expand(-1, latents.shape[1], -1, -1).contiguous())
    per_item = weighting.per_item_loss(pred, noise - x0, mask, train, lambda: (sigma, sigma / (1 - sigma)))
    if settings.loss_weighting == "sigma_sqrt":
        per_item = per_item * sigma.pow(-2.0)
    elif settings.loss_weighting == "cosmap":
        per_item = per_item * 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))
    return weighting.batch_loss(per_item, batch)


def noised(settings: Any, latents: torch.Tensor, generator: Any,
           shift_mu: Callable[[int], float] = resolution_shift_mu) -> tuple[torch.Tensor, ...]:
    """(x0, noise, sigma, noisy): the packed latents, the noise and noise levels drawn (noise first,
    then σ, from ``generator``), and the point between them that the transformer denoises."""
    n = latents.shape[0]
    x0 = pack_latents(latents)
    noise = draws(generator).randn(x0.shape, device=latents.device, dtype=x0.dtype)
    sigma = sample_sigmas(n, settings, x0.shape[1], generator, latents.device, shift_mu)
    s = sigma.view(n, 1, 1)
    return x0, noise, sigma, (1 - s) * x0 + s * noise
