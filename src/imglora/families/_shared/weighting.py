"""The per-element and per-sample loss weights every image family applies the same way.

A batch may carry ``loss_mask`` (``[n, 1, h, w]`` on the latent grid: a loss mask resized with its
image, ``data.masks``) and ``loss_weight`` (``[n]``: ``data.prior_loss_weight`` for regularization
images); ``batches.stack`` fills in ones for the samples that have none. A family computes its
prediction and target, brings the mask into their layout (SDXL: as it is; FLUX: packed like the
latents) and calls these two functions, so the weighting is written once.
"""

from __future__ import annotations

import math
from typing import Any, Callable

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


def per_item_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None, train: Any,
                  levels: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``train.loss_type``'s loss per batch item (kohya's ``conditional_loss``), masked and averaged
    as :func:`per_item_mse`, which it is for l2 (the default: the same computation as before).

    ``levels()`` gives each sample's noise level ``t`` in [0, 1] (SDXL: timestep / 1000; flow
    matching: σ) and its noise-to-signal ratio of standard deviations (SDXL: sqrt((1 - ᾱ)/ᾱ), kohya's
    "sigmas"; flow matching: σ/(1 - σ), the same quantity for x = (1 - σ)x₀ + σε, where kohya refuses
    the snr schedule), for huber / smooth_l1's threshold (:func:`huber_threshold`); only then called."""
    if train is None or train.loss_type == "l2":
        return per_item_mse(pred, target, mask)
    e = pred.float() - target.float()
    if train.loss_type == "l1":
        err = e.abs()
    else:
        c = huber_threshold(train, *levels()).to(e.device).view(-1, *([1] * (e.ndim - 1)))
        root = torch.sqrt(e.pow(2) + c.pow(2)) - c
        err = 2 * c * root if train.loss_type == "huber" else 2 * root
    if mask is not None:
        err = err * mask.to(err.dtype)
    return err.mean(dim=tuple(range(1, err.ndim)))


def huber_threshold(train: Any, t: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """The threshold c per sample, as kohya's ``get_huber_threshold_if_needed``: exponential
    huber_c^t · huber_scale (kohya: exp(-αT) with α = -ln(huber_c)/1000, T = 1000t); snr
    (1 - huber_c)/(1 + ratio)² + huber_c (huber_scale unused, as kohya's; c = huber_c where the
    ratio is infinite, at a zero-terminal-SNR t = 999); constant huber_c · huber_scale."""
    c = train.huber_c
    if train.huber_schedule == "exponential":
        return torch.exp(math.log(c) * t.float()) * train.huber_scale
    if train.huber_schedule == "snr":
        return (1 - c) / (1 + ratio.float()) ** 2 + c
    return torch.full(t.shape, c * train.huber_scale, dtype=torch.float32, device=t.device)


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
