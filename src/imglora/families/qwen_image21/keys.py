"""Qwen-Image 2.1's export form, as ComfyUI's loader maps it (``comfy/lora.py``'s QwenImage branch,
2026): ComfyUI's module names are diffusers' one to one, except that it fuses each block's
``img_mlp.gate_layer`` and ``img_mlp.proj`` into one ``img_mlp.gate_up`` (gate rows first) when it
loads the model, and maps a LoRA's ``gate_layer`` / ``proj`` keys onto the two halves of that weight.
That map exists for diffusers' names under ``transformer.``, ``lycoris_`` or no prefix; under
``diffusion_model.`` only the fused name would load, so that prefix is not written.

- ``default``: ``transformer.<diffusers path>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha`` (and
  every other type's suffixes): what ComfyUI maps and diffusers' ``load_lora_weights`` reads.
"""

from __future__ import annotations

from typing import Any

import torch

from ...adapters.forms import Module
from .._shared import one_stream

FORMATS = ("default",)


def tensors(modules: dict[str, Module], fmt: str, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return one_stream.transformer_tensors(modules, base, "Qwen-Image 2.1")


def metadata(cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
    f = cfg.family
    return {"ss_network_module": "networks.lora_qwen_image", "ss_base_model_version": "qwen_image_2.1",
            "modelspec.architecture": "Qwen-Image-2.1/lora", "modelspec.implementation": "https://github.com/QwenLM/Qwen-Image",
            "ss_timestep_sampling": f.timestep_sampling, "ss_discrete_flow_shift": f.discrete_flow_shift,
            "ss_sigmoid_scale": f.sigmoid_scale}
