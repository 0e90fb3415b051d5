"""FLUX.2 from the single files ComfyUI users have: the transformer in BFL's layout
(``flux-2-klein-base-4b.safetensors``, ``flux2_dev_fp8mixed.safetensors``, BFL's own
``flux-2-klein-base-9b-fp8.safetensors``: bare or under ``model.diffusion_model.``, bf16, fp8 or
ComfyUI's scaled/mixed fp8), its VAE (``flux2-vae.safetensors``, BFL's ``ae.safetensors``: the LDM
layout with its quant convs inside the encoder and decoder and the batch-norm statistics ``bn.*``)
and, for [klein], Qwen3 (``qwen_3_4b.safetensors`` for 4B, ``qwen_3_8b*.safetensors`` for 9B:
Hugging Face's names). Which model a transformer file is comes from its shapes (txt_in's width);
its configs are the shipped ones of that model (or ``model.config``), the tokenizer Qwen's (the
Hugging Face cache, or ComfyUI's ``qwen25_tokenizer``, which ComfyUI's [klein] uses).

For [dev], Mistral-Small-3 (``mistral_3_small_flux2_bf16.safetensors`` / ``_fp8``, Comfy-Org/flux2-dev's
``split_files/text_encoders/``): its language model in Hugging Face's names, of which the first 30 layers
are read (see ``load_mistral``), with Mistral's tokenizer and chat template from FLUX.2 [dev]'s
``tokenizer/`` (the Hugging Face cache, or ``model.config``'s folder). Without ``model.text_encoder``,
[dev] reads it from the diffusers folder given as ``model.config``.

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
MISTRAL_KIND = "mistral3-small"
TEXT_KINDS = {"klein-4b": ("qwen3-4b",), "klein-9b": ("qwen3-8b",), "dev": (MISTRAL_KIND,),
              None: ("qwen3-4b", "qwen3-8b", MISTRAL_KIND)}
TOKENIZER = [("black-forest-labs/FLUX.2-klein-base-4B", "tokenizer"), ("black-forest-labs/FLUX.2-klein-4B", "tokenizer"),
             ("black-forest-labs/FLUX.2-klein-base-9B", "tokenizer"), ("Qwen/Qwen3-4B", ""), ("Qwen/Qwen3-8B", "")]
# [dev]'s: Mistral's tokenizer with its chat template, as the FLUX.2 [dev] folder keeps it (a gated repository)
MISTRAL_TOKENIZER = [("black-forest-labs/FLUX.2-dev", "tokenizer")]
EXAMPLE_TE = {"klein-4b": "qwen_3_4b.safetensors", "klein-9b": "qwen_3_8b_fp8mixed.safetensors",
              "dev": "mistral_3_small_flux2_bf16.safetensors"}
TE_NAME = {"klein-4b": "Qwen3-4B", "klein-9b": "Qwen3-8B", "dev": "Mistral-Small-3"}
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
    (``model.vae``) and its text encoder (``model.text_encoder``: Qwen3 for [klein], Mistral-Small-3 for
    [dev]), with the shipped configs of the model the transformer's shapes name (or ``model.config``) and
    its tokenizer (Qwen's, or for [dev] Mistral's from FLUX.2 [dev]'s folder). [dev] without
    ``model.text_encoder`` reads Mistral from ``model.config``'s diffusers folder."""
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
    files, missing = find_parts(model, find, parts, expect)
    if model.text_encoder:
        files["text_encoder"] = find(model.text_encoder, ("text_encoders", "clip"), "model.text_encoder")
        expect(files["text_encoder"], *TEXT_KINDS[variant])
    elif not (variant == "dev" and model.config):  # ([dev] with model.config: Mistral from that folder)
        missing.insert(0, f"model.text_encoder (e.g. {EXAMPLE_TE.get(variant or 'klein-4b')})")
    if missing:
        folder = (" (or, for the text encoder, model.config to the FLUX.2 [dev] diffusers folder: its text_encoder/ and "
                  "tokenizer/ are read)" if variant == "dev" and not model.text_encoder else "")
        raise ModelSourceError(f"{path} is a FLUX.2 transformer alone; FLUX.2 also needs "
                               f"{TE_NAME[variant or 'klein-4b']} and its VAE as files: set {', '.join(missing)}{folder}")
    files = {"transformer": path, **files}
    if model.config:
        return ModelSource(override(model.config), files)
    if variant == "dev":
        tokenizer, _ = find_tokenizer(
            "mistral", MISTRAL_TOKENIZER, model.comfyui, "FLUX.2 [dev]'s Mistral-Small-3",
            note=" (black-forest-labs/FLUX.2-dev is gated: accept its licence on Hugging Face and log in first). "
                 "The text encoder file carries Mistral's tekken tokenizer, but not the chat template FLUX.2 [dev]'s "
                 "captions are encoded in: imglora reads both from that tokenizer/ folder")
    else:
        tokenizer, _ = find_tokenizer("qwen25", TOKENIZER, model.comfyui, "FLUX.2 [klein]'s Qwen3")
    return ModelSource(assemble(SHIPPED[variant].name, SHIPPED[variant], {"tokenizer": tokenizer}, {}), files)


