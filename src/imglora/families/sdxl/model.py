"""SDXL's trained module and loss: the UNet, epsilon / v-prediction, min-SNR-γ, noise offset."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._shared import weighting
from ...errors import ImgloraError
from ...util.owned import own_module
from ...util.rng import draws
from ...models.tiny import random_init
from . import singlefile

if TYPE_CHECKING:
    from ...models.source import ModelSource

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json, for benchmarks before a download.
FULL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10), cross_attention_dim=2048,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
    use_linear_projection=True, norm_num_groups=32,
)


def load_trainable(src: "ModelSource", cfg: Any, dtype: torch.dtype) -> "SdxlTrainable":
    from diffusers import DDPMScheduler, UNet2DConditionModel

    if src.files:
        unet = singlefile.load_part(src, "unet", dtype)
    else:
        unet = own_module(UNet2DConditionModel.from_pretrained(src.root, subfolder="unet", torch_dtype=dtype))
    if cfg.memory.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    # The training-time view of the noise schedule; the pipeline's sampler config only contributes
    # the betas and the prediction type.
    scheduler = DDPMScheduler.from_pretrained(src.root, subfolder="scheduler", **scheduler_overrides(src, cfg))
    return SdxlTrainable(unet, scheduler, cfg.family, cfg.train)


def sampler_overrides(src: "ModelSource", cfg: Any) -> dict[str, Any]:
    """The evaluation sampler's scheduler settings: the model's (scheduler_overrides), and for a
    zero-terminal-SNR model "trailing" timestep spacing, so that sampling starts from t = 999 (pure
    noise, where such a model was trained to start) and not at 951 as SDXL's "leading" spacing does
    at 20 steps (Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are Flawed";
    diffusers' recommendation for these models)."""
    import json

    out = scheduler_overrides(src, cfg)
    config = json.loads((src.root / "scheduler" / "scheduler_config.json").read_text())
    if out.get("rescale_betas_zero_snr", config.get("rescale_betas_zero_snr", False)):
        out["timestep_spacing"] = "trailing"
    return out


def scheduler_overrides(src: "ModelSource", cfg: Any) -> dict[str, Any]:
    """What the model says beyond its scheduler config: a single file's v-prediction and zero
    terminal SNR marks (diffusers reads neither), then [sdxl] prediction_type if set."""
    out: dict[str, Any] = {}
    if src.files:
        prediction, ztsnr = singlefile.file_prediction_type(src)
        out["prediction_type"] = prediction
        if ztsnr:
            out["rescale_betas_zero_snr"] = True
    if cfg.family.prediction_type != "auto":
        out["prediction_type"] = cfg.family.prediction_type
    return out


def full_trainable(cfg: Any, dtype: torch.dtype, device: torch.device | None = None, family: Any = None) -> "SdxlTrainable":
    """The real SDXL UNet architecture with random weights (no download), for benchmarks.

    On CUDA the weights are made on the GPU one UNet stage at a time (each down block, the mid
    block, each up block), each quantized there with ``memory.fp8``
    (``diffusers_image.random_on_device``; SDXL has no swappable blocks, so nothing
    is swapped). Elsewhere the whole UNet is made on the host, as before."""
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from ...memory.swap import NO_SWAP
    from .._shared.diffusers_image import builds_on_device, random_on_device

    with torch.device("meta"):
        unet = UNet2DConditionModel(**FULL_UNET)
    facts: dict[str, Any] = {}
    if builds_on_device(device):
        parts = ([f"down_blocks.{i}" for i in range(len(unet.down_blocks))] + ["mid_block"]
                 + [f"up_blocks.{i}" for i in range(len(unet.up_blocks))])
        unet, facts = random_on_device(family, unet, cfg, dtype, device, parts, NO_SWAP)
    else:
        unet = random_init(unet, dtype)
    if cfg.memory.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000)
    trainable = SdxlTrainable(unet, scheduler, cfg.family, cfg.train)
    if facts:
        trainable.facts["full_build"] = facts
    return trainable


