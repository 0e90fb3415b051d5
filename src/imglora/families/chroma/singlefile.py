"""Chroma from the single files ComfyUI users have: the transformer (``Chroma1-HD.safetensors``, BFL's
layout as lodestones publish it, maybe fp8), T5-XXL (``t5xxl_fp16.safetensors``) and FLUX's VAE
(``ae.safetensors``), found by path or by bare name in a ComfyUI install, with the shipped
Chroma1-HD configs and T5's tokenizer.

The transformer's keys are FLUX.1's block keys without the modulation layers, plus the approximator
(``distilled_guidance_layer``), as diffusers' ``convert_chroma_transformer_checkpoint_to_diffusers``
maps them (checked against it in the tests); it is read block by block as FLUX.1's file is
(``flux.singlefile.load_flux_transformer`` with this plan).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...errors import ModelSourceError
from ..flux.singlefile import Source, flux_plan, load_flux_transformer, plan_weights
from .._shared.singlefile.inspect import expect

SHIPPED = Path(__file__).parent / "configs" / "chroma1-hd"
KIND = "chroma-transformer"
T5_TOKENIZER = [("lodestones/Chroma1-HD", "tokenizer"), ("lodestones/Chroma1-Base", "tokenizer"),
                ("black-forest-labs/FLUX.1-dev", "tokenizer_2"), ("google/t5-v1_1-xxl", "")]
# part -> (preset key, ComfyUI folders, the kind of file, an example name)
PARTS = {"text_encoder": ("text_encoder", ("text_encoders",), "t5xxl", "t5xxl_fp16.safetensors"),
         "vae": ("vae", ("vae",), "vae-flux", "ae.safetensors")}
_MODULATIONS = ("norm1.linear", "norm1_context.linear", "norm.linear", "time_text_embed.", "norm_out.linear")


def chroma_plan(config: Mapping[str, Any]) -> dict[str, Source]:
    """Every key of ``ChromaTransformer2DModel(**config)`` -> where it is in a Chroma file: FLUX.1's
    plan for the blocks and embedders (no modulation layers in Chroma's blocks), and the approximator."""
    c = dict(config)
    plan = {k: v for k, v in flux_plan({**c, "guidance_embeds": False}).items()
            if not any(m in k for m in _MODULATIONS)}
    for e in ("weight", "bias"):
        for d in ("in_proj", "out_proj"):
            plan[f"distilled_guidance_layer.{d}.{e}"] = (f"distilled_guidance_layer.{d}.{e}", None, "copy")
        for i in range(c.get("approximator_layers", 5)):
            for d, b in (("linear_1", "in_layer"), ("linear_2", "out_layer")):
                plan[f"distilled_guidance_layer.layers.{i}.{d}.{e}"] = (
                    f"distilled_guidance_layer.layers.{i}.{b}.{e}", None, "copy")
    for i in range(c.get("approximator_layers", 5)):
        plan[f"distilled_guidance_layer.norms.{i}.weight"] = (f"distilled_guidance_layer.norms.{i}.scale", None, "copy")
    return plan


load_chroma_transformer = partial(load_flux_transformer, model_class="ChromaTransformer2DModel", kind=KIND,
                                  planner=chroma_plan)


def resolve_files(model: Any, find: Any) -> Any:
    """The transformer file (``model.path``, in ComfyUI's diffusion_models folder), T5
    (``model.text_encoder``) and the VAE (``model.vae``), with the shipped Chroma1-HD configs (or
    ``model.config``) and T5's tokenizer (the Hugging Face cache, or ComfyUI's)."""
    from ...models.source import ModelSource
    from .._shared.singlefile.configdir import assemble, find_parts, find_tokenizer, override

    path = find(model.path, ("diffusion_models", "checkpoints"), "model.path")
    expect(path, KIND)
    parts, missing = find_parts(model, find, PARTS, expect)
    files = {"transformer": path, **parts}
    if model.text_encoder_2:
        raise ModelSourceError("model.text_encoder_2: Chroma has one text encoder (T5-XXL); give it as "
                               "model.text_encoder")
    if missing:
        raise ModelSourceError(f"{path} is a Chroma transformer alone; Chroma also needs T5-XXL and FLUX's VAE as "
                               f"files: set {', '.join(missing)}")
    if model.config:
        return ModelSource(override(model.config), files)
    t5, _ = find_tokenizer("t5", T5_TOKENIZER, model.comfyui, "Chroma's T5")
    return ModelSource(assemble("chroma1-hd", SHIPPED, {"tokenizer": t5}, {}), files)


def load_vae(src: Any, dtype: torch.dtype) -> Any:
    from .._shared.singlefile.text import load_flux_vae

    return load_flux_vae(src.files["vae"], src.root / "vae", dtype)


def load_t5(src: Any, dtype: torch.dtype) -> Any:
    from .._shared.singlefile.text import load_t5 as read

    return read(src.files["text_encoder"], src.root / "text_encoder", dtype)


def base_weights(src: Any, component: str, paths: list[str]) -> dict[str, torch.Tensor]:
    """fp32 weights (``<path>.weight``) of transformer modules, from the file (DoRA's export)."""
    if component != "transformer":
        raise ModelSourceError(f"no base weights of Chroma's {component} are read for export")
    from diffusers import ChromaTransformer2DModel

    from ...models.safefiles import diffusers_config

    plan = chroma_plan(diffusers_config(ChromaTransformer2DModel, src.root, "transformer"))
    return plan_weights(src.files["transformer"], KIND, plan, paths)
