"""Z-Image (Tongyi-MAI Z-Image Turbo and Z-Image Base, 6B): a single-stream DiT (two refiner blocks for
the image tokens, two for the caption's, 30 main blocks over both) conditioned on Qwen3-4B's
second-to-last hidden states of the caption in Qwen3's chat template, FLUX.1's 16-channel VAE, no
pooled vector and no guidance embedding. Turbo is distilled to 8 steps without guidance; Base is
sampled with classifier-free guidance.

Training a LoRA on Turbo directly works for styles and subjects but wears its few-step behaviour
down over long runs (what ai-toolkit, SimpleTuner and musubi-tuner report); their answers are a
"training adapter" merged into Turbo while training and left out afterwards (ostris'), or training
on Base (or the de-distilled Turbo) and using the LoRA on Turbo. imglora trains whichever model
``model.path`` names (``Tongyi-MAI/Z-Image-Turbo`` in the shipped preset; ``Tongyi-MAI/Z-Image`` for
Base, with ``[z_image] discrete_flow_shift = 6.0`` and ``eval.guidance_scale``), see docs/families.md.

In this folder: the loss and text encoding (``model``), its section (``config``), the export form
(``keys``), its ComfyUI workflow (``comfyui``), its tiny model (``tiny``), the shipped Z-Image Turbo
architecture (``configs``). Made from ``families/_template``.
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
from .config import ZImageConfig

if TYPE_CHECKING:
    from ...models.source import ModelSource


class ZImageFamily:
    name = "z_image"
    section = ZImageConfig
    model_marker = "model_index.json"
    # imglora fetch: bare single-file names and where they are published (repository, path, ComfyUI kind)
    published_files = {
        "z_image_turbo_bf16.safetensors": ("Comfy-Org/z_image_turbo",
                                           "split_files/diffusion_models/z_image_turbo_bf16.safetensors",
                                           "diffusion_models"),
        "z_image_bf16.safetensors": ("Comfy-Org/z_image", "split_files/diffusion_models/z_image_bf16.safetensors",
                                     "diffusion_models"),
        "qwen_3_4b.safetensors": ("Comfy-Org/z_image_turbo", "split_files/text_encoders/qwen_3_4b.safetensors",
                                  "text_encoders"),
        "ae.safetensors": ("Comfy-Org/z_image_turbo", "split_files/vae/ae.safetensors", "vae"),
    }
    adapter_file = common.ADAPTER_FILE
    adapter_format = "a diffusers LoRA: pipe.load_lora_weights(folder)"
    bucket_step = 16  # the VAE's 8× and the transformer's 2×2 patches
    text_max_length = model.TEXT_MAX_LENGTH
    # Attention and feed-forward projections of the 30 main blocks, as musubi-tuner adapts them (no
    # modulation layers, no refiner blocks: ComfyUI's first Z-Image LoRA map, before 2026, named the
    # main blocks only, so these load in every ComfyUI that loads Z-Image LoRAs at all).
    lora_targets = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    lora_scope = r"layers\.\d+\."
    lora_blocks = {"layer": "layers"}  # lora.blocks' kinds
    # Kept in the load precision under fp8: the embedders, the pad tokens and the final layer.
    quantize_exclude = ("all_x_embedder*", "cap_embedder*", "t_embedder*", "all_final_layer*")
    quantizations: tuple[str, ...] = ()
    adapter_types = tuple(KINDS)
    swappable_blocks = tuple(model.BLOCKS.values())
    compile_blocks = ("ZImageTransformerBlock",)
    streams_blocks = True  # read block by block (_shared.stream): the plan's host-RAM term
    export_formats = keys.FORMATS
    pipeline = "ZImagePipeline"
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
        if src.files:
            return own_module(singlefile.load_vae(src, dtype)).to(device).eval()
        return common.load_vae(self, src, device, dtype)

    @torch.no_grad()
    def encode_image(self, vae: Any, pixels: torch.Tensor, std: bool = False) -> dict[str, torch.Tensor]:
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        c = vae.config
        return common.scaled_posterior(dist, std, lambda x: (x - c.shift_factor) * c.scaling_factor, c.scaling_factor)

    def load_text_encoders(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        from transformers import AutoTokenizer, Qwen3Model

        if src.files:
            encoder = singlefile.load_text_encoder(src, dtype)
        else:
            encoder = Qwen3Model.from_pretrained(src.root, subfolder="text_encoder", torch_dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(src.root, subfolder="tokenizer")
        return tokenizer, own_module(encoder).to(device).eval()

    @torch.no_grad()
    def encode_text(self, encoders: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]:
        tokenizer, encoder = encoders
        return {"prompt_embeds": model.encode_caption(tokenizer, encoder, caption, max_length).float().cpu()}

    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]:
        # The templated caption's tokens, which the pipeline cuts at max_sequence_length.
        return {"Qwen3": (len(encoders[0](model.TEMPLATE.format(caption)).input_ids), max_length)}

    # -- training ---------------------------------------------------------------------------
    load_trainable, full_trainable, meta_trainable, synthetic_batch = common.trainable_members(model)

    # -- block swapping: the main blocks, counted directly ------------------------------------------
    def block_counts(self, src: "ModelSource") -> list[int]:
        return model.block_counts(src.root)

    def full_block_counts(self, cfg: Any) -> list[int]:
        return model.block_counts(model.CONFIGS)

    def with_blocks_to_swap(self, cfg: Any, n: int) -> Any:
        return cfg.replace(memory={"blocks_to_swap": n})  # (one count: no per-list keys)

    def swap_counts(self, lengths: list[int], cfg: Any) -> list[int]:
        return [0, 0, one_stream.checked_count(cfg.memory.blocks_to_swap, lengths[2], "Z-Image",
                                               "main blocks (the refiner blocks stay on the GPU)")]

    # -- evaluation -------------------------------------------------------------------------
    def encode_prompts(self, src: "ModelSource", prompts: list[str], cfg: Any, device: torch.device) -> list[Any]:
        """Each prompt's hidden states, with the empty negative prompt's (Base's guidance needs it)."""
        return common.encode_prompts_with_negative(self, src, prompts, cfg, device, "")

    def load_sampler(self, src: "ModelSource", denoiser: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Callable[..., Any]:
        def prompt(e: dict[str, torch.Tensor], t: torch.dtype, guidance: float) -> dict[str, Any]:
            return {"prompt_embeds": [e["prompt_embeds"].to(device, t)],
                    "negative_prompt_embeds": [e["negative_prompt_embeds"].to(device, t)],
                    "guidance_scale": guidance}

        return common.guided_sampler(self, src, denoiser, cfg, device, dtype, comfyui.GUIDANCE, prompt)

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
