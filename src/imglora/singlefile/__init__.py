"""Loading the single files users actually have: SGM SDXL checkpoints, BFL FLUX.1 transformers
(bf16 or fp8, bare or in ComfyUI checkpoints), ComfyUI's clip_l / t5xxl / ae files, found by bare
name in a ComfyUI folder.

Everything reads safetensors only (never a pickle), never touches the network (configs come from
a diffusers folder of the same model), checks that the converted weights fill the model exactly,
and returns diffusers / transformers modules equal to those ``from_pretrained`` gives for the
same weights.

* ``inspect.describe(path)``: what a file is, from its header alone.
* ``sdxl.load_sdxl`` / ``sdxl.prediction_type``: SDXL parts from one SGM file.
* ``flux.load_flux_transformer``: FLUX.1 streamed block by block; ``flux.flux_plan`` its key map.
* ``text.load_clip_l`` / ``text.load_t5`` / ``text.load_flux_vae``: FLUX's other files.
* ``comfyui.find_model_file`` / ``comfyui.tokenizer_dirs``: ComfyUI's folder search.
"""

from __future__ import annotations

from .comfyui import find_model_file, model_folders, tokenizer_dirs
from .flux import flux_plan, load_flux_transformer
from .inspect import Layout, describe
from .sdxl import load_sdxl, prediction_type, zero_terminal_snr
from .text import load_clip_l, load_flux_vae, load_t5

__all__ = [
    "Layout",
    "describe",
    "find_model_file",
    "flux_plan",
    "load_clip_l",
    "load_flux_transformer",
    "load_flux_vae",
    "load_sdxl",
    "load_t5",
    "model_folders",
    "prediction_type",
    "tokenizer_dirs",
    "zero_terminal_snr",
]
