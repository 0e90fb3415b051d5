"""FLUX.1-dev: flow-matching transformer LoRA on cached VAE latents and cached CLIP-L + T5 outputs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import torch

from . import diffusers_common as common


class FluxFamily:
    name: ClassVar[str] = "flux"
    bucket_step: ClassVar[int] = 16
    text_max_length: ClassVar[int] = 512
    lora_targets: ClassVar[tuple[str, ...]] = (
        # double blocks: image and text streams
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
        # single blocks
        "proj_mlp", "proj_out",
    )
    quantize_exclude: ClassVar[tuple[str, ...]] = (
        "x_embedder", "context_embedder", "time_text_embed*", "norm_out*", "proj_out",
    )
    swappable_blocks: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")
    pipeline: ClassVar[str] = "FluxPipeline"
    lora_scope: ClassVar[str] = r"(transformer_blocks|single_transformer_blocks)\.\d+\."  # regex prefix limiting lora_targets
    denoiser: ClassVar[str] = "transformer"

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
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
        latents = (latents[0] - vae.config.shift_factor) * vae.config.scaling_factor
        return {"latents": latents.float().cpu()}

    def load_text_encoders(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        return (
            CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer"),
            T5TokenizerFast.from_pretrained(model_dir, subfolder="tokenizer_2"),
            CLIPTextModel.from_pretrained(model_dir, subfolder="text_encoder", torch_dtype=dtype).to(device).eval(),
            T5EncoderModel.from_pretrained(model_dir, subfolder="text_encoder_2", torch_dtype=dtype).to(device).eval(),
        )

    @torch.no_grad()
    def encode_text(self, encoders: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]:
        # As FluxPipeline.encode_prompt: CLIP-L pooled output (77 tokens) and T5 last hidden state.
        clip_tok, t5_tok, clip, t5 = encoders
        ids = clip_tok(caption, padding="max_length", max_length=clip_tok.model_max_length, truncation=True,
                       return_tensors="pt").input_ids.to(clip.device)
        pooled = clip(ids, output_hidden_states=False).pooler_output
        ids = t5_tok(caption, padding="max_length", max_length=max_length, truncation=True,
                     return_tensors="pt").input_ids.to(t5.device)
        t5_out = t5(ids, output_hidden_states=False)[0]
        return {"prompt_embeds": t5_out[0].cpu(), "pooled_prompt_embeds": pooled[0].cpu()}

    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]:
        """Tokens of the caption against what T5 reads. CLIP-L only gives the pooled vector from its
        first 77 tokens, as in FluxPipeline, so a longer caption is not cut off for FLUX."""
        _, t5_tok, _, _ = encoders
        return {"T5": (len(t5_tok(caption).input_ids), max_length)}

    def block_counts(self, model_dir: Path) -> list[int]:
        """Blocks in each swappable list (double, single), from the transformer's config alone."""
        import json

        c = json.loads((Path(model_dir) / "transformer" / "config.json").read_text())
        return [int(c.get("num_layers", 19)), int(c.get("num_single_layers", 38))]

    # -- training ---------------------------------------------------------------------------
    def load_trainable(self, model_dir: Path, cfg: Any, device: torch.device, dtype: torch.dtype) -> "FluxTrainable":
        from diffusers import FluxTransformer2DModel

        # Loaded on the CPU: fp8 quantization and block swapping decide what goes to the device.
        transformer = FluxTransformer2DModel.from_pretrained(model_dir, subfolder="transformer", torch_dtype=dtype)
        if cfg.memory.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        return FluxTrainable(transformer, cfg.train)

    def full_trainable(self, cfg: Any, dtype: torch.dtype) -> "FluxTrainable":
        """The real FLUX.1-dev transformer architecture (12B) with random weights, for benchmarks."""
        from diffusers import FluxTransformer2DModel

        with torch.device("meta"):
            transformer = FluxTransformer2DModel(**FULL_TRANSFORMER)
        transformer = common.random_init(transformer, dtype)
        if cfg.memory.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        return FluxTrainable(transformer, cfg.train)

    def synthetic_batch(self, trainable: "FluxTrainable", resolution: int, cfg: Any,
                        device: torch.device) -> dict[str, torch.Tensor]:
        """Random tensors shaped like one cached sample, for benchmarks without a cache."""
        c = trainable.model.config
        n, r = cfg.train.batch_size, resolution
        length = cfg.cache.text_max_length or self.text_max_length
        g = torch.Generator().manual_seed(0)
        return {k: v.to(device) for k, v in {
            "latents": torch.randn(n, c.in_channels // 4, r // 8, r // 8, generator=g),
            "prompt_embeds": torch.randn(n, length, c.joint_attention_dim, generator=g),
            "pooled_prompt_embeds": torch.randn(n, c.pooled_projection_dim, generator=g),
            "time_ids": torch.zeros(n, 6),
        }.items()}

    # -- evaluation (imglora eval, a separate process: see evaluate.py) ----------------------
    def load_sampler(self, model_dir: Path, model: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Any:
        from ..evaluate import diffusers_sampler

        # FLUX.1-dev is guidance-distilled: 3.5 is its usual embedded guidance at inference.
        return diffusers_sampler(self, model_dir, model, cfg, device, dtype, default_guidance=3.5)


# FluxTransformer2DModel's defaults are FLUX.1-dev's (19 double + 38 single blocks, 3072 wide);
# dev also has the guidance embedding. Used by `bench-swap --arch full` before a download.
FULL_TRANSFORMER: dict[str, Any] = {"guidance_embeds": True}


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] → [B, (H/2)(W/2), 4C]: FLUX sees 2×2 latent patches as tokens."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def image_ids(h: int, w: int, device: torch.device) -> torch.Tensor:
    """Position ids of the packed latent tokens: (0, row, column), as FluxPipeline builds them."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 1] = torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3)


def resolution_shift_mu(image_seq_len: int) -> float:
    """FLUX.1-dev's inference shift: linear in the token count from (256, 0.5) to (4096, 1.15)."""
    return 0.5 + (1.15 - 0.5) * (image_seq_len - 256) / (4096 - 256)


def sample_sigmas(n: int, train: Any, image_seq_len: int, generator: torch.Generator,
                  device: torch.device) -> torch.Tensor:
    """Noise levels σ ∈ (0, 1) for flow matching (kohya sd-scripts' options, same formulas)."""
    kind = train.timestep_sampling
    if kind == "uniform":
        return torch.rand(n, generator=generator, device=device)
    if kind == "logit_normal":  # SD3's default: sigmoid of a standard normal
        return torch.sigmoid(torch.randn(n, generator=generator, device=device))
    s = torch.sigmoid(train.sigmoid_scale * torch.randn(n, generator=generator, device=device))
    if kind == "sigmoid":
        return s
    if train.resolution_dependent_shift:
        mu = resolution_shift_mu(image_seq_len)
        return math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    shift = train.discrete_flow_shift
    return s * shift / (1 + (shift - 1) * s)


class FluxTrainable:
    """The FLUX transformer and the flow-matching loss on cached latents and text embeddings."""

    def __init__(self, transformer: Any, train: Any):
        self.model = transformer
        self.train = train
        self.guidance = train.guidance if transformer.config.guidance_embeds else None

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> torch.Tensor:
        latents = batch["latents"]
        device, (n, _, h, w) = latents.device, latents.shape
        x0 = pack_latents(latents)
        noise = torch.randn(x0.shape, generator=generator, device=device, dtype=x0.dtype)
        sigma = sample_sigmas(n, self.train, x0.shape[1], generator, device)
        s = sigma.view(n, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        dtype = self.model.dtype
        text = batch["prompt_embeds"]
        pred = self.model(
            hidden_states=noisy.to(dtype),
            timestep=sigma.to(dtype),  # the transformer multiplies by 1000 itself
            guidance=None if self.guidance is None else torch.full((n,), self.guidance, device=device, dtype=dtype),
            pooled_projections=batch["pooled_prompt_embeds"].to(dtype),
            encoder_hidden_states=text.to(dtype),
            txt_ids=torch.zeros(text.shape[1], 3, device=device, dtype=dtype),
            img_ids=image_ids(h, w, device).to(dtype),
            return_dict=False,
        )[0]
        per_item = (pred.float() - (noise - x0).float()).pow(2).mean(dim=(1, 2))
        if self.train.loss_weighting == "sigma_sqrt":
            per_item = per_item * sigma.pow(-2.0)
        elif self.train.loss_weighting == "cosmap":
            per_item = per_item * 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))
        return per_item.mean()
