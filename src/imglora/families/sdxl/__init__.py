"""SDXL: UNet LoRA on cached VAE latents and cached CLIP-L + CLIP-G outputs.

Everything about the family is in this folder: loading and the loss (``model``), its preset section
(``config``), its export key forms (``keys``), its ComfyUI workflow (``comfyui``), its tiny model
(``tiny``). It implements ``Family``, ``CacheEncoder``, ``Sampler``, ``Benchable`` and
``Exportable`` (see ``imglora.family``); its blocks are not swapped.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...adapters import KINDS
from ...util.owned import own_module
from .._shared import diffusers_image as common
from . import comfyui, keys, model, singlefile, tiny
from .config import SdxlConfig

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from ...models.source import ModelSource


class SdxlFamily:
    name = "sdxl"
    section = SdxlConfig
    model_marker = "model_index.json"
    # imglora fetch: bare single-file names and where they are published (repository, path, ComfyUI kind)
    published_files = {"sd_xl_base_1.0.safetensors": ("stabilityai/stable-diffusion-xl-base-1.0",
                                                      "sd_xl_base_1.0.safetensors", "checkpoints")}
    adapter_file = common.ADAPTER_FILE
    adapter_format = "a diffusers LoRA: pipe.load_lora_weights(folder)"
    bucket_step = 64
    text_max_length = 77
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    lora_scope = ""
    lora_blocks = {"down": "down_blocks", "mid": "mid_block", "up": "up_blocks"}  # lora.blocks' kinds
    quantize_exclude = ("conv_in", "conv_out", "time_embedding*", "add_embedding*")
    compile_blocks = ("BasicTransformerBlock", "ResnetBlock2D")  # memory.compile = "blocks": the UNet's repeated blocks
    quantizations: tuple[str, ...] = ()
    adapter_types = tuple(KINDS)  # all on fp8 bases too (DoRA norms the dequantized weight)
    export_formats = keys.FORMATS
    # lora.text_encoder: both CLIP encoders get the adapter on their attention and MLP projections (the
    # layers ComfyUI's lora_te1_/lora_te2_ names map); they give every text output, so none is cached.
    text_encoder_parts = ("text_encoder", "text_encoder_2")
    text_encoder_targets = common.CLIP_TARGETS
    text_encoder_scope = common.CLIP_SCOPE
    frozen_text_outputs: tuple[str, ...] = ()
    pipeline = "StableDiffusionXLPipeline"  # diffusers pipeline class (adapter save/load layout, sampling)
    denoiser = "unet"  # its subfolder and the adapter keys' prefix

    # Shared with the other diffusers image family (see diffusers_image).
    check_config = common.check_config
    vae_folders = common.vae_folders
    text_folders = common.text_folders
    prepare_data = common.prepare_data
    data_version = common.data_version
    collate = common.collate
    save_adapter = common.save_adapter
    read_adapter = common.read_adapter
    base_weights = common.base_weights
    default_prompts = common.default_prompts
    encode_prompts = common.encode_prompts

    def build_tiny(self, dest: Path, seed: int) -> None:
        tiny.build(dest, seed)

    def resolve_files(self, model_cfg: Any, find: Any) -> "ModelSource":
        return singlefile.resolve_files(model_cfg, find)

    # -- cache ------------------------------------------------------------------------------
    def load_vae(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        if src.files:
            return singlefile.load_part(src, "vae", dtype).to(device).eval()
        return common.load_vae(self, src, device, dtype)

    @torch.no_grad()
    def encode_image(self, vae: Any, pixels: torch.Tensor, std: bool = False) -> dict[str, torch.Tensor]:
        # The distribution's mean (and, for cache.latents = "sample", its standard deviation), not a
        # sample: the cache entry is then a pure function of its key; the batches draw from them.
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        return common.scaled_posterior(dist, std, lambda x: x * vae.config.scaling_factor, vae.config.scaling_factor)

    def load_text_encoders(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        tokenizers = (CLIPTokenizer.from_pretrained(src.root, subfolder="tokenizer"),
                      CLIPTokenizer.from_pretrained(src.root, subfolder="tokenizer_2"))
        if src.files:
            encoders = tuple(singlefile.load_part(src, part, dtype) for part in ("text_encoder", "text_encoder_2"))
        else:
            encoders = (CLIPTextModel.from_pretrained(src.root, subfolder="text_encoder", torch_dtype=dtype),
                        CLIPTextModelWithProjection.from_pretrained(src.root, subfolder="text_encoder_2",
                                                                    torch_dtype=dtype))
        return (*tokenizers, *(own_module(e).to(device).eval() for e in encoders))

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

    def load_tokenizers(self, src: "ModelSource") -> Any:
        from transformers import CLIPTokenizer

        return (CLIPTokenizer.from_pretrained(src.root, subfolder="tokenizer"),
                CLIPTokenizer.from_pretrained(src.root, subfolder="tokenizer_2"))

    def tokenize(self, tokenizers: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]:
        """The caption's tokens for both encoders, as encode_text makes them (lora.text_encoder)."""
        return {key: common.clip_tokens(tok, caption, max_length) for key, tok in zip(model.TOKEN_KEYS, tokenizers)}

    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]:
        """Tokens of the caption (with BOS/EOS) against what each encoder reads."""
        tok1, tok2, _, _ = encoders
        return {"CLIP-L": (len(tok1(caption).input_ids), max_length),
                "CLIP-G": (len(tok2(caption).input_ids), max_length)}

    # -- training ---------------------------------------------------------------------------
    def load_trainable(self, src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype,
                       swap: "SwapLayout") -> Any:
        trainable = model.load_trainable(src, cfg, dtype)
        if cfg.lora.text_encoder:  # trained with the UNet: frozen here, the adapter comes with the UNet's
            _, _, te1, te2 = self.load_text_encoders(src, torch.device("cpu"), dtype)
            trainable.text_encoders = {"text_encoder": te1.requires_grad_(False),
                                       "text_encoder_2": te2.requires_grad_(False)}
        return trainable

    def full_trainable(self, cfg: Any, dtype: torch.dtype, swap: "SwapLayout",
                       device: torch.device | None = None) -> Any:
        return model.full_trainable(cfg, dtype, device, self)  # (no swappable blocks: swap is NO_SWAP)

    def meta_trainable(self, src: "ModelSource | None", cfg: Any, dtype: torch.dtype) -> Any:
        return model.meta_trainable(src.root if src is not None else None, cfg, dtype)

    def synthetic_batch(self, trainable: Any, resolution: int, cfg: Any, device: torch.device) -> dict[str, torch.Tensor]:
        return model.synthetic_batch(trainable, resolution, cfg, device)

    # -- evaluation -------------------------------------------------------------------------
    def load_sampler(self, src: "ModelSource", denoiser: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Callable[..., Any]:
        # Classifier-free guidance 7 unless eval.guidance_scale says otherwise; the sampler predicts
        # what the UNet was trained to (a single file's v-prediction mark, [sdxl] prediction_type),
        # and starts from pure noise for a zero-terminal-SNR model (trailing spacing).
        return common.diffusers_sampler(self, src, denoiser, cfg, device, dtype, default_guidance=7.0,
                                        scheduler_overrides=model.sampler_overrides(src, cfg))

    # -- export -----------------------------------------------------------------------------
    def export_tensors(self, modules: dict[str, Any], fmt: str,
                       base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return keys.tensors(modules, fmt, base)

    def file_base_weights(self, src: "ModelSource", component: str, paths: list[str]) -> dict[str, torch.Tensor]:
        return singlefile.base_weights(src, component, paths)

    def export_metadata(self, cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
        return keys.metadata(cfg, record)

    def comfyui_nodes(self, lora_name: str, prompt: str, negative: str, seed: int, prefix: str,
                      with_clip: bool, model: Any = None) -> list[Any]:
        return comfyui.nodes(lora_name, prompt, negative, seed, prefix, model=model)
