"""What the core asks of a model family: a few small protocols, one per capability.

Every family trains (``Family``); the others are optional and the core asks
``supports(family, Protocol)`` before using one, so a family implements what it has and nothing
else (no stubs raising ``NotImplementedError``):

* ``CacheEncoder``: images and captions encoded once into the content-keyed cache.
* ``Sampler``: prompts and samples for the separate evaluation pass.
* ``Swappable``: block lists that block swapping may stream from host memory, and how a kohya-style
  swap count maps onto them.
* ``Benchable``: the full-size architecture with random weights and synthetic batches, for
  ``bench-swap --arch full`` before a download.
* ``Plannable``: the architecture on the meta device, for ``imglora plan``'s memory prediction.
* ``Exportable``: key forms and metadata of a ComfyUI-ready LoRA, and its ComfyUI workflow.
* ``TextEncoderTraining``: the adapter on the text encoders too (``lora.text_encoder``).
* ``Mergeable``: folding an adapter into the full-precision base (``imglora merge``).
* ``SingleFiles``: training from the single files users have (an SDXL checkpoint, a FLUX.1
  transformer with its text encoders and VAE as files), as well as from a model folder.
* ``EditPairs``: an edit model trained on (source, target) pairs (``control_dir``).

A family loads its model from a ``ModelSource`` (``imglora.models.source``): a folder in its own layout,
or single files plus a folder of configs and tokenizers.

Families live in ``imglora.families`` (one folder each, registered in one line); the core never
imports them. Commands get a family from the registry and pass it in.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .config import Config, ModelConfig
    from .memory.swap import SwapLayout
    from .data.samples import PreparedData
    from .models.source import ModelSource


class Trainable(Protocol):
    """The trained module and the family's loss: the only family code in a training step."""

    model: torch.nn.Module
    facts: dict[str, Any]  # what the run record should know about the loaded model (e.g. its prediction type)

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> torch.Tensor: ...


@runtime_checkable
class Family(Protocol):
    name: str
    section: type | None  # the dataclass of its own preset section ([name]), or None
    model_marker: str  # the file that marks a model folder of this family (model_index.json, config.json)
    adapter_file: str  # the adapter's main file inside adapter/ and checkpoints' adapter/
    adapter_format: str  # what that adapter is and what loads it, for messages
    lora_targets: tuple[str, ...]  # peft target_modules by default
    lora_scope: str  # regex prefix limiting lora_targets ("" = anywhere)
    quantize_exclude: tuple[str, ...]  # module patterns kept in high precision under fp8 / 4-bit
    quantizations: tuple[str, ...]  # 4-bit kinds (memory.quantization) it supports
    adapter_types: tuple[str, ...]  # lora.type values it trains, saves and exports

    def check_config(self, cfg: "Config", where: Callable[[str], str], problems: list[str]) -> None: ...
    def build_tiny(self, dest: Path, seed: int) -> None: ...  # a tiny random model in the real on-disk layout
    def data_version(self, cfg: "Config") -> str: ...  # the training data's content hash, without a model
    def prepare_data(self, cfg: "Config", src: "ModelSource", device: torch.device) -> "PreparedData": ...
    def collate(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]: ...
    def load_trainable(self, src: "ModelSource", cfg: "Config", device: torch.device, dtype: torch.dtype,
                       swap: "SwapLayout") -> Trainable: ...
    # ``swap``: the blocks the run keeps in host memory (memory.wrap.resolve_swap, computed once by the
    # command; NO_SWAP for a family without swappable blocks). A streamed loader leaves exactly those
    # on the host as it reads them; apply_memory then swaps exactly those.
    def save_adapter(self, model: torch.nn.Module, peft_config: Any, folder: Path,
                     text_encoders: dict[str, tuple[torch.nn.Module, Any]] | None = None) -> Path: ...  # main file
    def read_adapter(self, folder: Path, component: str | None = None) -> dict[str, torch.Tensor]: ...
    # adapter state keyed by module path: the denoiser's, or a text encoder's (TextEncoderTraining)


