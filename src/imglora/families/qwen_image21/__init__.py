"""Qwen-Image 2.1 (Qwen's 7.1B text-to-image model of 2026, a new architecture, not a checkpoint of
Qwen-Image): one block-causal stream of 32 blocks over the caption's and the image's tokens, the
caption as Qwen3-VL-8B's last layer before its final norm, an RGBA VAE of 64 channels at 1/16 (one
token per latent pixel), sampled without guidance. No peer trainer trains it yet (their snapshots
of mid-2026 predate it); ComfyUI loads its LoRAs onto the halves of its fused MLP.

In this folder: the loss and text encoding (``model``), its section (``config``), the export form
(``keys``), its ComfyUI workflow (``comfyui``), its tiny model (``tiny``), the shipped Qwen-Image 2.1
architecture (``configs``), the single files ComfyUI users have (``singlefile``: the transformer, Qwen3-VL-8B
and the VAE of Comfy-Org/Qwen-Image-2.1). Made from ``families/_template``.
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
from .config import QwenImage21Config

if TYPE_CHECKING:
    from ...models.source import ModelSource


class QwenImage21Family:
    name = "qwen_image21"
    section = QwenImage21Config
    model_marker = "model_index.json"
    # imglora fetch: bare single-file names and where they are published (repository, path, ComfyUI kind)
    published_files = {
        "qwen_image_2.1_bf16.safetensors": ("Comfy-Org/Qwen-Image-2.1", "diffusion_models/qwen_image_2.1_bf16.safetensors",
                                            "diffusion_models"),
        "qwen3vl_8b_bf16.safetensors": ("Comfy-Org/Qwen-Image-2.1", "text_encoders/qwen3vl_8b_bf16.safetensors",
                                        "text_encoders"),
        "qwen_image_2.1_vae_bf16.safetensors": ("Comfy-Org/Qwen-Image-2.1", "vae/qwen_image_2.1_vae_bf16.safetensors",
                                                "vae"),
    }
    adapter_file = common.ADAPTER_FILE
    adapter_format = "a diffusers LoRA: pipe.load_lora_weights(folder)"
    bucket_step = 32  # the VAE's 16× and the transformer's 2×2 image slots
    text_max_length = model.TEXT_MAX_LENGTH
    # Every projection of the 32 blocks (attention, the SwiGLU MLP's gate, up and out projections), which
    # ComfyUI maps (the gate and up ones onto the halves of its fused img_mlp.gate_up); not the layers
    # outside the blocks (the shared modulation, the text and image embedders, the output layer).
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj",
                    "img_mlp.out")
    lora_scope = r"transformer_blocks\.\d+\."
    lora_blocks = model.BLOCKS
    # Kept in the load precision under fp8: everything outside the 32 blocks.
    quantize_exclude = ("img_in", "time_text_embed*", "txt_in*", "modulation*", "norm_out*", "proj_out")
    quantizations: tuple[str, ...] = ()
    adapter_types = tuple(KINDS)
    swappable_blocks = ("transformer_blocks",)
    compile_blocks = ("QwenImage21TransformerBlock",)
    streams_blocks = True
    export_formats = keys.FORMATS
    pipeline = "QwenImage21Pipeline"
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
        return [src.root / "text_encoder", model.tokenizer_folder(src.root),
                *([src.files["text_encoder"]] if src.files else [])]

    def vae_folders(self, src: "ModelSource") -> list[Path]:
        return [src.root / "vae", *([src.files["vae"]] if src.files else [])]

    def load_vae(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import AutoencoderKLQwenImage21

        if src.files:
            vae = singlefile.load_vae(src, dtype)
        else:
            vae = AutoencoderKLQwenImage21.from_pretrained(src.root, subfolder="vae", torch_dtype=dtype)
        return own_module(vae).to(device).eval()

    @torch.no_grad()
    def encode_image(self, vae: Any, pixels: torch.Tensor, std: bool = False) -> dict[str, torch.Tensor]:
        dist = vae.encode(model.rgba(pixels.to(vae.device, vae.dtype))).latent_dist
        out = {"latents": model.normalize_latents(dist.mean, vae.config)[0].float().cpu()}
        if std:
            spread = dist.std / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(dist.std)
            out["latents_std"] = spread[0, :, 0].float().cpu()
        return out

    def load_text_encoders(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        # Qwen3VLModel without the generation head (the pipeline's model less its lm_head: the same states);
        # from a file, its language model alone (a caption is text only; model.language_model finds its norm).
        from transformers import AutoTokenizer, Qwen3VLModel

        from transformers.utils import logging as hf_logging

        if src.files:
            encoder = singlefile.load_text_encoder(src, dtype)
        else:
            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # (its report of the generation head it leaves unread)
            try:
                encoder = Qwen3VLModel.from_pretrained(src.root, subfolder="text_encoder", torch_dtype=dtype)
            finally:
                hf_logging.set_verbosity(level)
        tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_folder(src.root))
        return tokenizer, own_module(encoder).to(device).eval()

    @torch.no_grad()
    def encode_text(self, encoders: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]:
        tokenizer, encoder = encoders
        return {"prompt_embeds": model.encode_caption(tokenizer, encoder, caption, max_length).float().cpu()}

    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]:
        # The states kept: the user turn with the caption and the assistant's opening (not the system turn).
        tokenizer = encoders[0]
        n = len(tokenizer(model.PREFIX + (caption or " ") + model.SUFFIX).input_ids) - model.system_tokens(tokenizer)
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
        return [one_stream.checked_count(cfg.memory.blocks_to_swap, lengths[0], "Qwen-Image 2.1")]

    # -- evaluation -------------------------------------------------------------------------
    def encode_prompts(self, src: "ModelSource", prompts: list[str], cfg: Any, device: torch.device) -> list[Any]:
        return common.encode_prompts_with_negative(self, src, prompts, cfg, device, "")

    def load_sampler(self, src: "ModelSource", denoiser: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Callable[..., Any]:
        def prompt(e: dict[str, torch.Tensor], t: torch.dtype, guidance: float) -> dict[str, Any]:
            # One prompt per call, as the pipeline encodes it: no padding, so no mask; the negative
            # prompt only with guidance (the pipeline's default, 1.0, samples without it).
            kwargs = {"prompt_embeds": e["prompt_embeds"][None].to(device, t), "true_cfg_scale": guidance}
            if guidance > 1:
                kwargs["negative_prompt_embeds"] = e["negative_prompt_embeds"][None].to(device, t)
            return kwargs

        sample = common.guided_sampler(self, src, denoiser, cfg, device, dtype, comfyui.GUIDANCE, prompt,
                                       processor=model.load_processor(src.root))

        def rgb(embeds: dict[str, torch.Tensor], seed: int) -> Any:
            # The VAE decodes RGBA; the samples are shown and compared as the training images are, RGB.
            return sample(embeds, seed).convert("RGB")

        rgb.settings = sample.settings  # type: ignore[attr-defined]
        return rgb

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
