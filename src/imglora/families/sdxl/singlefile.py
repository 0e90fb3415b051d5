"""SDXL from one original (SGM) file, e.g. sd_xl_base_1.0.safetensors or a finetune of it.

Each part is read alone through the memory map (only its keys), converted, checked against the
model built from the diffusers config folder, and made the model's weights without a second copy.
The UNet and VAE key conversions are diffusers' own (``convert_ldm_unet_checkpoint`` and
``convert_ldm_vae_checkpoint``, the functions ``from_single_file`` runs); the CLIP conversions are
the tables of diffusers' ``DIFFUSERS_TO_LDM_MAPPING`` done here, because diffusers recognises
CLIPs only by fixed keys of the full-size models (``resblocks.9``). ``from_single_file`` itself
is not called: it converts a dict of the whole file once per component, and leaves any weight the
conversion missed on the meta device, to fail later as "Cannot copy out of meta tensor". The
tests check that both give identical weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from ...errors import ModelSourceError
from ...models.safefiles import (PathLike, Reader, diffusers_config, empty_model, fill, hf_config, note_ignored,
                                 open_file)
from .._shared.singlefile.inspect import SGM_CLIP_G, SGM_CLIP_L, SGM_VAE, UNET_PREFIX, expect
from .._shared.singlefile.text import clip_state, ldm_vae

SDXL_PARTS = ("unet", "vae", "text_encoder", "text_encoder_2")
# diffusers component -> name of the part in inspect.Layout.parts
_PART = {"unet": "unet", "vae": "vae", "text_encoder": "clip_l", "text_encoder_2": "clip_g"}


def load_sdxl(path: PathLike, config_dir: PathLike, *, dtype: torch.dtype, vae_path: PathLike | None = None,
              parts: Sequence[str] = SDXL_PARTS) -> dict[str, Any]:
    """``{component: module}`` for ``parts`` of the SDXL checkpoint ``path``, in diffusers classes.

    ``config_dir``: a diffusers SDXL folder for the configs (unet/, vae/, text_encoder/,
    text_encoder_2/ config.json files; weights there are not read). ``vae_path``: a separate VAE
    (e.g. sdxl_vae.safetensors, the fp16-fix VAE), used instead of the checkpoint's own. The dict
    can be passed to ``StableDiffusionXLPipeline.from_pretrained(config_dir, **modules)``.
    """
    unknown = sorted(set(parts) - set(SDXL_PARTS))
    if unknown:
        raise ValueError(f"unknown SDXL parts {unknown}; valid: {SDXL_PARTS}")
    layout = expect(path, "sdxl-checkpoint")
    for part in parts:
        if _PART[part] not in layout.parts and not (part == "vae" and vae_path is not None):
            advice = ("pass vae_path (e.g. sdxl_vae.safetensors)" if part == "vae"
                      else "use a full SDXL checkpoint such as sd_xl_base_1.0.safetensors")
            raise ModelSourceError(f"{layout.path} has no {part} ({_PART[part]}); it holds {', '.join(layout.parts)}"
                                   f"{' (' + layout.note + ')' if layout.note else ''}. To load the {part}, {advice}.")
    config_dir = Path(config_dir).expanduser()
    out: dict[str, Any] = {}
    with open_file(path) as r:
        if "unet" in parts:
            out["unet"] = _unet(r, layout.prefix, config_dir, dtype)
        if "text_encoder" in parts:
            from transformers import CLIPTextConfig, CLIPTextModel

            cfg = hf_config(CLIPTextConfig, config_dir, "text_encoder")
            model = empty_model(lambda: CLIPTextModel(cfg))
            out["text_encoder"] = fill(model, clip_state(r, SGM_CLIP_L, model, dtype), path=r.path,
                                       what="CLIP-L text encoder", hint=f"{config_dir / 'text_encoder'}")
        if "text_encoder_2" in parts:
            out["text_encoder_2"] = _open_clip(r, config_dir, dtype)
        if "vae" in parts and vae_path is None:
            out["vae"] = _vae(r, SGM_VAE, config_dir, dtype)
    if "vae" in parts and vae_path is not None:
        vae_layout = expect(vae_path, "vae-sdxl", also=("sdxl-checkpoint",))
        prefix = SGM_VAE if vae_layout.kind == "sdxl-checkpoint" else vae_layout.prefix
        with open_file(vae_path) as r:
            out["vae"] = _vae(r, prefix, config_dir, dtype)
    return {part: out[part] for part in parts}


def _unet(r: Reader, prefix: str, config_dir: Path, dtype: torch.dtype) -> Any:
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    config = diffusers_config(UNet2DConditionModel, config_dir, "unet")
    # diffusers' converter only takes keys under model.diffusion_model.; a bare LDM UNet (as saved
    # into ComfyUI's diffusion_models folder) gets the prefix here.
    state = {UNET_PREFIX + k: v for k, v in r.state(r.with_prefix(prefix), dtype, strip=prefix).items()}
    converted = convert_ldm_unet_checkpoint(state, config)
    model = empty_model(lambda: UNet2DConditionModel.from_config(config))
    return fill(model, converted, path=r.path, what="UNet", hint=f"the SDXL UNet config in {config_dir}")


def _vae(r: Reader, prefix: str, config_dir: Path, dtype: torch.dtype) -> Any:
    from diffusers import AutoencoderKL

    return ldm_vae(r, prefix, diffusers_config(AutoencoderKL, config_dir, "vae"), dtype, "SDXL VAE")


def _open_clip(r: Reader, config_dir: Path, dtype: torch.dtype) -> Any:
    """CLIPTextModelWithProjection from SGM's OpenCLIP bigG (diffusers' convert_open_clip_checkpoint
    table): q, k, v split from ``in_proj`` in that order; OpenCLIP applies its projection as
    ``x @ P`` where a Linear computes ``x @ W.T``, so ``W = P.T``. The projection is square, so
    forgetting the transpose (as kohya's converter does) would load without any error."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = hf_config(CLIPTextConfig, config_dir, "text_encoder_2")
    model = empty_model(lambda: CLIPTextModelWithProjection(cfg))
    p, t = SGM_CLIP_G, "text_model."
    renames = {"token_embedding.weight": "embeddings.token_embedding.weight",
               "positional_embedding": "embeddings.position_embedding.weight",
               "ln_final.weight": "final_layer_norm.weight", "ln_final.bias": "final_layer_norm.bias"}
    layer = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
             "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    state: dict[str, torch.Tensor] = {}
    ignored = []
    for key in r.with_prefix(p):
        name = key[len(p):]
        if name in renames:
            state[t + renames[name]] = r.get(key, dtype)
        elif name == "text_projection":
            state["text_projection.weight"] = r.get(key, dtype).T.contiguous()
        elif name.startswith("transformer.resblocks."):
            _, _, i, rest = name.split(".", 3)
            dst = f"{t}encoder.layers.{i}."
            if rest.startswith("attn.in_proj_"):
                suffix = rest.removeprefix("attn.in_proj_")
                width = r.shape(key)[0] // 3
                for n, q in enumerate("qkv"):
                    state[f"{dst}self_attn.{q}_proj.{suffix}"] = r.get(key, dtype, rows=(n * width, (n + 1) * width))
            else:
                module, suffix = rest.rsplit(".", 1)
                state[f"{dst}{layer.get(module, module)}.{suffix}"] = r.get(key, dtype)
        else:
            ignored.append(key)  # logit_scale, attn_mask: nothing in the HF model
    note_ignored(r.path, ignored)
    return fill(model, state, path=r.path, what="OpenCLIP bigG text encoder",
                hint=f"{config_dir / 'text_encoder_2'}")


def prediction_type(path: PathLike) -> Literal["epsilon", "v_prediction"]:
    """What the checkpoint's UNet predicts, from the file itself.

    ComfyUI marks v-prediction models with an empty ``v_pred`` key (``edm_vpred.sigma_max`` for
    v-prediction with EDM sigmas) and writes ``modelspec.predict_key`` metadata; kohya writes
    ``modelspec.prediction_type``. diffusers reads none of these, so a v-prediction finetune
    loaded as epsilon trains and samples wrongly without any error.
    """
    with open_file(path) as r:
        if "v_pred" in r.key_set or any(k.startswith("edm_vpred.") for k in r.keys):
            return "v_prediction"
        meta = r.metadata()
        for key in ("modelspec.prediction_type", "modelspec.predict_key"):
            value = meta.get(key, "").strip().lower().replace("-", "_")
            if value in ("v", "v_prediction", "vpred", "v_pred"):
                return "v_prediction"
            if value in ("epsilon", "eps"):
                return "epsilon"
    return "epsilon"


def zero_terminal_snr(path: PathLike) -> bool:
    """Whether ComfyUI's ``ztsnr`` key marks the model as trained with zero terminal SNR (then
    the scheduler needs ``rescale_betas_zero_snr=True``)."""
    with open_file(path) as r:
        return "ztsnr" in r.key_set


# --------------------------------------------------------------------------------------------
# The family's single-file model source
# --------------------------------------------------------------------------------------------

SHIPPED = Path(__file__).parent / "configs" / "sdxl-base-1.0"
CLIP_TOKENIZER = [("stabilityai/stable-diffusion-xl-base-1.0", "tokenizer"), ("openai/clip-vit-large-patch14", "")]


def resolve_files(model: Any, find: Any) -> Any:
    """An SGM checkpoint (``model.path``, in ComfyUI's checkpoints folder), optionally a separate VAE
    (``model.vae``), and the folder of SDXL base's configs with CLIP's tokenizers."""
    from ...models.source import ModelSource
    from .._shared.singlefile.configdir import assemble, find_tokenizer, override

    path = find(model.path, ("checkpoints",), "model.path")
    layout = expect(path, "sdxl-checkpoint")
    files = {"checkpoint": path}
    if model.vae:
        files["vae"] = find(model.vae, ("vae",), "model.vae")
        expect(files["vae"], "vae-sdxl", also=("sdxl-checkpoint",))
    missing = [f"the {part}" for part in ("clip_l", "clip_g") if part not in layout.parts]
    if "vae" not in layout.parts and "vae" not in files:
        missing.append("a VAE (set model.vae, e.g. sdxl_vae.safetensors)")
    if missing:
        raise ModelSourceError(f"{path} has no {' and no '.join(missing)}; it holds {', '.join(layout.parts)}"
                               f"{' (' + layout.note + ')' if layout.note else ''}. An SDXL checkpoint such as "
                               "sd_xl_base_1.0.safetensors holds the UNet, both text encoders and the VAE.")
    for key in ("text_encoder", "text_encoder_2"):
        if getattr(model, key):
            raise ModelSourceError(f"model.{key} = {getattr(model, key)!r}: an SDXL checkpoint holds both text "
                                   "encoders; leave it empty")
    if model.config:
        return ModelSource(override(model.config), files)
    clip, from_comfyui = find_tokenizer("clip", CLIP_TOKENIZER, model.comfyui, "SDXL")
    # ComfyUI's copy says model_max_length 8192; SDXL's second tokenizer pads with "!" (as in diffusers').
    patches = {"tokenizer": {"model_max_length": 77}, "tokenizer_2": {"model_max_length": 77, "pad_token": "!"}}
    root = assemble("sdxl-base-1.0", SHIPPED, {"tokenizer": clip, "tokenizer_2": clip}, patches)
    return ModelSource(root, files)


def load_part(src: Any, part: str, dtype: torch.dtype) -> Any:
    """One component ("unet", "vae", "text_encoder", "text_encoder_2") of a single-file source."""
    return load_sdxl(src.files["checkpoint"], src.root, dtype=dtype, vae_path=src.files.get("vae"), parts=(part,))[part]


def file_prediction_type(src: Any) -> tuple[str, bool]:
    """(prediction type, zero terminal SNR) as the checkpoint says."""
    path = src.files["checkpoint"]
    return prediction_type(path), zero_terminal_snr(path)


def base_weights(src: Any, component: str, paths: list[str]) -> dict[str, torch.Tensor]:
    """fp32 weights (``<path>.weight``) of modules of a single-file SDXL model (the component is
    converted whole: the checkpoint's layout has other names)."""
    module = load_part(src, component, torch.float32)
    return {p: module.get_submodule(p).weight.detach() for p in paths}
