"""SDXL's export forms: the kohya form with diffusers module paths, which ComfyUI maps for every
UNet Linear/Conv2d (``lora_unet_<path, dots as underscores>``) and text encoder layer
(``lora_te1_``/``lora_te2_``), and which diffusers loads too. ComfyUI does not map the attention
layers in the peft layout the trainer saves, so "default" is this form ("kohya" names the same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ...errors import ImgloraError
from ...adapters.forms import Module, comfy_tensors
from ...export.writer import add_unique, kohya_name
from .._shared.diffusers_image import clip_path

FORMATS = ("default", "kohya")  # the same form under both names
KOHYA_PREFIX = {"unet": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}


def module_name(module: str) -> str:
    """``unet.down_blocks.1.x.to_q`` -> ``lora_unet_down_blocks_1_x_to_q`` (text encoders: lora_te1_/te2_)."""
    component, path = module.split(".", 1)
    if component not in KOHYA_PREFIX:
        raise ImgloraError(f"no kohya name for SDXL component {component!r}")
    return kohya_name(KOHYA_PREFIX[component], path if component == "unet" else clip_path(path))


def tensors(modules: dict[str, Module], fmt: str, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every type under its kohya name: LoRA/DoRA ``lora_up``/``lora_down``/``alpha`` (+ ``dora_scale``),
    LoHa ``hada_*``, LoKr ``lokr_*``, as ComfyUI's loaders read them (``adapter_forms.comfy_tensors``)."""
    out: dict[str, torch.Tensor] = {}
    for module, m in modules.items():
        name = module_name(module)
        add_unique(out, {f"{name}.{k}": v for k, v in comfy_tensors(m, base.get(module)).items()})
    return out


def metadata(cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
    return {"ss_network_module": "networks.lora", "ss_base_model_version": "sdxl_base_v1-0",
            "modelspec.architecture": "stable-diffusion-xl-v1-base/lora",
            "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
            "ss_noise_offset": cfg.family.noise_offset, "ss_min_snr_gamma": cfg.family.min_snr_gamma,
            "modelspec.prediction_type": _prediction_type(record)}


def _prediction_type(record: dict[str, Any]) -> str:
    """What the trained UNet predicted, as the train record says (older records: the scheduler config)."""
    known = record.get("model_facts", {}).get("prediction_type")
    if known:
        return "v" if known == "v_prediction" else "epsilon"
    model_dir = record.get("model_dir")
    if not model_dir:
        return "epsilon"
    try:
        sched = json.loads((Path(model_dir) / "scheduler" / "scheduler_config.json").read_text())
    except (OSError, ValueError):
        return "epsilon"  # SDXL base 1.0
    return "v" if sched.get("prediction_type") == "v_prediction" else "epsilon"
