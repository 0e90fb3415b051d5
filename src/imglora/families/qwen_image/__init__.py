"""Qwen-Image (Qwen/Qwen-Image, 20B): a dual-stream MMDiT of 60 blocks conditioned on Qwen2.5-VL's
hidden states of the caption in a chat template, with its own 3D-causal VAE (16 latent channels,
normalised by per-channel statistics), no pooled text vector and no guidance embedding; sampled with
real classifier-free guidance.

In this folder: the loss and text encoding (``model``), its section (``config``), the export key
forms (``keys``: ComfyUI names its modules as diffusers does), its ComfyUI workflow (``comfyui``), its
tiny model (``tiny``), the shipped architecture (``configs``). Its one block list swaps block by
block (``memory.blocks_to_swap`` counts blocks, as musubi-tuner does); the transformer is read block
by block through FLUX.1's streamed reader, each block quantized with memory.fp8 as it is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...adapters import KINDS
from ...util.owned import own_module
from .._shared import diffusers_image as common
from .._shared import one_stream
from . import comfyui, keys, model, singlefile, tiny
from .config import QwenImageConfig

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from ...models.source import ModelSource


class QwenImageFamily:
    name = "qwen_image"
    section = QwenImageConfig
    model_marker = "model_index.json"
    # imglora fetch: bare single-file names and where they are published (repository, path, ComfyUI kind)
    published_files = {
        "qwen_2.5_vl_7b_fp8_scaled.safetensors": (
            "Comfy-Org/Qwen-Image_ComfyUI", "split_files/text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors",
            "text_encoders"),
        "qwen_image_vae.safetensors": ("Comfy-Org/Qwen-Image_ComfyUI", "split_files/vae/qwen_image_vae.safetensors",
                                       "vae"),
        # Qwen-Image-2512: the same architecture, newer weights
        "qwen_image_2512_fp8_e4m3fn.safetensors": (
            "Comfy-Org/Qwen-Image_ComfyUI", "split_files/diffusion_models/qwen_image_2512_fp8_e4m3fn.safetensors",
            "diffusion_models"),
        "qwen_image_2512_bf16.safetensors": (
            "Comfy-Org/Qwen-Image_ComfyUI", "split_files/diffusion_models/qwen_image_2512_bf16.safetensors",
            "diffusion_models"),
    }
    adapter_file = common.ADAPTER_FILE
    adapter_format = "a diffusers LoRA: pipe.load_lora_weights(folder)"
    bucket_step = 16  # the VAE's 8× and the transformer's 2×2 patches
    text_max_length = model.TEXT_MAX_LENGTH
    # Every projection of the image and text streams inside the blocks (ai-toolkit's and musubi-tuner's
    # set less the modulation layers, as for FLUX.1).
    lora_targets = (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    )
    lora_scope = r"transformer_blocks\.\d+\."
    lora_blocks = {"block": "transformer_blocks"}  # lora.blocks' kinds
    # Kept in the load precision under fp8: the embedders and the final layers (as for FLUX.1). The
    # blocks' modulation layers are quantized: they are a third of the model's weights (2 × 3072 × 18432
    # per block), and musubi-tuner and ai-toolkit quantize them too.
    quantize_exclude = ("img_in", "txt_in", "txt_norm", "time_text_embed*", "norm_out*", "proj_out")
    quantizations: tuple[str, ...] = ()
    adapter_types = tuple(KINDS)
    swappable_blocks = ("transformer_blocks",)
    compile_blocks = ("QwenImageTransformerBlock",)  # memory.compile = "blocks"
    streams_blocks = True  # the transformer is read block by block (_shared.stream): plan's host-RAM term
    export_formats = keys.FORMATS
    pipeline = "QwenImagePipeline"
    denoiser = "transformer"
    make_trainable = None  # the trainable's class: QwenImageTrainable (model._trainable)

    prepare_data = common.prepare_data
    data_version = common.data_version
    save_adapter = common.save_adapter
    read_adapter = common.read_adapter
    base_weights = common.base_weights
    default_prompts = common.default_prompts

    def check_config(self, cfg: Any, where: Callable[[str], str], problems: list[str]) -> None:
        common.check_config(self, cfg, where, problems)

    def unused_outputs(self, transformer: torch.nn.Module) -> list[str]:
        """The last block's text-stream outputs (its attention's text projection out and its text
        MLP): the transformer discards the text stream after the last block, so these layers get no
        gradient and take no adapter (ai-toolkit and musubi-tuner adapt them, and save zeros)."""
        return model.unused_outputs(transformer)

    def build_tiny(self, dest: Path, seed: int) -> None:
        tiny.build(dest, seed)

    def resolve_files(self, model_cfg: Any, find: Any) -> "ModelSource":
        return singlefile.resolve_files(model_cfg, find)

    def collate(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return model.collate(entries)

    # -- cache ------------------------------------------------------------------------------
    def text_folders(self, src: "ModelSource") -> list[Path]:
        return [src.root / "text_encoder", src.root / "tokenizer", *([src.files["text_encoder"]] if src.files else [])]

    def vae_folders(self, src: "ModelSource") -> list[Path]:
        return [src.root / "vae", *([src.files["vae"]] if src.files else [])]

    def load_vae(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import AutoencoderKLQwenImage

        if src.files:
            return own_module(singlefile.load_vae(src, dtype)).to(device).eval()
        vae = AutoencoderKLQwenImage.from_pretrained(src.root, subfolder="vae", torch_dtype=dtype)
        return own_module(vae).to(device).eval()

    @torch.no_grad()
    def encode_image(self, vae: Any, pixels: torch.Tensor, std: bool = False) -> dict[str, torch.Tensor]:
        # One frame of the 3D VAE: [B, C, 1, H, W]; the posterior's mean normalised per channel (and its
        # standard deviation in the same units, for cache.latents = "sample").
        dist = vae.encode(pixels.to(vae.device, vae.dtype)[:, :, None]).latent_dist
        out = {"latents": model.normalize_latents(dist.mean, vae.config)[0].float().cpu()}
        if std:
            out["latents_std"] = model.normalize_std(dist.std, vae.config)[0].float().cpu()
        return out

    def load_text_encoders(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        if src.files:
            encoder = singlefile.load_text_encoder(src, dtype)
        else:
            encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(src.root, subfolder="text_encoder",
                                                                         torch_dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(src.root, subfolder="tokenizer")
        return tokenizer, own_module(encoder).to(device).eval()

    @torch.no_grad()
    def encode_text(self, encoders: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]:
        tokenizer, encoder = encoders
        return {"prompt_embeds": model.encode_caption(tokenizer, encoder, caption, max_length).float().cpu()}

    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]:
        # The caption's tokens inside the template (the template's own are not counted against the limit).
        n = len(encoders[0](model.TEMPLATE.format(caption)).input_ids) - model.TEMPLATE_TOKENS
        return {"Qwen2.5-VL": (n, max_length)}

    # -- training ---------------------------------------------------------------------------
    def load_trainable(self, src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype,
                       swap: "SwapLayout") -> Any:
        return model.load_trainable(src, cfg, device, dtype, swap, self.quantize_exclude, self.make_trainable)

    def full_trainable(self, cfg: Any, dtype: torch.dtype, swap: "SwapLayout",
                       device: torch.device | None = None) -> Any:
        return model.full_trainable(cfg, dtype, swap, device, self, self.make_trainable)

    def meta_trainable(self, src: "ModelSource | None", cfg: Any, dtype: torch.dtype) -> Any:
        return model.meta_trainable(src.root if src is not None else None, cfg, dtype, self.make_trainable)

    def synthetic_batch(self, trainable: Any, resolution: int, cfg: Any, device: torch.device) -> dict[str, torch.Tensor]:
        return model.synthetic_batch(trainable, resolution, cfg, device)

    # -- block swapping: one list, counted directly ----------------------------------------------
    def block_counts(self, src: "ModelSource") -> list[int]:
        return model.block_counts(src.root)

    def full_block_counts(self, cfg: Any) -> list[int]:
        return model.block_counts(model.CONFIGS)

    def with_blocks_to_swap(self, cfg: Any, n: int) -> Any:
        return cfg.replace(memory={"blocks_to_swap": n})  # (Qwen-Image has one count: no per-list keys)

    def swap_counts(self, lengths: list[int], cfg: Any) -> list[int]:
        return [one_stream.checked_count(cfg.memory.blocks_to_swap, lengths[0], "Qwen-Image",
                                         "blocks (it counts blocks one by one)")]

    # -- evaluation -------------------------------------------------------------------------
    def encode_prompts(self, src: "ModelSource", prompts: list[str], cfg: Any, device: torch.device) -> list[Any]:
        """Each prompt's hidden states, with the negative prompt's (real CFG needs both)."""
        return common.encode_prompts_with_negative(self, src, prompts, cfg, device, comfyui.NEGATIVE)

    def load_sampler(self, src: "ModelSource", denoiser: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Callable[..., Any]:
        def prompt(e: dict[str, torch.Tensor], t: torch.dtype, guidance: float) -> dict[str, Any]:
            ones = {k: torch.ones(1, e[k].shape[0], dtype=torch.long, device=device)  # every token (one prompt)
                    for k in ("prompt_embeds", "negative_prompt_embeds")}
            return {"prompt_embeds": e["prompt_embeds"][None].to(device, t), "prompt_embeds_mask": ones["prompt_embeds"],
                    "negative_prompt_embeds": e["negative_prompt_embeds"][None].to(device, t),
                    "negative_prompt_embeds_mask": ones["negative_prompt_embeds"], "true_cfg_scale": guidance}

        return common.guided_sampler(self, src, denoiser, cfg, device, dtype, comfyui.SAMPLING.cfg, prompt)

    # -- export -------------------------------------------------------------------------------
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
