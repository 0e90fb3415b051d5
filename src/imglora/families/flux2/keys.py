"""FLUX.2's export form, as ComfyUI's loader maps it. ComfyUI's FLUX.2 model is its FLUX model
(``model_base.Flux2(Flux)``), so ``model_lora_keys_unet``'s Flux branch applies: diffusers' names from
``comfy/utils.py::flux_to_diffusers`` under ``transformer.`` (and three other prefixes), onto BFL's
weights: a double block's q, k and v as row slices of its fused ``img_attn.qkv`` (the text stream's
of ``txt_attn.qkv``), ``attn.to_out.0`` / ``attn.to_add_out`` as ``img_attn.proj`` / ``txt_attn.proj``,
``ff.linear_in`` / ``linear_out`` as ``img_mlp.0`` / ``.2`` (``ff_context``: ``txt_mlp``), and a single
block's fused ``attn.to_qkv_mlp_proj`` / ``attn.to_out`` as ``linear1`` / ``linear2`` whole.

- ``default``: ``transformer.<diffusers path>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``
  (LoHa ``hada_*``, LoKr ``lokr_*``, OFT ``oft_blocks``, DoRA ``+ dora_scale``: every type, each on
  its slice). ComfyUI maps no diffusers name of the shared modulation and time layers, so those are
  never adapted (``lora_targets``).
"""

from __future__ import annotations

from typing import Any

import torch

from ...adapters.forms import Module
from .._shared import one_stream

FORMATS = ("default",)


def tensors(modules: dict[str, Module], fmt: str, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return one_stream.transformer_tensors(modules, base, "FLUX.2")


def metadata(cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
    """kohya's and modelspec's header entries (musubi-tuner names FLUX.2 LoRAs' base this way)."""
    f = cfg.family
    kind = (record.get("model_facts") or {}).get("variant", "klein")
    return {"ss_network_module": "networks.lora_flux_2", "ss_base_model_version": f"flux2_{kind}",
            "modelspec.architecture": f"flux-2-{kind}/lora",
            "modelspec.implementation": "https://github.com/black-forest-labs/flux2",
            "ss_timestep_sampling": f.timestep_sampling, "ss_discrete_flow_shift": f.discrete_flow_shift,
            "ss_sigmoid_scale": f.sigmoid_scale}
