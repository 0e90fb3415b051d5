"""FLUX.2 from the single files ComfyUI users have: the transformer in BFL's layout
(``flux-2-klein-base-4b.safetensors``, ``flux2_dev_fp8mixed.safetensors``, BFL's own
``flux-2-klein-base-9b-fp8.safetensors``: bare or under ``model.diffusion_model.``, bf16, fp8 or
ComfyUI's scaled/mixed fp8), its VAE (``flux2-vae.safetensors``, BFL's ``ae.safetensors``: the LDM
layout with its quant convs inside the encoder and decoder and the batch-norm statistics ``bn.*``)
and, for [klein], Qwen3 (``qwen_3_4b.safetensors`` for 4B, ``qwen_3_8b*.safetensors`` for 9B:
Hugging Face's names). Which model a transformer file is comes from its shapes (txt_in's width);
its configs are the shipped ones of that model (or ``model.config``), the tokenizer Qwen's (the
Hugging Face cache, or ComfyUI's ``qwen25_tokenizer``, which ComfyUI's [klein] uses).

FLUX.2 [dev]'s text encoder (Mistral-Small-3, 24B, with its Pixtral processor) is not read from a
file: [dev] from files reads it from the diffusers folder given as ``model.config``.

The transformer's names map as diffusers' ``convert_flux2_transformer_checkpoint_to_diffusers`` maps
them (checked against it in the tests): the double blocks' fused ``qkv`` rows are q, k and v (read as
rows), the single blocks' ``linear1``/``linear2`` stay whole (``to_qkv_mlp_proj``, ``to_out``), norm
``scale``s are ``weight``s, and the final adaLN's two halves are swapped (BFL: shift, scale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...errors import ModelSourceError
from ...models.safefiles import Reader, diffusers_config, empty_model, fill, open_file
from .._shared.singlefile import streamed
from .._shared.singlefile.inspect import expect
from .._shared.singlefile.streamed import Part

CONFIGS = Path(__file__).parent / "configs"
SHIPPED = {"klein-4b": CONFIGS / "flux2-klein-base-4b", "klein-9b": CONFIGS / "flux2-klein-base-9b",
           "dev": CONFIGS / "flux2-dev"}
KIND = "flux2-transformer"
VAE_KIND = "vae-flux2"
TEXT_KINDS = {"klein-4b": ("qwen3-4b",), "klein-9b": ("qwen3-8b",), None: ("qwen3-4b", "qwen3-8b")}
TOKENIZER = [("black-forest-labs/FLUX.2-klein-base-4B", "tokenizer"), ("black-forest-labs/FLUX.2-klein-4B", "tokenizer"),
             ("black-forest-labs/FLUX.2-klein-base-9B", "tokenizer"), ("Qwen/Qwen3-4B", ""), ("Qwen/Qwen3-8B", "")]
EXAMPLE_TE = {"klein-4b": "qwen_3_4b.safetensors", "klein-9b": "qwen_3_8b_fp8mixed.safetensors"}
VAE_EXAMPLE = "flux2-vae.safetensors"

# BFL name -> diffusers name, outside the blocks (diffusers' converter's renames)
TOP = {"img_in": "x_embedder", "txt_in": "context_embedder",
       "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
       "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
       "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
       "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
       "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
       "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
       "single_stream_modulation.lin": "single_stream_modulation.linear",
       "final_layer.linear": "proj_out"}
SWAPPED = {"final_layer.adaLN_modulation.1": "norm_out.linear"}  # [shift; scale] -> [scale; shift]
DOUBLE = {"img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
          "img_attn.proj": "attn.to_out.0", "img_mlp.0": "ff.linear_in", "img_mlp.2": "ff.linear_out",
          "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
          "txt_attn.proj": "attn.to_add_out", "txt_mlp.0": "ff_context.linear_in", "txt_mlp.2": "ff_context.linear_out"}
FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
         "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
SINGLE = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out", "norm.query_norm": "attn.norm_q",
          "norm.key_norm": "attn.norm_k"}


def diffusers_names(r: Reader, prefix: str) -> streamed.Names:
    """{diffusers key: its part of the file} for the BFL keys under ``prefix``. A key this map does
    not know keeps its BFL name (so a file that does not fit names it)."""
    out: streamed.Names = {}
    for key in r.with_prefix(prefix):
        name = key[len(prefix):]
        stem, _, suffix = name.rpartition(".")
        suffix = "weight" if suffix == "scale" else suffix
        parts = stem.split(".")
        if stem in TOP:
            out[f"{TOP[stem]}.{suffix}"] = Part(key)
        elif stem in SWAPPED:
            h = r.shape(key)[0] // 2
            out[f"{SWAPPED[stem]}.{suffix}"] = Part(key, ((h, 2 * h), (0, h)))
        elif parts[0] in ("double_blocks", "single_blocks") and len(parts) > 2:
            rest = ".".join(parts[2:])
            if parts[0] == "double_blocks" and rest in FUSED:
                for target, part in zip(FUSED[rest], streamed.thirds(key, r.shape(key)[0])):
                    out[f"transformer_blocks.{parts[1]}.{target}.{suffix}"] = part
                continue
            table, lists = (DOUBLE, "transformer_blocks") if parts[0] == "double_blocks" else \
                (SINGLE, "single_transformer_blocks")
            out[f"{lists}.{parts[1]}.{table.get(rest, rest)}.{suffix}" if rest in table else name] = Part(key)
        else:
            out[name] = Part(key)
    return out


def _names(path: Path) -> tuple[Any, Any]:
    layout = expect(path, KIND)
    return layout, lambda r: diffusers_names(r, layout.prefix)


def load_transformer(path: Path, root: Path, dtype: torch.dtype = torch.float32, on_block: Any = None, *,
                     blocks: dict[str, str]) -> Any:
    """Flux2Transformer2DModel (the config of ``root``) from a BFL-layout file, block by block."""
    layout, names = _names(path)
    return streamed.load_transformer(layout.path, "Flux2Transformer2DModel", root, names, blocks, dtype, on_block,
                                     "FLUX.2 transformer", "the FLUX.2 config given (model.config, or the shipped "
                                     "one of the model its shapes name)")


def base_weights(src: Any, component: str, paths: list[str]) -> dict[str, torch.Tensor]:
    """fp32 weights of transformer modules, from the file (DoRA's export): q, k and v as their rows
    of the fused ``qkv``."""
    if component != "transformer":
        raise ModelSourceError(f"no base weights of FLUX.2's {component} are read for export")
    layout, names = _names(src.files["transformer"])
    return streamed.base_weights(layout.path, names, paths, "FLUX.2 transformer")


# --------------------------------------------------------------------------------------------
# the other parts, and the folder of configs
# --------------------------------------------------------------------------------------------


def resolve_files(model: Any, find: Any) -> Any:
    """The transformer file (``model.path``, in ComfyUI's diffusion_models folder), FLUX.2's VAE
    (``model.vae``) and, for [klein], Qwen3 (``model.text_encoder``), with the shipped configs of the
    model the transformer's shapes name (or ``model.config``) and Qwen's tokenizer."""
    from ...models.source import ModelSource
    from .._shared.singlefile.configdir import assemble, find_parts, find_tokenizer, override

    path = find(model.path, ("diffusion_models", "unet", "checkpoints"), "model.path")
    layout = expect(path, KIND)
    variant = layout.variant
    if model.text_encoder_2:
        raise ModelSourceError("model.text_encoder_2: FLUX.2 has one text encoder; give it as model.text_encoder")
    if variant is None and not model.config:
        raise ModelSourceError(f"{path} is a FLUX.2 transformer of a size imglora ships no config for ({layout.note}); "
                               "set model.config to a diffusers folder of the same model")
    parts: dict[str, tuple[str, tuple[str, ...], str, str]] = {
        "vae": ("vae", ("vae",), VAE_KIND, VAE_EXAMPLE)}
    if variant == "dev":
        if model.text_encoder:
            te = find(model.text_encoder, ("text_encoders", "clip"), "model.text_encoder")
            raise ModelSourceError(
                f"{te}: FLUX.2 [dev]'s Mistral-Small-3 text encoder is not read from a single file. Leave "
                "model.text_encoder empty and set model.config to the FLUX.2 [dev] diffusers folder (its text_encoder/ "
                "and tokenizer/ are read from there), or give that folder as model.path")
        if not model.config:
            raise ModelSourceError(f"{path} is FLUX.2 [dev]: its Mistral-Small-3 text encoder is read from the "
                                   "diffusers folder only; set model.config to the FLUX.2 [dev] folder "
                                   "(black-forest-labs/FLUX.2-dev)")
    else:
        parts["text_encoder"] = ("text_encoder", ("text_encoders", "clip"), TEXT_KINDS[variant][0],
                                 EXAMPLE_TE.get(variant or "klein-4b", "qwen_3_4b.safetensors"))
    files, missing = find_parts(model, find, {k: v for k, v in parts.items() if k != "text_encoder"}, expect)
    if "text_encoder" in parts:
        if model.text_encoder:
            files["text_encoder"] = find(model.text_encoder, ("text_encoders", "clip"), "model.text_encoder")
            expect(files["text_encoder"], *TEXT_KINDS[variant])
        else:
            missing.insert(0, f"model.text_encoder (e.g. {parts['text_encoder'][3]})")
    if missing:
        te = {"dev": "", "klein-9b": "Qwen3-8B and "}.get(variant or "", "Qwen3-4B and ")
        raise ModelSourceError(f"{path} is a FLUX.2 transformer alone; FLUX.2 also needs {te}its VAE as files: set "
                               f"{', '.join(missing)}")
    files = {"transformer": path, **files}
    if model.config:
        return ModelSource(override(model.config), files)
    tokenizer, _ = find_tokenizer("qwen25", TOKENIZER, model.comfyui, "FLUX.2 [klein]'s Qwen3")
    return ModelSource(assemble(SHIPPED[variant].name, SHIPPED[variant], {"tokenizer": tokenizer}, {}), files)


def load_text_encoder(src: Any, dtype: torch.dtype) -> Any:
    """Qwen3Model (the hidden states are what [klein] reads; no LM head) from ComfyUI's file."""
    from .._shared.singlefile.text import load_qwen3

    return load_qwen3(src.files["text_encoder"], src.root, dtype, ("qwen3-4b", "qwen3-8b"), "FLUX.2 [klein]'s Qwen3",
                      "the Qwen3 config given (model.config, or the shipped one of the model its transformer is)")


def vae_state(r: Reader, prefix: str, config: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """AutoencoderKLFlux2's state from BFL's layout: the quant convs (inside the encoder and the
    decoder in BFL's module tree) renamed to LDM's top-level ones, as ComfyUI does, then diffusers'
    ``convert_ldm_vae_checkpoint``; the batch-norm statistics as they are (and the count of batches
    they were tracked over, which inference never reads, as 0 where the file has none)."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    moved = {"encoder.quant_conv.": "quant_conv.", "decoder.post_quant_conv.": "post_quant_conv."}
    state = {}
    for key in r.with_prefix(prefix):
        name = key[len(prefix):]
        if name.startswith("bn."):
            continue
        for old, new in moved.items():
            if name.startswith(old):
                name = new + name[len(old):]
        state[name] = r.get(key, dtype)
    converted = convert_ldm_vae_checkpoint(state, config)
    left = sorted(set(state) - {k for k in state if k.startswith(("encoder.", "decoder.", "quant_conv.",
                                                                    "post_quant_conv."))})
    converted.update({k: state[k] for k in left})  # unknown keys: kept, so that fill names them
    for stat in ("running_mean", "running_var"):
        if f"{prefix}bn.{stat}" in r.key_set:
            converted[f"bn.{stat}"] = r.get(f"{prefix}bn.{stat}", dtype)
    converted["bn.num_batches_tracked"] = torch.tensor(0, dtype=torch.long)
    return converted


def load_vae(src: Any, dtype: torch.dtype) -> Any:
    """AutoencoderKLFlux2 from flux2-vae.safetensors (the config of ``src.root``'s ``vae/``)."""
    from diffusers import AutoencoderKLFlux2

    layout = expect(src.files["vae"], VAE_KIND)
    config = diffusers_config(AutoencoderKLFlux2, src.root, "vae")
    model = empty_model(lambda: AutoencoderKLFlux2.from_config(config))
    with open_file(layout.path) as r:
        state = vae_state(r, layout.prefix, config, dtype)
    return fill(model, state, path=layout.path, what="FLUX.2 VAE",
                hint="the FLUX.2 VAE config given (model.config, or the shipped one)")