def synthetic_batch(trainable: "SdxlTrainable", resolution: int, cfg: Any,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Random tensors shaped like one cached sample, for benchmarks without a cache."""
    c = trainable.model.config
    n, r = cfg.train.batch_size, resolution
    g = torch.Generator().manual_seed(0)
    pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
    text = {key: torch.zeros(n, 77, dtype=torch.long) for key in TOKEN_KEYS} if trainable.text_encoders else {
        "prompt_embeds": torch.randn(n, 77, c.cross_attention_dim, generator=g),
        "pooled_prompt_embeds": torch.randn(n, pooled, generator=g)}  # (trained encoders: tokens instead)
    return {k: v.to(device) for k, v in {
        "latents": torch.randn(n, c.in_channels, r // 8, r // 8, generator=g), **text,
        "time_ids": torch.tensor([[r, r, 0, 0, r, r]] * n, dtype=torch.float32),
    }.items()}


TOKEN_KEYS = ("input_ids", "input_ids_2")  # a batch's tokens for CLIP-L and CLIP-G (lora.text_encoder)


class SdxlTrainable:
    """The UNet and the epsilon / v-prediction loss on cached latents and text embeddings (or, with
    lora.text_encoder, on embeddings the adapted text encoders give for the batch's tokens)."""

    def __init__(self, unet: Any, scheduler: Any, settings: Any, train: Any = None):
        self.model = unet
        self.train = train  # [train]: the loss type (None: l2)
        self.text_encoders: dict[str, torch.nn.Module] = {}
        self.prediction_type = scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ImgloraError(f"scheduler/scheduler_config.json: prediction_type {self.prediction_type!r} is not "
                               "supported for SDXL training (epsilon or v_prediction)")
        self.num_timesteps = scheduler.config.num_train_timesteps
        self.alphas_cumprod = scheduler.alphas_cumprod.to(torch.float32)
        self.noise_offset = settings.noise_offset
        self.min_snr_gamma = settings.min_snr_gamma
        self.facts = {"prediction_type": self.prediction_type,
                      "zero_terminal_snr": bool(getattr(scheduler.config, "rescale_betas_zero_snr", False))}

    def encode_text(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """As SdxlFamily.encode_text, batched and differentiable: the penultimate hidden states of both
        encoders, concatenated, and CLIP-G's projected pooled output."""
        te1, te2 = self.text_encoders["text_encoder"], self.text_encoders["text_encoder_2"]
        out1 = te1(batch["input_ids"], output_hidden_states=True)
        out2 = te2(batch["input_ids_2"], output_hidden_states=True)
        return {"prompt_embeds": torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1),
                "pooled_prompt_embeds": out2.text_embeds}

    def loss(self, batch: dict[str, torch.Tensor], generator: Any) -> torch.Tensor:
        if self.text_encoders:
            batch = {**batch, **self.encode_text(batch)}
        latents = batch["latents"]
        device, n = latents.device, latents.shape[0]
        rng = draws(generator)  # a torch.Generator, or one generator per sample (imglora.util.rng)
        noise = rng.randn(latents.shape, device=device, dtype=latents.dtype)
        if self.noise_offset:
            # A per-channel constant shift teaches the model to change overall brightness.
            noise = noise + self.noise_offset * rng.randn((n, latents.shape[1], 1, 1), device=device,
                                                          dtype=latents.dtype)
        t = rng.randint(0, self.num_timesteps, (n,), device=device)
        if self.alphas_cumprod.device != device:  # once: a per-step host-to-device copy would sync
            self.alphas_cumprod = self.alphas_cumprod.to(device)
        abar = self.alphas_cumprod[t].view(n, 1, 1, 1)
        noisy = abar.sqrt() * latents + (1 - abar).sqrt() * noise
        target = noise if self.prediction_type == "epsilon" else abar.sqrt() * noise - (1 - abar).sqrt() * latents
        dtype = self.model.dtype
        pred = self.model(
            noisy.to(dtype), t, encoder_hidden_states=batch["prompt_embeds"].to(dtype),
            added_cond_kwargs={"text_embeds": batch["pooled_prompt_embeds"].to(dtype),
                               "time_ids": batch["time_ids"].to(dtype)},
        ).sample
        per_item = weighting.per_item_loss(pred, target, batch.get("loss_mask"), self.train, lambda: (
            t.float() / self.num_timesteps, ((1 - abar) / abar).sqrt().view(n)))
        if self.min_snr_gamma:
            snr = abar.view(n) / (1 - abar.view(n))
            per_item = per_item * weighting.min_snr_weight(snr, self.min_snr_gamma, self.prediction_type)
        return weighting.batch_loss(per_item, batch)


def meta_trainable(root: "Path | None", cfg: Any, dtype: torch.dtype) -> "SdxlTrainable":
    """The UNet of ``root`` (a model or config folder; None: SDXL base 1.0's shipped config) on the
    meta device, frozen, with the preset's gradient checkpointing: for ``imglora plan``."""
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from ...models.safefiles import diffusers_config

    root = root or singlefile.SHIPPED
    config = diffusers_config(UNet2DConditionModel, root, "unet")
    with torch.device("meta"):
        unet = torch.nn.Module.to(UNet2DConditionModel.from_config(config), dtype)  # (no diffusers warning)
    unet.requires_grad_(False)
    if cfg.memory.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    scheduler = DDPMScheduler.from_config(DDPMScheduler.load_config(str(root), subfolder="scheduler"))
    trainable = SdxlTrainable(unet, scheduler, cfg.family, cfg.train)
    if cfg.lora.text_encoder:
        from .._shared import diffusers_image
        from . import SdxlFamily

        trainable.text_encoders = diffusers_image.meta_text_encoders(SdxlFamily, root, singlefile.SHIPPED, dtype)
    return trainable
