"""Chroma (lodestones' Chroma1-HD / Chroma1-Base): FLUX.1-schnell's architecture with the modulation
layers replaced by one small network (the approximator), T5-XXL alone as text encoder with its
attention mask, no guidance embedding, sampled with real classifier-free guidance.

In this folder: the loss and the mask (``model``), its section (``config``), its ComfyUI workflow
(``comfyui``), its tiny model (``tiny``), the shipped Chroma1-HD architecture (``configs``). Its
blocks have FLUX.1's names, so block swapping, fp8 and the export key forms are FLUX.1's (ComfyUI
maps a Chroma LoRA through its FLUX key map: its Chroma model is a FLUX model). It trains from a
diffusers folder or from ComfyUI's single files (``singlefile``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...adapters import KINDS
from ...util.owned import own_module
from .._shared import diffusers_image as common
from ..flux import FluxFamily
from ..flux import keys as flux_keys
from ..flux import swap
from . import comfyui, model, singlefile, tiny
from .config import ChromaConfig

if TYPE_CHECKING:
    from ...models.source import ModelSource


class ChromaFamily:
    name = "chroma"
    section = ChromaConfig
    model_marker = "model_index.json"
    # imglora fetch: Chroma's single files share FLUX.1's VAE and T5 (repository, path, ComfyUI kind)
    published_files = {k: v for k, v in FluxFamily.published_files.items() if k.startswith(("ae.", "t5xxl"))}
    adapter_file = common.ADAPTER_FILE
    adapter_format = "a diffusers LoRA: pipe.load_lora_weights(folder)"
    bucket_step = 16
    text_max_length = model.TEXT_MAX_LENGTH
    # FLUX.1's block projections (Chroma's blocks have no modulation layers of their own), in its blocks.
    lora_targets = FluxFamily.lora_targets
    lora_scope = FluxFamily.lora_scope
    lora_blocks = FluxFamily.lora_blocks
    quantize_exclude = ("x_embedder", "context_embedder", "distilled_guidance_layer*", "proj_out")
    quantizations: tuple[str, ...] = ()
    adapter_types = tuple(KINDS)
    swappable_blocks = swap.BLOCK_LISTS
    compile_blocks = ("ChromaTransformerBlock", "ChromaSingleTransformerBlock")
    streams_blocks = True  # the transformer is read block by block (_shared.stream): plan's host-RAM term
    export_formats = flux_keys.FORMATS
    pipeline = "ChromaPipeline"
    denoiser = "transformer"

    prepare_data = common.prepare_data
    data_version = common.data_version
    collate = common.collate
    save_adapter = common.save_adapter
    read_adapter = common.read_adapter
    base_weights = common.base_weights
    default_prompts = common.default_prompts

    check_config = FluxFamily.check_config  # the swap split and the export forms, as FLUX.1's

    def build_tiny(self, dest: Path, seed: int) -> None:
        tiny.build(dest, seed)

    def resolve_files(self, model_cfg: Any, find: Any) -> "ModelSource":
        return singlefile.resolve_files(model_cfg, find)

    # -- cache ------------------------------------------------------------------------------
    def text_folders(self, src: "ModelSource") -> list[Path]:
        return [src.root / "text_encoder", src.root / "tokenizer", *([src.files["text_encoder"]] if src.files else [])]

    def vae_folders(self, src: "ModelSource") -> list[Path]:
        return [src.root / "vae", *([src.files["vae"]] if src.files else [])]

    def load_vae(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        if src.files:
            return own_module(singlefile.load_vae(src, dtype)).to(device).eval()
        return common.load_vae(self, src, device, dtype)

    @torch.no_grad()
    def encode_image(self, vae: Any, pixels: torch.Tensor, std: bool = False) -> dict[str, torch.Tensor]:
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        c = vae.config
        return common.scaled_posterior(dist, std, lambda x: (x - c.shift_factor) * c.scaling_factor, c.scaling_factor)

    def load_text_encoders(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        from transformers import T5EncoderModel, T5TokenizerFast

        if src.files:
            t5 = singlefile.load_t5(src, dtype)
        else:
            t5 = T5EncoderModel.from_pretrained(src.root, subfolder="text_encoder", torch_dtype=dtype)
        return T5TokenizerFast.from_pretrained(src.root, subfolder="tokenizer"), own_module(t5).to(device).eval()

    @torch.no_grad()
    def encode_text(self, encoders: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]:
        # As ChromaPipeline._get_t5_prompt_embeds: T5 reads the tokenizer's mask (unlike FLUX's T5).
        tok, t5 = encoders
        t = tok(caption, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
        out = t5(t.input_ids.to(t5.device), attention_mask=t.attention_mask.to(t5.device),
                 output_hidden_states=False)[0]
        return {"prompt_embeds": out[0].cpu(), "text_mask": model.text_mask(t.attention_mask[0])}

    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]:
        return {"T5": (len(encoders[0](caption).input_ids), max_length)}

    # -- training ---------------------------------------------------------------------------
    load_trainable, full_trainable, meta_trainable, synthetic_batch = common.trainable_members(model)

    # -- block swapping: FLUX.1's block lists, kohya's count -------------------------------------
    def block_counts(self, src: "ModelSource") -> list[int]:
        return swap.block_counts(src.root)

    def full_block_counts(self, cfg: Any) -> list[int]:
        return swap.block_counts(model.CONFIGS)

    def swap_counts(self, lengths: list[int], cfg: Any) -> list[int]:
        return swap.swap_counts(lengths, cfg)

    def with_blocks_to_swap(self, cfg: Any, n: int) -> Any:
        return swap.with_blocks_to_swap(cfg, n)

    # -- evaluation -------------------------------------------------------------------------
    def encode_prompts(self, src: "ModelSource", prompts: list[str], cfg: Any, device: torch.device) -> list[Any]:
        """Each prompt's embeddings and mask, with the negative prompt's (real CFG needs both)."""
        return common.encode_prompts_with_negative(self, src, prompts, cfg, device, comfyui.NEGATIVE)

    def load_sampler(self, src: "ModelSource", denoiser: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Callable[..., Any]:
        def prompt(e: dict[str, torch.Tensor], t: torch.dtype, guidance: float) -> dict[str, Any]:
            return {"prompt_embeds": e["prompt_embeds"][None].to(device, t),
                    "prompt_attention_mask": e["text_mask"][None].to(device),
                    "negative_prompt_embeds": e["negative_prompt_embeds"][None].to(device, t),
                    "negative_prompt_attention_mask": e["negative_text_mask"][None].to(device),
                    "guidance_scale": guidance}

        return common.guided_sampler(self, src, denoiser, cfg, device, dtype, comfyui.SAMPLING.cfg, prompt)

    # -- export: FLUX.1's key forms (ComfyUI's Chroma is a FLUX model) -----------------------------
    def export_tensors(self, modules: dict[str, Any], fmt: str,
                       base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return flux_keys.tensors(modules, fmt, base)

    def file_base_weights(self, src: "ModelSource", component: str, paths: list[str]) -> dict[str, torch.Tensor]:
        return singlefile.base_weights(src, component, paths)

    def export_metadata(self, cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
        return flux_keys.metadata(cfg, record, base="chroma", architecture="chroma/lora",
                                  implementation="https://huggingface.co/lodestones/Chroma")  # kohya's

    def comfyui_nodes(self, lora_name: str, prompt: str, negative: str, seed: int, prefix: str,
                      with_clip: bool, model: Any = None) -> list[Any]:
        return comfyui.nodes(lora_name, prompt, negative, seed, prefix, model=model)
