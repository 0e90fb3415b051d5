"""FLUX's separate files as ComfyUI users have them: clip_l, t5xxl (fp16 or fp8) and ae.

The same readers serve the copies of these parts inside full checkpoints (an SGM SDXL file's
CLIP-L and VAE, a ComfyUI FLUX checkpoint's ``text_encoders.*`` and ``vae.``), so each conversion
exists once. Configs come from a diffusers model folder of the same model (or a config object /
dict); nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ....errors import ModelSourceError
from ....models.safefiles import (PathLike, Reader, diffusers_config, empty_model, fill, hf_config, note_ignored,
                                  open_file)
from .inspect import SGM_CLIP_L, Layout, expect

FLUX_CLIP_L = "text_encoders.clip_l.transformer."
FLUX_T5 = "text_encoders.t5xxl.transformer."
FLUX_VAE = "vae."


def _part_prefix(layout: Layout, part: str, in_checkpoint: dict[str, str]) -> str:
    """Key prefix of ``part`` in the file: the layout's own for a single-part file, else where
    that kind of checkpoint keeps it (raising if this checkpoint has none)."""
    if layout.kind in in_checkpoint:
        if part not in layout.parts:
            raise ModelSourceError(f"{layout.path} is a {layout.kind} without a {part} (it holds "
                                   f"{', '.join(layout.parts)}); give the separate {part} file")
        return in_checkpoint[layout.kind]
    return layout.prefix


# --------------------------------------------------------------------------------------------
# CLIP-L
# --------------------------------------------------------------------------------------------


def clip_state(r: Reader, prefix: str, model: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-layout CLIP keys under ``prefix`` renamed to ``model``'s own.

    transformers 5 flattened CLIPTextModel (no ``text_model.`` level) while the released files
    and CLIPTextModelWithProjection keep it; a plain load_state_dict does not bridge that (kohya's
    ``load_state_dict(strict=False)`` would silently load nothing), so names are mapped here. A
    projection stored OpenCLIP-style (bare ``text_projection``, used as ``x @ P``) is transposed.
    Tensors the model has no place for (``position_ids``, ``logit_scale``, a projection for a
    model without one) are not read.
    """
    wanted = set(model.state_dict())
    nested = any(k.startswith("text_model.") for k in wanted)
    state: dict[str, torch.Tensor] = {}
    ignored = []
    for key in r.with_prefix(prefix):
        name = key[len(prefix):]
        transpose = name == "text_projection"
        if name.startswith("text_projection"):
            target = "text_projection.weight"
        else:
            bare = name.removeprefix("text_model.")
            target = f"text_model.{bare}" if nested else bare
        if target not in wanted:
            ignored.append(key)
            continue
        tensor = r.get(key, dtype)
        state[target] = tensor.T.contiguous() if transpose else tensor
    note_ignored(r.path, ignored)
    return state


def load_clip_l(path: PathLike, config_dir_or_config: Any, dtype: torch.dtype) -> Any:
    """CLIPTextModel from clip_l.safetensors (or the CLIP-L inside an SGM SDXL / ComfyUI FLUX
    checkpoint). ``config_dir_or_config``: a CLIPTextConfig, a dict, the text_encoder folder or a
    diffusers model folder (its ``text_encoder/`` is used)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    layout = expect(path, "clip-l", also=("sdxl-checkpoint", "flux-transformer"))
    prefix = _part_prefix(layout, "clip_l", {"sdxl-checkpoint": SGM_CLIP_L, "flux-transformer": FLUX_CLIP_L})
    config = hf_config(CLIPTextConfig, config_dir_or_config, "text_encoder")
    model = empty_model(lambda: CLIPTextModel(config))
    with open_file(path) as r:
        state = clip_state(r, prefix, model, dtype)
    return fill(model, state, path=layout.path, what="CLIP-L text encoder", hint="the CLIP-L config given")


# --------------------------------------------------------------------------------------------
# T5-XXL
# --------------------------------------------------------------------------------------------


def load_t5(path: PathLike, config: Any, dtype: torch.dtype) -> Any:
    """T5EncoderModel from t5xxl_fp16 / t5xxl_fp8_e4m3fn.safetensors (or a ComfyUI FLUX
    checkpoint's T5). fp8 tensors are upcast one by one (scaled fp8 multiplied by its scale).

    The files store the embedding twice (``shared.weight`` and ``encoder.embed_tokens.weight``);
    only ``shared`` is read and the encoder's embedding is tied to it, as in T5 itself. (FLUX's T5
    config says ``tie_word_embeddings: false``, under which transformers 5 would leave the two
    untied, i.e. a second copy.) With ``dtype=float16`` the ``wo`` projections stay float32, as
    transformers' ``_keep_in_fp32_modules`` does: T5's activations overflow fp16 there.
    """
    from transformers import T5Config, T5EncoderModel

    layout = expect(path, "t5xxl", also=("flux-transformer",))
    prefix = _part_prefix(layout, "t5xxl", {"flux-transformer": FLUX_T5})
    cfg = hf_config(T5Config, config, "text_encoder_2")
    model = empty_model(lambda: T5EncoderModel(cfg))
    embed = "encoder.embed_tokens.weight"
    wanted = set(model.state_dict()) - {embed}  # the encoder's copy is tied to shared below
    with open_file(path) as r:
        names = {k: k[len(prefix):] for k in r.with_prefix(prefix)}
        if "shared.weight" not in names.values():  # a file with only the encoder's copy
            wanted.add(embed)
        keys = [k for k, name in names.items() if name in wanted]
        note_ignored(r.path, [k for k, name in names.items() if name not in wanted and name != embed])
        state = r.state(keys, dtype, strip=prefix, keep_fp32=T5EncoderModel._keep_in_fp32_modules or ())
    if "shared.weight" not in state and embed in state:
        state["shared.weight"] = state.pop(embed)
    if "shared.weight" in state:
        state[embed] = state["shared.weight"]
    model = fill(model, state, path=layout.path, what="T5 encoder", hint="the T5 config given")
    model.encoder.embed_tokens.weight = model.shared.weight  # one Parameter, as transformers ties it
    return model


# --------------------------------------------------------------------------------------------
# VAE (LDM / BFL layout)
# --------------------------------------------------------------------------------------------


def ldm_vae(r: Reader, prefix: str, config: Mapping[str, Any], dtype: torch.dtype, what: str) -> Any:
    """AutoencoderKL from LDM-layout keys under ``prefix``, converted by diffusers'
    ``convert_ldm_vae_checkpoint`` (1x1-conv attention squeezed, decoder levels reversed)."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    state = r.state(r.with_prefix(prefix), dtype, strip=prefix)
    converted = convert_ldm_vae_checkpoint(state, dict(config))
    model = empty_model(lambda: AutoencoderKL.from_config(dict(config)))
    return fill(model, converted, path=r.path, what=what, hint="the VAE config given")


