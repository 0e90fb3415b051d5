"""Z-Image's export form, as ComfyUI's loader maps it (``comfy/lora.py``, ``model_lora_keys_unet``'s
Lumina2 branch, which Z-Image's model is; the names from ``comfy/utils.py::z_image_to_diffusers``).

ComfyUI's Z-Image model fuses q, k and v into one ``attention.qkv`` weight and calls the output
projection ``attention.out``; its Lumina2 branch maps diffusers' module names onto those, q, k and v as
row slices of ``qkv`` (offsets 0, dim, 2·dim), under the prefixes ``diffusion_model.``,
``transformer.``, ``lycoris_`` and none. So one form carries every adapter type exactly:

- ``default``: ``diffusion_model.<diffusers path>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``
  (LoHa ``hada_*``, LoKr ``lokr_*``, OFT ``oft_blocks``, DoRA ``+ dora_scale`` against the slice),
  ai-toolkit's prefix for Z-Image, which diffusers' Z-Image loader converts as well.

kohya's ``lora_unet_layers_0_attention_to_q`` is not in ComfyUI's map (its generic ``lora_unet_``
names are the fused modules'), so that form is not offered.
"""

from __future__ import annotations

from typing import Any

import torch

from ...adapters.forms import Module, comfy_tensors
from ...errors import ImgloraError
from ...export.writer import add_unique

FORMATS = ("default",)


def module_name(module: str) -> str:
    """``transformer.layers.0.attention.to_q`` -> ``diffusion_model.layers.0.attention.to_q``."""
    component, path = module.split(".", 1)
    if component != "transformer":
        raise ImgloraError(f"{module}: Z-Image adapters export the transformer's modules only")
    return f"diffusion_model.{path}"


def tensors(modules: dict[str, Module], fmt: str, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for module, m in modules.items():
        add_unique(out, {f"{module_name(module)}.{k}": v for k, v in comfy_tensors(m, base.get(module)).items()})
    return out


def metadata(cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
    """kohya's and modelspec's header entries (as musubi-tuner's Z-Image LoRAs name the model)."""
    f = cfg.family
    return {"ss_network_module": "networks.lora_zimage", "ss_base_model_version": "z_image",
            "modelspec.architecture": "Z-Image/lora", "modelspec.implementation": "https://github.com/Tongyi-MAI/Z-Image",
            "ss_timestep_sampling": f.timestep_sampling, "ss_discrete_flow_shift": f.discrete_flow_shift,
            "ss_sigmoid_scale": f.sigmoid_scale}
