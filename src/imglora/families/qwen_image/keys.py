"""Qwen-Image's export forms. ComfyUI's Qwen-Image model has diffusers' module names one to one
(``comfy/ldm/qwen_image/model.py``), so no module is renamed or fused, and every adapter type goes
into both forms:

- ``default``: ``diffusion_model.<path>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha`` (LoHa
  ``hada_*``, LoKr ``lokr_*``, DoRA ``+ dora_scale``): ComfyUI's prefix for every model
  (``model_lora_keys_unet``'s generic loop), ai-toolkit's prefix for Qwen-Image, and a form
  diffusers' Qwen-Image loader converts.
- ``kohya``: ``lora_unet_<path, dots as underscores>``, as musubi-tuner saves Qwen-Image LoRAs
  (ComfyUI's generic loop maps it too).
"""

from __future__ import annotations

from typing import Any

import torch

from ...adapters.forms import Module, comfy_tensors
from ...errors import ImgloraError
from ...export.writer import add_unique, kohya_name

FORMATS = ("default", "kohya")


def module_name(module: str, fmt: str) -> str:
    """``transformer.transformer_blocks.0.attn.to_q`` -> ``diffusion_model.transformer_blocks.0.attn.to_q``
    (default) or ``lora_unet_transformer_blocks_0_attn_to_q`` (kohya)."""
    component, path = module.split(".", 1)
    if component != "transformer":
        raise ImgloraError(f"{module}: Qwen-Image adapters export the transformer's modules only")
    return f"diffusion_model.{path}" if fmt == "default" else kohya_name("lora_unet", path)


def tensors(modules: dict[str, Module], fmt: str, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for module, m in modules.items():
        name = module_name(module, fmt)
        add_unique(out, {f"{name}.{k}": v for k, v in comfy_tensors(m, base.get(module)).items()})
    return out


def metadata(cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
    """kohya's and modelspec's header entries, as musubi-tuner writes them for Qwen-Image."""
    f = cfg.family
    return {"ss_network_module": "networks.lora_qwen_image", "ss_base_model_version": "qwen_image",
            "modelspec.architecture": "Qwen-Image/lora", "modelspec.implementation": "https://github.com/QwenLM/Qwen-Image",
            "ss_timestep_sampling": f.timestep_sampling, "ss_discrete_flow_shift": f.discrete_flow_shift,
            "ss_sigmoid_scale": f.sigmoid_scale}