def load_flux_vae(path: PathLike, config: Any, dtype: torch.dtype) -> Any:
    """AutoencoderKL from FLUX's ae.safetensors (or the ``vae.`` part of a ComfyUI FLUX
    checkpoint). ``config``: a dict, the vae folder or a diffusers FLUX folder (its ``vae/``)."""
    from diffusers import AutoencoderKL

    layout = expect(path, "vae-flux", also=("flux-transformer",))
    prefix = _part_prefix(layout, "vae", {"flux-transformer": FLUX_VAE})
    cfg = diffusers_config(AutoencoderKL, config, "vae")
    with open_file(path) as r:
        return ldm_vae(r, prefix, cfg, dtype, "FLUX VAE")



# --------------------------------------------------------------------------------------------
# Qwen3 and Qwen3-VL's language model (Z-Image's, FLUX.2 [klein]'s and Krea 2's text encoders)
# --------------------------------------------------------------------------------------------


def load_qwen3(path: PathLike, config: Any, dtype: torch.dtype, kinds: tuple[str, ...], what: str, hint: str) -> Any:
    """Qwen3Model (no LM head: the hidden states are what the image models read) from a file in
    Hugging Face's Qwen3ForCausalLM names (``model.*``, as ComfyUI's qwen_3_4b / qwen_3_8b files);
    ``lm_head`` (if the file has it) is not read. ``config``: a Qwen3Config, a dict, or a folder
    (its ``text_encoder/``)."""
    from transformers import Qwen3Config, Qwen3Model

    layout = expect(path, *kinds)
    cfg = hf_config(Qwen3Config, config, "text_encoder")
    encoder = empty_model(lambda: Qwen3Model(cfg))
    with open_file(path) as r:
        keys = r.with_prefix("model.")
        note_ignored(r.path, sorted(set(r.with_prefix("")) - set(keys)))
        state = {k[len("model."):]: r.get(k, dtype) for k in keys}
    return fill(encoder, state, path=layout.path, what=what, hint=hint)


def qwen3vl_language_prefix(r: Reader) -> str:
    """Where a Qwen3-VL file keeps its language model: ``model.language_model.`` (transformers' and
    ComfyUI's layout) or ``model.`` (with the vision tower at ``visual.``)."""
    return "model.language_model." if any(k.startswith("model.language_model.") for k in r.keys) else "model."


def load_qwen3vl_text(path: PathLike, config: Any, dtype: torch.dtype, kinds: tuple[str, ...], what: str,
                      hint: str) -> Any:
    """Qwen3-VL's language model alone (Qwen3VLTextModel: what Qwen3VLModel runs for a text-only
    input, with the same mRoPE positions) from ComfyUI's file (``model.language_model.*`` and
    ``model.visual.*``, or ``model.*`` and ``visual.*``); the vision tower and an LM head are not read.
    ``config``: a Qwen3VLConfig, a dict, or a folder (its ``text_encoder/``)."""
    from transformers import Qwen3VLConfig, Qwen3VLTextModel

    layout = expect(path, *kinds)
    cfg = hf_config(Qwen3VLConfig, config, "text_encoder")
    encoder = empty_model(lambda: Qwen3VLTextModel(cfg.text_config))
    with open_file(path) as r:
        prefix = qwen3vl_language_prefix(r)
        keys = [k for k in r.with_prefix(prefix) if not k.startswith(("model.visual.", "model.language_model.visual."))]
        ignored = sorted(set(r.with_prefix("")) - set(keys))
        note_ignored(r.path, [k for k in ignored if "visual." not in k])  # (the vision tower: not needed for text)
        state = {k[len(prefix):]: r.get(k, dtype) for k in keys}
    return fill(encoder, state, path=layout.path, what=what, hint=hint)