@runtime_checkable
class CacheEncoder(Protocol):
    bucket_step: int  # bucket sides are multiples of this
    text_max_length: int  # default token length of cached text embeddings

    def vae_folders(self, src: "ModelSource") -> list[Path]: ...  # what the latents' identity hashes
    def text_folders(self, src: "ModelSource") -> list[Path]: ...  # what the text entries' identity hashes
    def load_vae(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any: ...
    def encode_image(self, vae: Any, pixels: torch.Tensor) -> dict[str, torch.Tensor]: ...
    def load_text_encoders(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any: ...
    def encode_text(self, encoders: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]: ...
    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]: ...


@runtime_checkable
class Sampler(Protocol):
    def default_prompts(self, cfg: "Config") -> list[str]: ...
    def encode_prompts(self, src: "ModelSource", prompts: list[str], cfg: "Config", device: torch.device) -> list[Any]: ...
    def load_sampler(self, src: "ModelSource", model: torch.nn.Module, cfg: "Config", device: torch.device,
                     dtype: torch.dtype) -> Callable[[Any, int], Any]: ...  # (encoded prompt, seed) -> image or text


@runtime_checkable
class Swappable(Protocol):
    swappable_blocks: tuple[str, ...]  # attribute paths of the block lists, in execution order

    def block_counts(self, src: "ModelSource") -> list[int]: ...  # blocks per list, from the config alone
    def full_block_counts(self, cfg: "Config") -> list[int]: ...  # blocks per list of full_trainable's model
    def swap_counts(self, lengths: list[int], cfg: "Config") -> list[int]: ...  # blocks per list to swap
    # (the family's rule, called only by memory.wrap.resolve_swap: once, where a command starts; the
    # result, a SwapLayout, is passed down as data)
    def with_blocks_to_swap(self, cfg: "Config", n: int) -> "Config": ...
    # ``cfg`` with kohya's count ``n`` as its only swap setting (the family's own per-list counts
    # unset): how the evaluation pass, bench-swap and the plan choose a count, the one route an
    # override takes (the config, before the layout is resolved)


@runtime_checkable
class Benchable(Protocol):
    def full_trainable(self, cfg: "Config", dtype: torch.dtype, swap: "SwapLayout",
                       device: torch.device | None = None) -> Trainable: ...
    # The full-size model with random weights, frozen. On CUDA (``device``) a family may make it
    # there part by part (quantized with memory.fp8, the blocks ``cfg`` swaps, as
    # in memory.wrap.apply_memory: the blocks ``swap`` names, moved to the host) so it never exists whole on the host; without
    # ``device`` or on the CPU it is made on the host. Either way apply_memory finishes the placing.
    def synthetic_batch(self, trainable: Trainable, resolution: int, cfg: "Config",
                        device: torch.device) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class Plannable(Protocol):
    def meta_trainable(self, src: "ModelSource | None", cfg: "Config", dtype: torch.dtype) -> Trainable: ...
    # the model on the meta device, frozen, as load_trainable would build it (src None: the real
    # model's shipped config, for planning before a download); with synthetic_batch (Benchable)


@runtime_checkable
class Exportable(Protocol):
    export_formats: tuple[str, ...]  # the first is the default

    def export_tensors(self, modules: dict[str, Any], fmt: str,
                       base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...
    # modules: adapter_forms.Module per "<component>.<module path>"; base: the base weights (fp32)
    # of the modules whose form needs them (DoRA), from base_weights
    def base_weights(self, src: "ModelSource", names: list[str]) -> dict[str, torch.Tensor]: ...
    def export_metadata(self, cfg: "Config", record: dict[str, Any]) -> dict[str, Any]: ...  # ss_*, modelspec.*
    def comfyui_nodes(self, lora_name: str, prompt: str, negative: str, seed: int, prefix: str,
                      with_clip: bool, model: "ModelConfig | None" = None) -> list[Any]: ...
    # comfyui.Node table: base (the files named in ``model`` if given as files) -> LoRA -> sampler -> image


@runtime_checkable
class SingleFiles(Protocol):
    def resolve_files(self, model: "ModelConfig", find: Callable[[str, tuple[str, ...], str], Path]) -> "ModelSource":
        """The ModelSource of a model given as files: ``find(name, ComfyUI folder kinds, setting)``
        locates each file named in ``model`` (a path, or a bare name with model.comfyui)."""
        ...


@runtime_checkable
class TextEncoderTraining(Protocol):
    """``lora.text_encoder``: the adapter on (some of) the text encoders too. The outputs they give
    are then computed in every step from the captions' tokens (the Trainable's ``text_encoders``
    hold the adapted encoders, and its loss encodes batches that carry tokens); outputs of frozen
    encoders stay cached."""

    text_encoder_parts: tuple[str, ...]  # the components that get the adapter ("text_encoder", ...)
    text_encoder_targets: tuple[str, ...]  # their peft target_modules
    text_encoder_scope: str  # regex prefix limiting those targets
    frozen_text_outputs: tuple[str, ...]  # tensors of a text entry that frozen encoders give: still cached

    def load_tokenizers(self, src: "ModelSource") -> Any: ...
    def tokenize(self, tokenizers: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]: ...
    # the tokens a batch carries instead of trained_text_outputs, as encode_text tokenizes


@runtime_checkable
class Mergeable(Protocol):
    def merge(self, run_dir: Path, cfg: "Config", out: Path, *, which: str | None, dtype: str, force: bool,
              log: Callable[[str], None]) -> Path: ...


@runtime_checkable
class EditPairs(Protocol):
    """An edit model: each training image (the target) comes with its source image(s) from the
    set's ``control_dir`` (``imglora.data.controls``); the cache stores their latents beside the
    target's as ``control_latents`` ``[k, C, h, w]``, and the loss conditions on them. The
    evaluation pass's prompts carry their source image too (``eval.control_images``, else the
    data's own pairs), shown beside the results on the contact sheet.

    A family whose text encoder reads the sources with the caption (Qwen-Image-Edit: a vision-language
    model) sets ``text_reads_sources = True``: each image's text entries are then its own, keyed by
    its sources too, and ``encode_text`` gets ``sources=`` (the images fitted to the bucket)."""

    control_images: int  # the most source images a target takes (1; several for multi-image edit models)


# Attributes a family may have beyond its protocols, each with what a family without it means. The
# core reads them only through ``option(family, name)`` (a test refuses a getattr/hasattr of an
# undeclared family attribute anywhere outside families/), so this table is the whole list.
OPTIONS: dict[str, Any] = {
    # data
    "loss_units": None,  # (entries) -> int: a batch's loss weight (tokens of a chat LLM), else its images
    "text_reads_sources": False,  # EditPairs whose text encoder reads the source images with the caption
    "default_text_length": None,  # (src) -> int: the caption token length where the model decides it
    "text_options": None,  # (cfg) -> dict: settings that change the text encoders' output (cache key too)
    # adapters
    "lora_blocks": {},  # lora.blocks' kinds -> the block list each names ({"double": "transformer_blocks"})
    "unused_outputs": None,  # (model) -> [module]: layers whose output the model discards (no adapter there)
    # memory and plan
    "compile_blocks": (),  # class names of the repeated blocks memory.compile = "blocks" compiles
    "streams_blocks": False,  # the model is read block by block (the plan's host-RAM term)
    # fetch
    "published_files": {},  # single-file name -> (hub repo, file): what `imglora fetch` downloads
}


def option(family: Any, name: str) -> Any:
    """``family``'s optional attribute ``name`` (declared in ``OPTIONS``), else its default there."""
    if name not in OPTIONS:
        raise AttributeError(f"{name!r} is not a declared family option (imglora.family.OPTIONS)")
    return getattr(family, name, OPTIONS[name])


def text_length(family: Any, cfg: "Config", src: "ModelSource") -> int:
    """The token length captions are encoded at: ``cache.text_max_length``, else the family's
    default for this model (``default_text_length(src)`` where the model decides it, e.g.
    FLUX.1-schnell's 256 against FLUX.1-dev's 512), else its ``text_max_length``."""
    if cfg.cache.text_max_length:
        return cfg.cache.text_max_length
    default = option(family, "default_text_length")
    return default(src) if default is not None else family.text_max_length


def text_options(family: Any, cfg: "Config") -> dict[str, Any]:
    """Settings that change what the text encoders give for a caption (e.g. FLUX's
    ``apply_t5_attn_mask``): part of a text entry's cache key, and passed to ``encode_text`` as
    keywords. Empty for a family without such settings (its keys and calls stay as they were)."""
    options = option(family, "text_options")
    return options(cfg) if options is not None else {}


def supports(family: Any, capability: type) -> bool:
    """Whether ``family`` implements one of the protocols above."""
    return isinstance(family, capability)
