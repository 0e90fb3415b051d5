"""FLUX.1 Kontext [dev]: the FLUX.1 family's transformer, cache, swap, fp8, plan and export, trained on
edit pairs (a source image per target, ``control_dir``) as ``FluxKontextPipeline`` runs it.

What differs from FLUX.1 is here: the loss appends the source's latent tokens (``model``), the
evaluation pass samples from each prompt's source image, the ComfyUI workflow references it
(``comfyui``), the shipped model_index names the Kontext pipeline (``configs``). ComfyUI loads a
Kontext LoRA with FLUX.1's key map (the same transformer), so export is FLUX.1's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from .._shared import diffusers_image as common
from ..flux import FluxFamily
from ..flux import keys as flux_keys
from ..flux import model as flux_model
from ..flux import singlefile as flux_files
from ..flux import tiny as flux_tiny
from . import comfyui, model
from .config import FluxKontextConfig

if TYPE_CHECKING:
    from ...models.source import ModelSource

CONFIGS = Path(__file__).parent / "configs" / "flux1-kontext-dev"


class FluxKontextFamily(FluxFamily):
    name = "flux_kontext"
    section = FluxKontextConfig
    pipeline = "FluxKontextPipeline"
    trainable = model.KontextTrainable
    control_images = 1  # EditPairs: one source image per target, as FluxKontextPipeline takes
    published_files = {**FluxFamily.published_files, "flux1-kontext-dev.safetensors": (
        "black-forest-labs/FLUX.1-Kontext-dev", "flux1-kontext-dev.safetensors", "diffusion_models")}

    def build_tiny(self, dest: Path, seed: int) -> None:
        flux_tiny.build(dest, seed, pipeline=self.pipeline)

    def resolve_files(self, model_cfg: Any, find: Any) -> "ModelSource":
        return flux_files.resolve_files(model_cfg, find, overlay=CONFIGS)

    def synthetic_batch(self, trainable: Any, resolution: int, cfg: Any, device: torch.device) -> dict[str, torch.Tensor]:
        return model.synthetic_batch(trainable, resolution, cfg, device)

    def encode_prompts(self, src: "ModelSource", prompts: list[str], cfg: Any, device: torch.device) -> list[Any]:
        sources = common.source_images(self, cfg, prompts)  # before any encoder loads: errors come first
        encoded = common.encode_prompts(self, src, prompts, cfg, device)
        return [{**e, "control_image": image} for e, image in zip(encoded, sources)]

    def load_sampler(self, src: "ModelSource", denoiser: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Callable[..., Any]:
        # The source is already fitted to the sample size (source_images): no resizing to Kontext's
        # preferred sizes, and an output area of the sample size (the pipeline scales the requested
        # size to max_area, 1024² by default), so the result lines up with it on the contact sheet.
        sample = common.diffusers_sampler(self, src, denoiser, cfg, device, dtype, default_guidance=comfyui.GUIDANCE,
                                          source_kwargs=lambda image: {"image": image, "_auto_resize": False,
                                                                       "max_area": image.width * image.height})
        return flux_model.masked_sampler(sample, denoiser) if self.text_options(cfg) else sample

    def export_metadata(self, cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
        return flux_keys.metadata(cfg, record, architecture="flux-1-kontext-dev/lora")

    def comfyui_nodes(self, lora_name: str, prompt: str, negative: str, seed: int, prefix: str,
                      with_clip: bool, model: Any = None) -> list[Any]:
        return comfyui.nodes(lora_name, prompt, negative, seed, prefix, with_clip=with_clip, model=model)
