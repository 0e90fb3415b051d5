"""Krea 2 (Krea's 12.8B text-to-image model: Krea 2 Raw, and the distilled Krea 2 Turbo): one stream of
28 blocks over the caption's and the image's tokens, the caption as twelve of Qwen3-VL-4B's layers
mixed by the transformer's own text fusion blocks, Qwen-Image's VAE, no guidance embedding (sampled
with classifier-free guidance). Krea's advice, which peers repeat: train the LoRA on Raw and use it
on Turbo (8 steps, no guidance).

In this folder: the loss and text encoding (``model``), its section (``config``), the export form
(``keys``), its ComfyUI workflow (``comfyui``), its tiny model (``tiny``), the shipped Krea 2 Raw
architecture (``configs``), the single files ComfyUI users have (``singlefile``). Made from
``families/_template``.
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
from .config import Krea2Config

if TYPE_CHECKING:
    from ...models.source import ModelSource


class Krea2Family:
    name = "krea2"
    section = Krea2Config
    model_marker = "model_index.json"
    # imglora fetch: bare single-file names and where they are published (repository, path, ComfyUI kind)
    published_files = {
        "krea2_raw_bf16.safetensors": ("Comfy-Org/Krea-2", "diffusion_models/krea2_raw_bf16.safetensors",
                                       "diffusion_models"),
        "krea2_raw_fp8_scaled.safetensors": ("Comfy-Org/Krea-2", "diffusion_models/krea2_raw_fp8_scaled.safetensors",
                                             "diffusion_models"),
        "qwen3vl_4b_bf16.safetensors": ("Comfy-Org/Krea-2", "text_encoders/qwen3vl_4b_bf16.safetensors",
                                        "text_encoders"),
        "qwen3vl_4b_fp8_scaled.safetensors": ("Comfy-Org/Krea-2", "text_encoders/qwen3vl_4b_fp8_scaled.safetensors",
                                              "text_encoders"),
        "qwen_image_vae.safetensors": ("Comfy-Org/Krea-2", "vae/qwen_image_vae.safetensors", "vae"),
    }
    adapter_file = common.ADAPTER_FILE
    adapter_format = "a diffusers LoRA: pipe.load_lora_weights(folder)"
    bucket_step = 16  # the VAE's 8× and the 2×2 patches
    text_max_length = model.TEXT_MAX_LENGTH
    # Every projection of the 28 blocks (attention with its output gate, the SwiGLU MLP): the Krea
    # authors' default as musubi-tuner ships it, less the layers outside the blocks.
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0", "ff.gate", "ff.up",
                    "ff.down")
    lora_scope = r"transformer_blocks\.\d+\."
    lora_blocks = model.BLOCKS
    # Kept in the load precision under fp8: everything outside the 28 blocks (the text fusion blocks too,
    # as musubi-tuner keeps them).
    quantize_exclude = ("img_in", "time_embed*", "time_mod_proj", "text_fusion*", "txt_in*", "final_layer*")
    quantizations: tuple[str, ...] = ()
    adapter_types = tuple(KINDS)
    swappable_blocks = ("transformer_blocks",)
    compile_blocks = ("Krea2TransformerBlock",)
    streams_blocks = True
    export_formats = keys.FORMATS
    pipeline = "Krea2Pipeline"
    denoiser = "transformer"

    prepare_data = common.prepare_data
    data_version = common.data_version
    save_adapter = common.save_adapter
    read_adapter = common.read_adapter
    base_weights = common.base_weights
    default_prompts = common.default_prompts

    def check_config(self, cfg: Any, where: Callable[[str], str], problems: list[str]) -> None:
        common.check_config(self, cfg, where, problems)

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
            vae = singlefile.load_vae(src, dtype)
        else:
            vae = AutoencoderKLQwenImage.from_pretrained(src.root, subfolder="vae", torch_dtype=dtype)
        return own_module(vae).to(device).eval()

    @torch.no_grad()
    def encode_image(self, vae: Any, pixels: torch.Tensor, std: bool = False) -> dict[str, torch.Tensor]:
        dist = vae.encode(pixels.to(vae.device, vae.dtype)[:, :, None]).latent_dist
        out = {"latents": model.normalize_latents(dist.mean, vae.config)[0].float().cpu()}
        if std:
            spread = dist.std / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(dist.std)
            out["latents_std"] = spread[0, :, 0].float().cpu()
        return out

    def load_text_encoders(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        from transformers import AutoTokenizer, Qwen3VLModel

        if src.files:  # Qwen3-VL's language model alone (a caption is text only)
            encoder = singlefile.load_text_encoder(src, dtype)
        else:
            encoder = Qwen3VLModel.from_pretrained(src.root, subfolder="text_encoder", torch_dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(src.root, subfolder="tokenizer")
        return tokenizer, own_module(encoder).to(device).eval()

    @torch.no_grad()
    def encode_text(self, encoders: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]:
        tokenizer, encoder = encoders
        return {"prompt_embeds": model.encode_caption(tokenizer, encoder, caption, max_length).float().cpu()}

    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]:
        # The prompt's and the suffix's tokens (the template's prefix is not counted against the limit).
        n = len(encoders[0](model.PREFIX + caption).input_ids) - model.PREFIX_TOKENS + model.SUFFIX_TOKENS
        return {"Qwen3-VL": (n, max_length)}

    # -- training ---------------------------------------------------------------------------
    load_trainable, full_trainable, meta_trainable, synthetic_batch = common.trainable_members(model)

    # -- block swapping: one list, counted directly ----------------------------------------------
    def block_counts(self, src: "ModelSource") -> list[int]:
        return model.block_counts(src.root)

    def full_block_counts(self, cfg: Any) -> list[int]:
        return model.block_counts(model.CONFIGS)

    def with_blocks_to_swap(self, cfg: Any, n: int) -> Any:
        return cfg.replace(memory={"blocks_to_swap": n})

    def swap_counts(self, lengths: list[int], cfg: Any) -> list[int]:
        return [one_stream.checked_count(cfg.memory.blocks_to_swap, lengths[0], "Krea 2")]

    # -- evaluation -------------------------------------------------------------------------
    def encode_prompts(self, src: "ModelSource", prompts: list[str], cfg: Any, device: torch.device) -> list[Any]:
        return common.encode_prompts_with_negative(self, src, prompts, cfg, device, "")

    def load_sampler(self, src: "ModelSource", denoiser: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Callable[..., Any]:
        def prompt(e: dict[str, torch.Tensor], t: torch.dtype, guidance: float) -> dict[str, Any]:
            # The pipeline gives both passes one layout (it pads every prompt to max_sequence_length):
            # the prompt and the negative prompt padded to the longer of the two, the padding masked.
            batch = model.collate([{"prompt_embeds": e[k]} for k in ("prompt_embeds", "negative_prompt_embeds")])
            embeds = batch["prompt_embeds"].to(device, t)
            mask = batch.get("prompt_mask", torch.ones(embeds.shape[:2], dtype=torch.bool)).to(device)
            return {"prompt_embeds": embeds[:1], "prompt_embeds_mask": mask[:1], "negative_prompt_embeds": embeds[1:],
                    "negative_prompt_embeds_mask": mask[1:], "guidance_scale": guidance}

        return common.guided_sampler(self, src, denoiser, cfg, device, dtype, comfyui.GUIDANCE, prompt)

    # -- export -------------------------------------------------------------------------------
    def export_tensors(self, modules: dict[str, Any], fmt: str, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return keys.tensors(modules, fmt, base)

    def file_base_weights(self, src: "ModelSource", component: str, paths: list[str]) -> dict[str, torch.Tensor]:
        return singlefile.base_weights(src, component, paths)

    def export_metadata(self, cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
        return keys.metadata(cfg, record)

    def comfyui_nodes(self, lora_name: str, prompt: str, negative: str, seed: int, prefix: str,
                      with_clip: bool, model: Any = None) -> list[Any]:
        return comfyui.nodes(lora_name, prompt, negative, seed, prefix, model=model)
