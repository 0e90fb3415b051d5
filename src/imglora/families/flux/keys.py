"""FLUX's export forms.

- ``default``: the diffusers form, ``transformer.<path>.lora_A.weight`` / ``.lora_B.weight`` plus an
  ``.alpha`` per module. ComfyUI patches q, k and v into their slices of the fused BFL weights itself.
- ``kohya``: the kohya/BFL form, ``lora_unet_double_blocks_N_img_attn_qkv`` etc., with q/k/v (and the
  single blocks' MLP input) fused into one LoRA per BFL weight (``export.fuse``), for tools that want
  BFL names. CLIP-L weights map as ``lora_te1_``, T5 as ``lora_te3_`` (ComfyUI's names).

Tables checked against ComfyUI's comfy/utils.py ``flux_to_diffusers`` and diffusers'
lora_conversion_utils.py.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ...errors import ImgloraError
from ...adapters import KINDS
from ...adapters.forms import Module, comfy_tensors
from ...export.writer import LoraModule, add_unique, alpha_tensor, fuse, kohya_name, kohya_tensors
from .._shared.diffusers_image import clip_path

FORMATS = ("default", "kohya")  # default: the diffusers form
# The adapter types each form can hold: kohya fuses q, k and v (and the single blocks' MLP input) into
# one low-rank pair per BFL weight, which only plain LoRA factors into; the default form keeps every
# module, so every type. The config refuses another pairing before training (FluxFamily.check_config).
FORM_TYPES = {"default": tuple(KINDS), "kohya": ("lora",)}
KOHYA_FUSES = ("kohya fuses q, k and v (and the single blocks' MLP input) into one LoRA per FLUX.1 weight, which "
               "only plain LoRA can be")
TEXT_PREFIX = {"text_encoder": "lora_te1", "text_encoder_2": "lora_te3"}


def tensors(modules: dict[str, Module], fmt: str, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if fmt == "default":
        return diffusers_tensors(modules, base)
    other = sorted({m.kind for m in modules.values()} - set(FORM_TYPES[fmt]))
    if other:
        raise ImgloraError(f"--format {KOHYA_FUSES}; export {other[0]} with the default format (ComfyUI loads it, "
                           "patching each slice)")
    return kohya_form({name: lora_module(m) for name, m in modules.items()})


def lora_module(m: Module) -> LoraModule:
    alpha = m.scaling * m.rank if m.use_rslora else m.alpha  # loaders scale by alpha / rank
    return LoraModule(m.tensors["lora_A.weight"], m.tensors["lora_B.weight"], alpha)


def diffusers_tensors(modules: dict[str, Module], base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LoRA in the diffusers form (``lora_A``/``lora_B`` + ``alpha``, which diffusers loads too); DoRA,
    LoHa and LoKr under the same module names in the suffixes ComfyUI's loaders read
    (``adapter_forms.comfy_tensors``). ComfyUI applies ``norm_out``'s scale/shift swap to the patch
    but not to ``dora_scale``, so that one is swapped here."""
    out: dict[str, torch.Tensor] = {}
    for module, m in modules.items():
        if not module.startswith(("transformer.", "text_encoder.")):
            raise ImgloraError(f"{module}: the FLUX diffusers form has no mapping for this component; "
                               "use --format kohya (T5 weights map as lora_te3_)")
        name = module  # ComfyUI maps text_encoder.text_model.encoder.layers... for CLIP-L
        if module.startswith("text_encoder."):
            name = "text_encoder." + clip_path(module.split(".", 1)[1])
        if m.kind == "lora":
            lm = lora_module(m)
            out.update({f"{name}.lora_A.weight": lm.down, f"{name}.lora_B.weight": lm.up,
                        f"{name}.alpha": alpha_tensor(lm.alpha)})
            continue
        t = comfy_tensors(m, base.get(module))
        if "dora_scale" in t and module.startswith("transformer.") and \
                _FLUX_GLOBAL.get(module.split(".", 1)[1]) in FLUX_SWAP_HALVES:
            scale, shift = t["dora_scale"].chunk(2, dim=0)
            t["dora_scale"] = torch.cat([shift, scale], dim=0)
        out.update({f"{name}.{k}": v for k, v in t.items()})
    return out


