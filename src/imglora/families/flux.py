"""FLUX.1-dev: flow-matching transformer LoRA on cached VAE latents and cached CLIP-L + T5 outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch


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

    # -- cache ------------------------------------------------------------------------------
    def vae_folders(self, model_dir: Path) -> list[Path]:
        return [model_dir / "vae"]

    def text_folders(self, model_dir: Path) -> list[Path]:
        return [model_dir / n for n in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")]

    def load_vae(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import AutoencoderKL

        return AutoencoderKL.from_pretrained(model_dir, subfolder="vae", torch_dtype=dtype).to(device).eval()

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
