"""TEMPLATE: a new family's class (see README.md in this folder). Copy the folder, rename the class,
register it in ``families/__init__.py``, and fill in every method marked ``TEMPLATE:``. The rest is
the wiring every diffusers image family shares; keep it unless the model differs there.

This class implements every protocol of ``imglora.family`` an image family usually has: ``Family``,
``CacheEncoder``, ``Sampler``, ``Swappable``, ``Benchable``, ``Plannable``, ``Exportable`` and
``SingleFiles`` (delete what the model lacks). It is never registered.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...adapters import KINDS
from .._shared import diffusers_image as common
from .._shared.flow_matching import FlowMatchingObjective

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from ...models.source import ModelSource


def todo(what: str) -> NotImplementedError:
    return NotImplementedError(f"TEMPLATE: {what} (src/imglora/families/_template/README.md)")


class TemplateFamily:
    name = "template"  # TEMPLATE: model.family's value, the folder's name
    section = FlowMatchingObjective  # TEMPLATE: its [name] section: a dataclass of its own keys with its defaults
    model_marker = "model_index.json"
    published_files: dict[str, tuple[str, str, str]] = {}  # bare file name -> (hub repo, path, ComfyUI folder)
    adapter_file = common.ADAPTER_FILE
    adapter_format = "a diffusers LoRA: pipe.load_lora_weights(folder)"
    bucket_step = 16  # the VAE's downsampling times the transformer's patch size
    text_max_length = 512  # TEMPLATE: the pipeline's max_sequence_length
    lora_targets: tuple[str, ...] = ()  # TEMPLATE: module names inside a block (peft target_modules)
    lora_scope = ""  # TEMPLATE: a regex of the blocks they are in, e.g. r"layers\.\d+\."
    lora_blocks: dict[str, str] = {}  # lora.blocks' kinds -> block list attribute
    quantize_exclude: tuple[str, ...] = ()  # TEMPLATE: embedders and final layers kept in high precision
    quantizations: tuple[str, ...] = ()
    adapter_types = tuple(KINDS)
    swappable_blocks: tuple[str, ...] = ()  # TEMPLATE: the block lists' attributes, in execution order
    export_formats = ("default",)
    pipeline = ""  # TEMPLATE: the diffusers pipeline class
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
        raise todo("write a tiny random model in the real on-disk layout (tiny.py; see z_image/tiny.py)")

    def resolve_files(self, model: Any, find: Any) -> "ModelSource":
        raise todo("find the single files ComfyUI users have and the shipped configs (singlefile.py)")

    # -- cache ------------------------------------------------------------------------------
    def text_folders(self, src: "ModelSource") -> list[Path]:
        return common.text_folders(self, src)

    def vae_folders(self, src: "ModelSource") -> list[Path]:
        return common.vae_folders(self, src)

    def load_vae(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        return common.load_vae(self, src, device, dtype)

    def encode_image(self, vae: Any, pixels: torch.Tensor, std: bool = False) -> dict[str, torch.Tensor]:
        raise todo("the latents as the training script scales them ({'latents': [C, h, w]})")

    def load_text_encoders(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        raise todo("the tokenizer(s) and frozen text encoder(s) of src")

    def encode_text(self, encoders: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]:
        raise todo("one caption's tensors exactly as the pipeline's encode_prompt computes them")

    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]:
        raise todo("{encoder: (the caption's tokens, the limit)} for the truncation warning")

    # -- training ---------------------------------------------------------------------------
    def load_trainable(self, src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype,
                       swap: "SwapLayout") -> Any:
        raise todo("the trained module and its loss (model.py: _shared.stream.load_transformer, then a "
                   "Trainable whose loss is the pipeline's step as a training target)")

    def full_trainable(self, cfg: Any, dtype: torch.dtype, swap: "SwapLayout",
                       device: torch.device | None = None) -> Any:
        raise todo("the full-size architecture with random weights (common.random_on_device on CUDA)")

    def meta_trainable(self, src: "ModelSource | None", cfg: Any, dtype: torch.dtype) -> Any:
        raise todo("the architecture on the meta device, from src's config or the shipped one")

    def synthetic_batch(self, trainable: Any, resolution: int, cfg: Any, device: torch.device) -> dict[str, torch.Tensor]:
        raise todo("random tensors shaped like one cached sample at this resolution")

    # -- block swapping -----------------------------------------------------------------------
    def block_counts(self, src: "ModelSource") -> list[int]:
        raise todo("blocks per swappable list, from the transformer's config")

    def full_block_counts(self, cfg: Any) -> list[int]:
        raise todo("blocks per swappable list of the model full_trainable builds (its shipped config)")

    def swap_counts(self, lengths: list[int], cfg: Any) -> list[int]:
        raise todo("blocks per list that memory.blocks_to_swap keeps on the host (an error past the largest)")

    def with_blocks_to_swap(self, cfg: Any, n: int) -> Any:
        return cfg.replace(memory={"blocks_to_swap": n})

    # -- evaluation -------------------------------------------------------------------------
    def encode_prompts(self, src: "ModelSource", prompts: list[str], cfg: Any, device: torch.device) -> list[Any]:
        return common.encode_prompts_with_negative(self, src, prompts, cfg, device, "")

    def load_sampler(self, src: "ModelSource", model: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Callable[..., Any]:
        raise todo("the pipeline around the trained denoiser (common.guided_sampler with the pipeline's "
                   "prompt arguments)")

    # -- export -------------------------------------------------------------------------------
    def export_tensors(self, modules: dict[str, Any], fmt: str, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise todo("the adapter under names ComfyUI's comfy/lora.py maps for this model (keys.py)")

    def export_metadata(self, cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
        raise todo("kohya's and modelspec's header entries for this model")

    def comfyui_nodes(self, lora_name: str, prompt: str, negative: str, seed: int, prefix: str,
                      with_clip: bool, model: Any = None) -> list[Any]:
        raise todo("the nodes of Comfy-Org's example workflow for this model, with a LoRA loader (comfyui.py)")
