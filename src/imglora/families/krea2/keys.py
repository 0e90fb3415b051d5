"""Krea 2's export form, as ComfyUI's loader maps it (``comfy/lora.py``'s Krea2 branch over
``comfy/utils.py::krea2_to_diffusers``): diffusers' names map one to one onto ComfyUI's (``to_q`` ->
``wq``, ``to_out.0`` -> ``wo``, ``ff.gate`` -> ``mlp.gate``, ``transformer_blocks`` -> ``blocks``), no
slices, under ``diffusion_model.``, ``transformer.``, ``lycoris_`` or no prefix.

- ``default``: ``transformer.<diffusers path>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha`` (and
  every other type's suffixes). Not ``diffusion_model.``: diffusers' Krea 2 loader takes any
  ``diffusion_model.`` key for ComfyUI's own names and refuses diffusers' names under it.
"""

from __future__ import annotations

from typing import Any

import torch

from ...adapters.forms import Module
from .._shared import one_stream

FORMATS = ("default",)


def tensors(modules: dict[str, Module], fmt: str, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return one_stream.transformer_tensors(modules, base, "Krea 2")


def metadata(cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
    f = cfg.family
    return {"ss_network_module": "networks.lora_krea2", "ss_base_model_version": "krea2",
            "modelspec.architecture": "Krea-2/lora", "modelspec.implementation": "https://huggingface.co/krea",
            "ss_timestep_sampling": f.timestep_sampling, "ss_discrete_flow_shift": f.discrete_flow_shift,
            "ss_sigmoid_scale": f.sigmoid_scale}