# diffusers FLUX module -> BFL module (ComfyUI's flux_to_diffusers, read backwards).
_FLUX_DOUBLE = {
    "attn.to_q": "img_attn.qkv", "attn.to_k": "img_attn.qkv", "attn.to_v": "img_attn.qkv",
    "attn.add_q_proj": "txt_attn.qkv", "attn.add_k_proj": "txt_attn.qkv", "attn.add_v_proj": "txt_attn.qkv",
    "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
    "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
}
_FLUX_SINGLE = {
    "attn.to_q": "linear1", "attn.to_k": "linear1", "attn.to_v": "linear1", "proj_mlp": "linear1",
    "proj_out": "linear2", "norm.linear": "modulation.lin",
}
_FLUX_GLOBAL = {
    "x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
}
# Fused BFL weights: their diffusers parts in output-row order, each part's rows in units of the
# hidden size (q, k, v: 1; the single blocks' MLP input: mlp_ratio 4).
FLUX_FUSED = {
    "img_attn.qkv": (("attn.to_q", 1), ("attn.to_k", 1), ("attn.to_v", 1)),
    "txt_attn.qkv": (("attn.add_q_proj", 1), ("attn.add_k_proj", 1), ("attn.add_v_proj", 1)),
    "linear1": (("attn.to_q", 1), ("attn.to_k", 1), ("attn.to_v", 1), ("proj_mlp", 4)),
}
# diffusers' AdaLayerNormContinuous chunks (scale, shift); BFL's LastLayer chunks (shift, scale).
FLUX_SWAP_HALVES = {"final_layer.adaLN_modulation.1"}
_FLUX_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def flux_bfl_module(path: str) -> str:
    """``transformer_blocks.3.attn.to_k`` -> ``double_blocks.3.img_attn.qkv`` (paths without ``transformer.``)."""
    m = _FLUX_BLOCK.match(path)
    if m:
        kind, n, rest = m.groups()
        double = kind == "transformer_blocks"
        table, bfl = (_FLUX_DOUBLE, "double_blocks") if double else (_FLUX_SINGLE, "single_blocks")
        if rest in table:
            return f"{bfl}.{n}.{table[rest]}"
    elif path in _FLUX_GLOBAL:
        return _FLUX_GLOBAL[path]
    raise ImgloraError(f"transformer.{path}: no FLUX.1 (BFL) weight corresponds to this module; "
                       "export it with the default format")


def flux_fused_parts(bfl: str) -> tuple[tuple[str, int], ...] | None:
    """For a fused BFL module, ``(diffusers path, rows in hidden-size units)`` of its parts; else None."""
    m = re.match(r"^(double_blocks|single_blocks)\.(\d+)\.(.+)$", bfl)
    if not m or m[3] not in FLUX_FUSED:
        return None
    prefix = f"{'transformer_blocks' if m[1] == 'double_blocks' else 'single_transformer_blocks'}.{m[2]}."
    return tuple((prefix + part, mult) for part, mult in FLUX_FUSED[m[3]])


def kohya_form(modules: dict[str, LoraModule]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    by_target: dict[str, dict[str, LoraModule]] = {}
    for module, m in modules.items():
        component, path = module.split(".", 1)
        if component != "transformer":
            if component not in TEXT_PREFIX:
                raise ImgloraError(f"no kohya name for FLUX component {component!r}")
            name = kohya_name(TEXT_PREFIX[component], clip_path(path) if component == "text_encoder" else path)
            add_unique(out, kohya_tensors(name, m))
            continue
        by_target.setdefault(flux_bfl_module(path), {})[path] = m
    for bfl, trained in sorted(by_target.items()):
        parts = flux_fused_parts(bfl)
        if parts is None:
            (m,) = trained.values()
            if bfl in FLUX_SWAP_HALVES:
                scale, shift = m.up.chunk(2, dim=0)
                m = LoraModule(m.down, torch.cat([shift, scale], dim=0), m.alpha)
        else:
            hidden = next(iter(trained.values())).down.shape[1]  # every part reads the hidden state
            rows = [mult * hidden for _, mult in parts]
            for (path, _), n_rows in zip(parts, rows):
                if path in trained and trained[path].up.shape[0] != n_rows:
                    raise ImgloraError(f"transformer.{path} has {trained[path].up.shape[0]} outputs, a FLUX.1 "
                                       f"{bfl} slice has {n_rows}; use the default format for this model")
            m = fuse([trained.get(path) for path, _ in parts], rows)
        add_unique(out, kohya_tensors(kohya_name("lora_unet", bfl), m))
    return out


def metadata(cfg: Any, record: dict[str, Any], base: str = "flux1", architecture: str = "flux-1-dev/lora",
             implementation: str = "https://github.com/black-forest-labs/flux") -> dict[str, Any]:
    """kohya's and modelspec's header entries (``base`` and ``architecture`` for the families on
    FLUX.1's architecture)."""
    f = cfg.family
    out = {"ss_network_module": "networks.lora_flux", "ss_base_model_version": base,
           "modelspec.architecture": architecture,
           "modelspec.implementation": implementation,
           "ss_timestep_sampling": f.timestep_sampling, "ss_discrete_flow_shift": f.discrete_flow_shift,
           "ss_sigmoid_scale": f.sigmoid_scale}
    if hasattr(f, "guidance"):  # Chroma has no guidance embedding
        out["ss_guidance_scale"] = f.guidance
    # kohya's key: T5's mask in training (Chroma's is always on: its pipeline masks too)
    out["ss_apply_t5_attn_mask"] = getattr(f, "apply_t5_attn_mask", base == "chroma")
    return out
