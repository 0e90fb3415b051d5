"""Model families behind one small protocol, so the training loop never asks which one it trains.

A family knows its on-disk layout, how to encode images and captions for the cache, which modules
LoRA targets, which layers stay in high precision under FP8, which block lists can be swapped,
and its loss. Register a new family with one line in ``FAMILIES``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch


class Family(Protocol):
    name: ClassVar[str]
    bucket_step: ClassVar[int]                  # bucket sides are multiples of this
    text_max_length: ClassVar[int]              # default token length of cached text embeddings
    lora_targets: ClassVar[tuple[str, ...]]     # peft target_modules by default
    quantize_exclude: ClassVar[tuple[str, ...]]  # module patterns kept in high precision under fp8
    swappable_blocks: ClassVar[tuple[str, ...]]  # attribute paths of swappable block lists
    denoiser: ClassVar[str]                     # subfolder of the trained model ("unet", "transformer")
    pipeline: ClassVar[str]                     # diffusers pipeline class (adapter save/load layout)
    lora_scope: ClassVar[str]                   # regex prefix limiting lora_targets ("" = anywhere)

    # -- cache ------------------------------------------------------------------------------
    def vae_folders(self, model_dir: Path) -> list[Path]: ...
    def text_folders(self, model_dir: Path) -> list[Path]: ...
    def load_vae(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any: ...
    def encode_image(self, vae: Any, pixels: torch.Tensor) -> dict[str, torch.Tensor]: ...
    def load_text_encoders(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any: ...
    def encode_text(self, encoders: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]: ...

    # -- training ---------------------------------------------------------------------------
    def prepare_data(self, cfg: Any, model_dir: Path, device: torch.device) -> Any: ...  # -> PreparedData
    def collate(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]: ...
    def load_trainable(self, model_dir: Path, cfg: Any, device: torch.device, dtype: torch.dtype) -> "Trainable": ...
    def save_adapter(self, model: torch.nn.Module, peft_config: Any, folder: Path) -> Path: ...  # the main file
    def read_adapter(self, folder: Path) -> dict[str, torch.Tensor]: ...  # LoRA state keyed by module path

    # -- evaluation (imglora eval: a fresh process, the base loaded once, adapters swapped in) --
    def default_prompts(self, cfg: Any) -> list[str]: ...  # when neither eval.prompts nor --prompts give any
    def encode_prompts(self, model_dir: Path, prompts: list[str], cfg: Any, device: torch.device) -> list[Any]: ...
    def load_sampler(self, model_dir: Path, model: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Any: ...  # (encoded prompt, seed) -> PIL image, or text


class Trainable(Protocol):
    """The trained module and the family's loss: the only family code in a training step."""

    model: torch.nn.Module

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> torch.Tensor: ...


def get_family(name: str) -> Family:
    from .flux import FluxFamily
    from .llm import LlmFamily
    from .sdxl import SdxlFamily

    families: dict[str, type] = {"sdxl": SdxlFamily, "flux": FluxFamily, "llm": LlmFamily}
    if name not in families:
        raise KeyError(f"no family {name!r}; known: {', '.join(families)}")
    return families[name]()
