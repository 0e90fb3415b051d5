"""SDXL: UNet LoRA on cached VAE latents and cached CLIP-L + CLIP-G outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from . import diffusers_common as common


class SdxlFamily:
    name: ClassVar[str] = "sdxl"
    bucket_step: ClassVar[int] = 64
    text_max_length: ClassVar[int] = 77
    lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    quantize_exclude: ClassVar[tuple[str, ...]] = ("conv_in", "conv_out", "time_embedding*", "add_embedding*")
    swappable_blocks: ClassVar[tuple[str, ...]] = ()
    pipeline: ClassVar[str] = "StableDiffusionXLPipeline"
    lora_scope: ClassVar[str] = ""  # regex prefix limiting lora_targets
    denoiser: ClassVar[str] = "unet"

    # Shared with the other diffusers image family (see diffusers_common).
    vae_folders = common.vae_folders
    text_folders = common.text_folders
    load_vae = common.load_vae
    prepare_data = common.prepare_data
    data_version = common.data_version
    collate = common.collate
    save_adapter = common.save_adapter
    read_adapter = common.read_adapter
    default_prompts = common.default_prompts
    encode_prompts = common.encode_prompts

    # -- cache ------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_image(self, vae: Any, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        # The distribution's mean, not a sample: the cache entry is then a pure function of its key.
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
        return {"latents": (latents[0] * vae.config.scaling_factor).float().cpu()}

    def load_text_encoders(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        return (
            CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer"),
            CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer_2"),
            CLIPTextModel.from_pretrained(model_dir, subfolder="text_encoder", torch_dtype=dtype).to(device).eval(),
            CLIPTextModelWithProjection.from_pretrained(model_dir, subfolder="text_encoder_2",
                                                        torch_dtype=dtype).to(device).eval(),
        )

    @torch.no_grad()
    def encode_text(self, encoders: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]:
        # As StableDiffusionXLPipeline.encode_prompt: penultimate hidden states of both encoders,
        # concatenated, and the projected pooled output of the second.
        tok1, tok2, te1, te2 = encoders
        hidden = []
        pooled = None
        for tok, te in ((tok1, te1), (tok2, te2)):
            ids = tok(caption, padding="max_length", max_length=max_length, truncation=True,
                      return_tensors="pt").input_ids.to(te.device)
            out = te(ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            if te is te2:
                pooled = out.text_embeds
        return {"prompt_embeds": torch.cat(hidden, dim=-1)[0].cpu(), "pooled_prompt_embeds": pooled[0].cpu()}

    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]:
        """Tokens of the caption (with BOS/EOS) against what each encoder reads."""
        tok1, tok2, _, _ = encoders
        return {"CLIP-L": (len(tok1(caption).input_ids), max_length),
                "CLIP-G": (len(tok2(caption).input_ids), max_length)}

    # -- training ---------------------------------------------------------------------------
    def load_trainable(self, model_dir: Path, cfg: Any, device: torch.device, dtype: torch.dtype) -> "SdxlTrainable":
        from diffusers import DDPMScheduler, UNet2DConditionModel

        unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet", torch_dtype=dtype)
        if cfg.memory.gradient_checkpointing:
            unet.enable_gradient_checkpointing()
        # The training-time view of the noise schedule; the pipeline's sampler config only
        # contributes the betas and the prediction type.
        scheduler = DDPMScheduler.from_pretrained(model_dir, subfolder="scheduler")
        return SdxlTrainable(unet, scheduler, cfg.train)

    def full_trainable(self, cfg: Any, dtype: torch.dtype) -> "SdxlTrainable":
        """The real SDXL UNet architecture with random weights (no download), for benchmarks."""
        from diffusers import DDPMScheduler, UNet2DConditionModel

        with torch.device("meta"):
            unet = UNet2DConditionModel(**FULL_UNET)
        unet = common.random_init(unet, dtype)
        if cfg.memory.gradient_checkpointing:
            unet.enable_gradient_checkpointing()
        scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                  num_train_timesteps=1000)
        return SdxlTrainable(unet, scheduler, cfg.train)

    def synthetic_batch(self, trainable: "SdxlTrainable", resolution: int, cfg: Any,
                        device: torch.device) -> dict[str, torch.Tensor]:
        """Random tensors shaped like one cached sample, for benchmarks without a cache."""
        c = trainable.model.config
        n, r = cfg.train.batch_size, resolution
        g = torch.Generator().manual_seed(0)
        pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
        return {k: v.to(device) for k, v in {
            "latents": torch.randn(n, c.in_channels, r // 8, r // 8, generator=g),
            "prompt_embeds": torch.randn(n, 77, c.cross_attention_dim, generator=g),
            "pooled_prompt_embeds": torch.randn(n, pooled, generator=g),
            "time_ids": torch.tensor([[r, r, 0, 0, r, r]] * n, dtype=torch.float32),
        }.items()}

    # -- evaluation (imglora eval, a separate process: see evaluate.py) ----------------------
    def load_sampler(self, model_dir: Path, model: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Any:
        from ..evaluate import diffusers_sampler

        # Classifier-free guidance 7 unless eval.guidance_scale says otherwise.
        return diffusers_sampler(self, model_dir, model, cfg, device, dtype, default_guidance=7.0)


# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json, for benchmarks before a download.
FULL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10), cross_attention_dim=2048,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
    use_linear_projection=True, norm_num_groups=32,
)


class SdxlTrainable:
    """The UNet and the epsilon / v-prediction loss on cached latents and text embeddings."""

    def __init__(self, unet: Any, scheduler: Any, train: Any):
        self.model = unet
        self.prediction_type = scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction"):
            from ..errors import ImgloraError

            raise ImgloraError(f"scheduler/scheduler_config.json: prediction_type {self.prediction_type!r} is not "
                               "supported for SDXL training (epsilon or v_prediction)")
        self.num_timesteps = scheduler.config.num_train_timesteps
        self.alphas_cumprod = scheduler.alphas_cumprod.to(torch.float32)
        self.noise_offset = train.noise_offset
        self.min_snr_gamma = train.min_snr_gamma

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> torch.Tensor:
        latents = batch["latents"]
        device, n = latents.device, latents.shape[0]
        noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
        if self.noise_offset:
            # A per-channel constant shift teaches the model to change overall brightness.
            noise = noise + self.noise_offset * torch.randn((n, latents.shape[1], 1, 1), generator=generator,
                                                            device=device, dtype=latents.dtype)
        t = torch.randint(0, self.num_timesteps, (n,), generator=generator, device=device)
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
        per_item = (pred.float() - target.float()).pow(2).mean(dim=(1, 2, 3))
        if self.min_snr_gamma:
            snr = abar.view(n) / (1 - abar.view(n))
            clipped = torch.clamp(snr, max=self.min_snr_gamma)
            # Min-SNR-γ (Hang et al. 2023): ε-prediction weight min(snr, γ)/snr; v-prediction min(snr, γ)/(snr+1).
            per_item = per_item * (clipped / snr if self.prediction_type == "epsilon" else clipped / (snr + 1))
        return per_item.mean()
