"""The per-element and per-sample loss weights every image family applies the same way.

A batch may carry ``loss_mask`` (``[n, 1, h, w]`` on the latent grid: a loss mask resized with its
image, ``data.masks``) and ``loss_weight`` (``[n]``: ``data.prior_loss_weight`` for regularization
images); ``batches.stack`` fills in ones for the samples that have none. A family computes its
prediction and target, brings the mask into their layout (SDXL: as it is; FLUX: packed like the
latents) and calls these two functions, so the weighting is written once.
"""

from __future__ import annotations

import torch


def per_item_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error per batch item, over every other dimension, in fp32.

    ``mask`` (broadcastable to ``pred``) weights each element before the mean, as kohya sd-scripts'
    masked loss does: the mean stays over all elements, so an image whose mask keeps a quarter of it
    contributes a quarter of the loss, and an element weighted 0 gives no gradient at all.
    """
    err = (pred.float() - target.float()).pow(2)
    if mask is not None:
        err = err * mask.to(err.dtype)
    return err.mean(dim=tuple(range(1, err.ndim)))


def batch_loss(per_item: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's loss: each item's loss times its ``loss_weight`` (if the batch has one), averaged."""
    weight = batch.get("loss_weight")
    if weight is not None:
        per_item = per_item * weight.to(per_item.dtype)
    return per_item.mean()


def min_snr_weight(snr: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-γ's loss weight per sample (Hang et al. 2023): min(SNR, γ)/SNR for ε-prediction,
    min(SNR, γ)/(SNR + 1) for v-prediction.

    At SNR = 0 (t = 999 of a zero-terminal-SNR schedule) the ε-prediction weight is 0/0 in that form;
    kohya's and diffusers' scripts compute it so and get NaN about once in 1000 samples. Here it is
    that form wherever SNR > 0 (bit for bit) and its limit, 1, at SNR = 0."""
    clipped = torch.clamp(snr, max=gamma)
    if prediction_type == "epsilon":
        weight = clipped / snr
        return torch.where(snr > 0, weight, torch.ones_like(weight))
    return clipped / (snr + 1)
