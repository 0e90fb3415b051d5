"""FLUX.2 (Black Forest Labs): FLUX.2 [klein] base 4B and 9B, and FLUX.2 [dev] (32B). A rectified-flow
transformer of double blocks (image and text streams) and single blocks, with modulation shared by
all blocks; one token per 16×16 pixels (FLUX.2's VAE: 32 channels at 1/8, 2×2 patches as 128
channels, normalised by its batch-norm statistics); the caption as three of the text encoder's
layers side by side (Qwen3 for [klein], Mistral-Small-3 for [dev]), padded to 512 tokens. [klein]
base has no guidance embedding and is sampled with real classifier-free guidance; [dev] has one
(fed 1.0 in training) and samples with its embedded guidance. Which model a folder holds is read
from its pipeline class (model_facts.variant in the run record).

Peers (musubi-tuner, OneTrainer) recommend training [klein] *base*: the distilled [klein] and [dev]
are meant for inference. In this folder: the loss and text encoding (``model``), its section
(``config``), the export form (``keys``), its ComfyUI workflows (``comfyui``), its tiny model
(``tiny``, a [klein]), the shipped [klein] base 4B, 9B and [dev] architectures (``configs``), the
single files ComfyUI users have (``singlefile``). Made from ``families/_template``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...adapters import KINDS
from ...errors import ImgloraError
from ...util.owned import own_module
from .._shared import diffusers_image as common
from . import comfyui, keys, model, singlefile, tiny
from .config import Flux2Config

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from ...models.source import ModelSource


def shipped_root(path: str) -> Path:
    """The shipped architecture ``model.path`` names, for a plan made before the model is read: [dev],
    [klein] 9B (a name with "klein" and "9b"), else [klein] 4B."""
    kind = comfyui.variant_named(path)
    if kind == "klein" and re.search(r"klein.*9b", Path(path).name.lower()):
        return singlefile.SHIPPED["klein-9b"]
    return model.MODELS[kind]


class Flux2Family:
    name = "flux2"
    section = Flux2Config
    model_marker = "model_index.json"
    # imglora fetch: bare single-file names and where they are published (repository, path, ComfyUI kind)
    published_files = {
        "flux-2-klein-base-4b.safetensors": ("Comfy-Org/flux2-klein",
                                             "split_files/diffusion_models/flux-2-klein-base-4b.safetensors",
                                             "diffusion_models"),
        "flux-2-klein-4b.safetensors": ("Comfy-Org/flux2-klein", "split_files/diffusion_models/flux-2-klein-4b.safetensors",
                                        "diffusion_models"),
        "flux-2-klein-base-9b-fp8.safetensors": ("black-forest-labs/FLUX.2-klein-base-9b-fp8",
                                                 "flux-2-klein-base-9b-fp8.safetensors", "diffusion_models"),
        "qwen_3_4b.safetensors": ("Comfy-Org/flux2-klein", "split_files/text_encoders/qwen_3_4b.safetensors",
                                  "text_encoders"),
        "qwen_3_8b_fp8mixed.safetensors": ("Comfy-Org/flux2-klein-9B",
                                           "split_files/text_encoders/qwen_3_8b_fp8mixed.safetensors", "text_encoders"),
        "flux2_dev_fp8mixed.safetensors": ("Comfy-Org/flux2-dev",
                                           "split_files/diffusion_models/flux2_dev_fp8mixed.safetensors",
                                           "diffusion_models"),
        "flux2-vae.safetensors": ("Comfy-Org/flux2-dev", "split_files/vae/flux2-vae.safetensors", "vae"),
        # [dev]'s Mistral-Small-3 (ComfyUI's cut to the 30 layers FLUX.2 reads), bf16 and fp8
        "mistral_3_small_flux2_bf16.safetensors": ("Comfy-Org/flux2-dev",
                                                   "split_files/text_encoders/mistral_3_small_flux2_bf16.safetensors",
                                                   "text_encoders"),
        "mistral_3_small_flux2_fp8.safetensors": ("Comfy-Org/flux2-dev",
                                                  "split_files/text_encoders/mistral_3_small_flux2_fp8.safetensors",
                                                  "text_encoders"),
    }
    adapter_file = common.ADAPTER_FILE
    adapter_format = "a diffusers LoRA: pipe.load_lora_weights(folder)"
    bucket_step = 16  # the VAE's 8× and the 2×2 patches
    text_max_length = model.TEXT_MAX_LENGTH
    # The projections inside the blocks that ComfyUI's FLUX.2 map names (not the shared modulation or
    # time layers): the double blocks' attention and feed-forwards of both streams, the single blocks'
    # fused input and output projections. A double block's attn.to_out is a list, its attn.to_out.0
    # the projection: the scope keeps "attn.to_out" to the single blocks.
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                    "ff_context.linear_out", "attn.to_qkv_mlp_proj", "attn.to_out")
    lora_scope = r"(?:transformer_blocks\.\d+\.(?!attn\.to_out$)|single_transformer_blocks\.\d+\.)"
    lora_blocks = model.BLOCKS  # lora.blocks' kinds: double, single
    quantize_exclude = ("x_embedder", "context_embedder", "time_guidance_embed*", "*_modulation*", "norm_out*",
                        "proj_out")
    quantizations: tuple[str, ...] = ()
    adapter_types = tuple(KINDS)
    swappable_blocks = tuple(model.BLOCKS.values())
    compile_blocks = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")
    streams_blocks = True
    export_formats = keys.FORMATS
    pipeline = "Flux2KleinPipeline"  # (its LoRA saver is Flux2Pipeline's; sampling reads the folder's own)
    denoiser = "transformer"

    prepare_data = common.prepare_data
    data_version = common.data_version
    collate = common.collate
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

    # -- cache ------------------------------------------------------------------------------
    def text_folders(self, src: "ModelSource") -> list[Path]:
        return [src.root / "text_encoder", src.root / "tokenizer",
                *([src.files["text_encoder"]] if src.files and "text_encoder" in src.files else [])]

    def vae_folders(self, src: "ModelSource") -> list[Path]:
        return [src.root / "vae", *([src.files["vae"]] if src.files else [])]

    def load_vae(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import AutoencoderKLFlux2

        if src.files:
            vae = singlefile.load_vae(src, dtype)
        else:
            vae = AutoencoderKLFlux2.from_pretrained(src.root, subfolder="vae", torch_dtype=dtype)
        return own_module(vae).to(device).eval()

    @torch.no_grad()
    def encode_image(self, vae: Any, pixels: torch.Tensor, std: bool = False) -> dict[str, torch.Tensor]:
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        latents = model.normalize(model.patchify(dist.mode()), vae.bn)
        out = {"latents": latents[0].float().cpu()}
        if std:  # the posterior's spread in the same units: per patch channel, divided by the same std
            spread = model.patchify(dist.std) / torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).to(dist.std)
                                                           + vae.bn.eps)
            out["latents_std"] = spread[0].float().cpu()
        return out

    def load_text_encoders(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        from transformers import AutoTokenizer, Mistral3ForConditionalGeneration, Qwen3ForCausalLM

        kind = model.variant(src.root)
        from_file = bool(src.files) and "text_encoder" in src.files  # ([dev] from files may read model.config's)
        if kind == "klein" and from_file:
            encoder = singlefile.load_text_encoder(src, dtype)
            tokenizer = AutoTokenizer.from_pretrained(src.root, subfolder="tokenizer")
        elif from_file:
            encoder = singlefile.load_mistral(src, dtype)
            tokenizer = model.mistral_tokenizer(src.root / "tokenizer")
        elif kind == "klein":
            encoder = Qwen3ForCausalLM.from_pretrained(src.root, subfolder="text_encoder", torch_dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(src.root, subfolder="tokenizer")
        else:
            encoder = Mistral3ForConditionalGeneration.from_pretrained(src.root, subfolder="text_encoder",
                                                                       torch_dtype=dtype)
            tokenizer = model.mistral_tokenizer(src.root / "tokenizer")
        return tokenizer, own_module(encoder).to(device).eval(), kind

    @torch.no_grad()
    def encode_text(self, encoders: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]:
        tokenizer, encoder, kind = encoders
        return {"prompt_embeds": model.encode_caption(tokenizer, encoder, caption, max_length, kind).float().cpu()}

    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]:
        tokenizer, _, kind = encoders
        if kind == "klein":
            return {"Qwen3": (len(tokenizer(model.KLEIN_TEMPLATE.format(caption)).input_ids), max_length)}
        return {"Mistral": (len(tokenizer(caption, add_special_tokens=False).input_ids), max_length)}

    # -- training ---------------------------------------------------------------------------
    def load_trainable(self, src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype,
                       swap: "SwapLayout") -> Any:
        return model.load_trainable(src, cfg, device, dtype, swap, self.quantize_exclude)

    def full_trainable(self, cfg: Any, dtype: torch.dtype, swap: "SwapLayout",
                       device: torch.device | None = None) -> Any:
        return model.full_trainable(cfg, dtype, swap, device, self, shipped_root(cfg.model.path))

    def meta_trainable(self, src: "ModelSource | None", cfg: Any, dtype: torch.dtype) -> Any:
        root = src.root if src is not None else shipped_root(cfg.model.path)
        return model.meta_trainable(root, cfg, dtype)

    def synthetic_batch(self, trainable: Any, resolution: int, cfg: Any, device: torch.device) -> dict[str, torch.Tensor]:
        return model.synthetic_batch(trainable, resolution, cfg, device)

    # -- block swapping: blocks counted one by one, the single blocks first ----------------------
    def block_counts(self, src: "ModelSource") -> list[int]:
        return model.block_counts(src.root)

    def full_block_counts(self, cfg: Any) -> list[int]:
        return model.block_counts(shipped_root(cfg.model.path))

    def with_blocks_to_swap(self, cfg: Any, n: int) -> Any:
        return cfg.replace(memory={"blocks_to_swap": n})

    def swap_counts(self, lengths: list[int], cfg: Any) -> list[int]:
        n = cfg.memory.blocks_to_swap
        if n > sum(lengths):
            raise ImgloraError(f"memory.blocks_to_swap = {n}, but this FLUX.2 model has {lengths[0]} double and "
                               f"{lengths[1]} single blocks; the largest valid number is {sum(lengths)}")
        return model.swap_counts(lengths, n)

    # -- evaluation -------------------------------------------------------------------------
    def encode_prompts(self, src: "ModelSource", prompts: list[str], cfg: Any, device: torch.device) -> list[Any]:
        """Each prompt's states with the empty negative prompt's ([klein]'s guidance needs it)."""
        return common.encode_prompts_with_negative(self, src, prompts, cfg, device, "")

    def load_sampler(self, src: "ModelSource", denoiser: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Callable[..., Any]:
        kind = model.variant(src.root)

        def prompt(e: dict[str, torch.Tensor], t: torch.dtype, guidance: float) -> dict[str, Any]:
            out = {"prompt_embeds": e["prompt_embeds"][None].to(device, t), "guidance_scale": guidance}
            if kind == "klein":
                out["negative_prompt_embeds"] = e["negative_prompt_embeds"][None].to(device, t)
            return out

        sampling = comfyui.SAMPLING[kind]
        default = sampling.guidance if kind == "dev" else sampling.cfg
        return common.guided_sampler(self, src, denoiser, cfg, device, dtype, default, prompt,
                                     pipeline="Flux2KleinPipeline" if kind == "klein" else "Flux2Pipeline")

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