def load_text_encoder(src: Any, dtype: torch.dtype) -> Any:
    """Qwen3Model (the hidden states are what [klein] reads; no LM head) from ComfyUI's file."""
    from .._shared.singlefile.text import load_qwen3

    return load_qwen3(src.files["text_encoder"], src.root, dtype, ("qwen3-4b", "qwen3-8b"), "FLUX.2 [klein]'s Qwen3",
                      "the Qwen3 config given (model.config, or the shipped one of the model its transformer is)")


# The layout of Comfy-Org's mistral_3_small_flux2_*.safetensors, from ComfyUI's reader of it:
# - comfy/sd.py::detect_te_model: "model.layers.0.post_attention_layernorm.weight" of width 5120 (no q_norm) is
#   TEModel.MISTRAL3_24B "if 'model.layers.39.post_attention_layernorm.weight' in sd", else
#   MISTRAL3_24B_PRUNED_FLUX2; both load as comfy.text_encoders.flux.flux2_te(..., pruned=...), the
#   tokenizer from the file's "tekken_model" tensor.
# - comfy/text_encoders/llama.py: Mistral3Small24B is `self.model = Llama2_(config)`: embed_tokens,
#   layers.N.self_attn.{q,k,v,o}_proj, layers.N.mlp.{gate,up,down}_proj, layers.N.{input,post_attention}_layernorm,
#   norm (all without biases; Mistral3Small24BConfig: 131072 x 5120, 32768, 32 heads, 8 kv heads of 128,
#   rope_theta 1e9), i.e. transformers' MistralModel names under "model.".
# - comfy/text_encoders/flux.py: Mistral3_24BModel(layer=[10, 20, 30], layer_norm_hidden_state=False); pruned:
#   model_options["num_layers"] = 30 and, below 40 layers, "final_norm" False. (ComfyUI's Llama2_ collects a
#   layer's state before running it, so its 10, 20, 30 are transformers' hidden_states[10], [20], [30].)
# - Third-party readers of the same file: InvokeAI's mistral_encoder.py (PR 9234: "the 30-layer ... Comfy-Org
#   safetensors") loads model.* into a transformers MistralModel; dinkster_inference pins its header as 30
#   layers, model.norm.weight kept, vision_tower.*, multi_modal_projector.* and tekken_model beside model.*.
MISTRAL_DEPTH = 30  # max(model.DEV_LAYERS) (model imports this module): the last state [dev] reads is layer 30's
MISTRAL_BESIDE = ("vision_tower.", "multi_modal_projector.", "tekken_model", "lm_head.")  # not needed for text


def _layer(key: str) -> int:
    """The layer index of a ``model.layers.N.*`` key, else -1."""
    parts = key.split(".")
    return int(parts[2]) if key.startswith("model.layers.") and len(parts) > 2 and parts[2].isdigit() else -1


def load_mistral(src: Any, dtype: torch.dtype) -> Any:
    """Mistral-Small-3's language model as FLUX.2 [dev] reads it, from ComfyUI's file: a MistralModel of
    the config's text_config cut to its first 30 layers, with no final norm. For text the Mistral3
    generation model's states are its language model's, and FLUX.2 [dev] reads hidden_states 10, 20 and
    30: with 40 layers the 30th is layer 29's output before any norm, which is what these 30 layers give
    (transformers replaces a model's last state by the normed one, hence the norm is left out, as ComfyUI
    builds its cut model with final_norm False). The full file (40 layers) and ComfyUI's cut one (30)
    read alike; layers 30 to 39, the final norm, the vision tower and projector are not read."""
    import copy

    from transformers import Mistral3Config, MistralModel

    from ...models.safefiles import hf_config, note_ignored

    layout = expect(src.files["text_encoder"], MISTRAL_KIND)
    config = copy.deepcopy(hf_config(Mistral3Config, src.root, "text_encoder").text_config)
    config.num_hidden_layers = MISTRAL_DEPTH
    encoder = empty_model(lambda: MistralModel(config))
    encoder.norm = torch.nn.Identity()
    with open_file(layout.path) as r:
        keys = [k for k in r.with_prefix("model.") if _layer(k) < MISTRAL_DEPTH and k != "model.norm.weight"]
        skipped = set(keys) | {k for k in r.keys if k.startswith(MISTRAL_BESIDE) or _layer(k) >= MISTRAL_DEPTH}
        note_ignored(r.path, sorted(set(r.with_prefix("")) - skipped - {"model.norm.weight"}))
        state = {k[len("model."):]: r.get(k, dtype) for k in keys}
    return fill(encoder, state, path=layout.path, what="FLUX.2 [dev] Mistral-Small-3 text encoder",
                hint="the Mistral-Small-3 config given (model.config, or the shipped FLUX.2 [dev] one)")


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
