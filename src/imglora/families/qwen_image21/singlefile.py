"""Qwen-Image 2.1 from the single files ComfyUI users have (Comfy-Org/Qwen-Image-2.1): the transformer
(``qwen_image_2.1_bf16.safetensors``, or a scaled fp8 one: bare or under ``model.diffusion_model.``),
Qwen3-VL-8B (``qwen3vl_8b_bf16.safetensors``: transformers' layout, ``model.language_model.*`` and
``model.visual.*``, or ``model.*`` and ``visual.*``) and the RGBA VAE
(``qwen_image_2.1_vae_bf16.safetensors``), found by path or by bare name in a ComfyUI install, with the
shipped Qwen-Image 2.1 configs and Qwen's tokenizer (the Hugging Face cache, or ComfyUI's
``qwen25_tokenizer``, as for Krea 2's Qwen3-VL). Comfy-Org's ``int8_convrot`` files are refused by the
reader (an int8 weight is a packed format imglora does not read): give the bf16 file.

The transformer keeps diffusers' module names but for one tensor per block: ComfyUI fuses the SwiGLU's
gate and up projections into ``img_mlp.gate_up.weight``, gate rows first (diffusers'
``convert_qwen_image21_transformer_checkpoint_to_diffusers`` splits it with ``chunk(2, dim=0)``); the
two halves are read here as row ranges of the file's tensor, so a fused fp8 weight is never upcast
whole.

Only Qwen3-VL's language model is read (Qwen3VLTextModel): a caption is text alone, and the states the
pipeline's Qwen3VLForConditionalGeneration gives for text are its language model's
(``model.language_model`` finds that model's final norm on either).

The VAE file is in Wan 2.2's original nested layout (the names of Wan's ``vae2_2.py``), the weights of
its causal convolutions stored 5-D with a time axis of 1, which diffusers' 2-D specialisation
(``AutoencoderKLQwenImage21``, its causal convolutions ``nn.Conv2d``) does not have. diffusers has no
converter for it; the map below is written from the two module trees and agrees with every port that
reads Comfy-Org's file that could be found (2026):

- unslothai's Studio ``_convert_wan_nested_vae`` ("Wan 2.2-layout VAE (Qwen-Image-2.1's too)":
  ``encoder.downsamples.<i>.downsamples.<j>`` residual children -> ``down_blocks.<i>.resnets.<j>``, the
  resampler -> ``downsampler``/``upsampler``; ``middle.0/1/2``, ``head.0/2``, ``conv1``/``conv2``), whose
  ``fit_conv_shapes`` squeezes exactly a singleton time axis of a 5-D weight;
- a Scala port's ``QwenImage21Vae`` ("the Qwen Image 2.1 VAE ... from the original Wan names
  (``encoder.downsamples.N.downsamples.M``, ``decoder.upsamples.N.upsamples.M``, ``conv1``/``conv2`` for
  the quant convolutions)");
- a diffusers -> ComfyUI converter's checks for Qwen-Image 2.1 ("``decoder.up_blocks.N.resnets.M`` ->
  ``decoder.upsamples.N.upsamples.M``", "4D conv kernel became a 5D WanVAE kernel" ``[o, i, 1, k, k]``,
  attention and ``resample.1`` weights left 4-D, norm gammas untouched);
- a report that ComfyUI before its Qwen-Image 2.1 support took the file for Wan 2.2's VAE from
  ``decoder.upsamples.0.upsamples.0.residual.2.weight`` and failed on its 96/144-wide, 64-channel shapes.

No copy of the real file was read here: a file that does not fit this map is refused naming its keys.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ...errors import ModelSourceError
from ...models.safefiles import Reader, check_shapes, diffusers_config, empty_model, open_file
from ...util.owned import own_module
from .._shared.singlefile import streamed
from .._shared.singlefile.inspect import expect
from .._shared.singlefile.streamed import Part

SHIPPED = Path(__file__).parent / "configs" / "qwen-image-2.1"
KIND = "qwen-image-2.1-transformer"
TEXT_KIND = "qwen3vl-8b"
VAE_KIND = "vae-qwen-image-2.1"
GATE_UP = ".img_mlp.gate_up.weight"
TOKENIZER = [("Qwen/Qwen-Image-2.1", "processor"), ("Qwen/Qwen-Image-2.1", "tokenizer"),
             ("Qwen/Qwen3-VL-8B-Instruct", "")]
# part -> (preset key, ComfyUI folders, the kind of file, an example name)
PARTS = {"text_encoder": ("text_encoder", ("text_encoders", "clip"), TEXT_KIND, "qwen3vl_8b_bf16.safetensors"),
         "vae": ("vae", ("vae",), VAE_KIND, "qwen_image_2.1_vae_bf16.safetensors")}
CONFIG_HINT = "the Qwen-Image 2.1 config given (model.config, or the shipped one)"


# -- transformer ------------------------------------------------------------------------------


def diffusers_names(r: Reader, prefix: str) -> streamed.Names:
    """{diffusers key: its part of the file} for the keys under ``prefix``: the same names, each
    block's fused ``img_mlp.gate_up`` as its gate (first half of the rows) and up (second half)."""
    out: streamed.Names = {}
    for key in r.with_prefix(prefix):
        name = key[len(prefix):]
        if name.endswith(GATE_UP):
            rows = r.shape(key)[0]
            if rows % 2:
                raise ModelSourceError(f"{r.path}: {key} has {rows} rows, not the two equal halves of the gate and "
                                       "up projections ComfyUI fuses into it")
            base = name[: -len(GATE_UP)]
            out[f"{base}.img_mlp.gate_layer.weight"] = Part(key, ((0, rows // 2),))
            out[f"{base}.img_mlp.proj.weight"] = Part(key, ((rows // 2, rows),))
        else:
            out[name] = Part(key)
    return out


def _names(path: Path) -> tuple[Any, Any]:
    layout = expect(path, KIND)
    return layout, lambda r: diffusers_names(r, layout.prefix)


def load_transformer(path: Path, root: Path, dtype: torch.dtype = torch.float32, on_block: Any = None, *,
                     blocks: dict[str, str]) -> Any:
    """QwenImage21Transformer2DModel (the config of ``root``) from ComfyUI's file, block by block."""
    layout, names = _names(path)
    return streamed.load_transformer(layout.path, "QwenImage21Transformer2DModel", root, names, blocks, dtype,
                                     on_block, "Qwen-Image 2.1 transformer", CONFIG_HINT)


def base_weights(src: Any, component: str, paths: list[str]) -> dict[str, torch.Tensor]:
    if component != "transformer":
        raise ModelSourceError(f"no base weights of Qwen-Image 2.1's {component} are read for export")
    layout, names = _names(src.files["transformer"])
    return streamed.base_weights(layout.path, names, paths, "Qwen-Image 2.1 transformer")


# -- the model's files --------------------------------------------------------------------------


def resolve_files(model: Any, find: Any) -> Any:
    """The transformer file (``model.path``, in ComfyUI's diffusion_models folder), Qwen3-VL-8B
    (``model.text_encoder``) and the VAE (``model.vae``), with the shipped Qwen-Image 2.1 configs (or
    ``model.config``) and Qwen's tokenizer in the processor's folder."""
    from ...models.source import ModelSource
    from .._shared.singlefile.configdir import assemble, find_parts, find_tokenizer, override

    path = find(model.path, ("diffusion_models", "unet", "checkpoints"), "model.path")
    expect(path, KIND)
    parts, missing = find_parts(model, find, PARTS, expect)
    if model.text_encoder_2:
        raise ModelSourceError("model.text_encoder_2: Qwen-Image 2.1 has one text encoder (Qwen3-VL-8B); give it "
                               "as model.text_encoder")
    if missing:
        raise ModelSourceError(f"{path} is a Qwen-Image 2.1 transformer alone; Qwen-Image 2.1 also needs Qwen3-VL-8B "
                               f"and its VAE as files: set {', '.join(missing)}")
    files = {"transformer": path, **parts}
    if model.config:
        return ModelSource(override(model.config), files)
    tokenizer, _ = find_tokenizer("qwen25", TOKENIZER, model.comfyui, "Qwen-Image 2.1's Qwen3-VL")
    return ModelSource(assemble("qwen-image-2.1", SHIPPED, {"processor": tokenizer}, {}), files)


def load_text_encoder(src: Any, dtype: torch.dtype) -> Any:
    from .._shared.singlefile.text import load_qwen3vl_text

    return load_qwen3vl_text(src.files["text_encoder"], src.root, dtype, (TEXT_KIND,), "Qwen-Image 2.1's Qwen3-VL-8B",
                             "the Qwen3-VL-8B config given (model.config, or the shipped Qwen-Image 2.1 one)")


# -- VAE: Wan 2.2's nested names -> AutoencoderKLQwenImage21's -------------------------------------

_RESIDUAL = (("residual.0.", "norm1."), ("residual.2.", "conv1."), ("residual.3.", "norm2."),
             ("residual.6.", "conv2."), ("shortcut.", "conv_shortcut."))
_OUTER = (("encoder.conv1.", "encoder.conv_in."), ("decoder.conv1.", "decoder.conv_in."),
          ("encoder.head.0.", "encoder.norm_out."), ("decoder.head.0.", "decoder.norm_out."),
          ("encoder.head.2.", "encoder.conv_out."), ("decoder.head.2.", "decoder.conv_out."),
          ("conv1.", "quant_conv."), ("conv2.", "post_quant_conv."))
_NESTED = re.compile(r"(encoder|decoder)\.(?:downsamples|upsamples)\.(\d+)\.(?:downsamples|upsamples)\.(\d+)\.(.+)")
_MIDDLE = re.compile(r"(encoder|decoder)\.middle\.(\d)\.(.+)")


def _residual(rest: str) -> str | None:
    return next((new + rest[len(old):] for old, new in _RESIDUAL if rest.startswith(old)), None)


def vae_name(key: str) -> str | None:
    """A Wan 2.2-layout key -> AutoencoderKLQwenImage21's (None: no place for it). Each level of the
    encoder (``downsamples.<i>``) and decoder (``upsamples.<i>``) nests its residual blocks as children
    ``0 .. n-1`` and its resampler (``resample.1``, ``time_conv``) as child ``n``; the middle is
    residual, attention, residual; ``head.0``/``head.2`` the output norm and convolution."""
    m = _NESTED.fullmatch(key)
    if m:
        side, level, child, rest = m.groups()
        blocks = "down_blocks" if side == "encoder" else "up_blocks"
        if rest.startswith(("resample.", "time_conv.")):
            return f"{side}.{blocks}.{level}.{'downsampler' if side == 'encoder' else 'upsampler'}.{rest}"
        new = _residual(rest)
        return None if new is None else f"{side}.{blocks}.{level}.resnets.{child}.{new}"
    m = _MIDDLE.fullmatch(key)
    if m:
        side, index, rest = m.groups()
        if index == "1":
            return f"{side}.mid_block.attentions.0.{rest}"
        new = _residual(rest)
        return None if new is None or index not in "02" else f"{side}.mid_block.resnets.{int(index) // 2}.{new}"
    return next((new + key[len(old):] for old, new in _OUTER if key.startswith(old)), None)


def load_vae(src: Any, dtype: torch.dtype) -> Any:
    """AutoencoderKLQwenImage21 (the config of ``src.root``) from ComfyUI's file: each key renamed by
    ``vae_name``, a 5-D convolution weight with a time axis of 1 read as the 2-D one it is."""
    from diffusers import AutoencoderKLQwenImage21

    path = src.files["vae"]
    layout = expect(path, VAE_KIND)
    config = diffusers_config(AutoencoderKLQwenImage21, src.root, "vae")
    model = empty_model(lambda: AutoencoderKLQwenImage21.from_config(config))
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with open_file(path) as r:
        names: dict[str, str] = {}
        for key in r.with_prefix(layout.prefix):
            name = vae_name(key[len(layout.prefix):])
            names[name if name is not None else key] = key  # (a key with no place is reported as unexpected)

        def fitted(name: str) -> tuple[int, ...]:
            shape = r.shape(names[name])
            squeeze = len(shape) == 5 and shape[2] == 1 and len(want.get(name, ())) == 4
            return shape[:2] + shape[3:] if squeeze else shape

        check_shapes(layout.path, "Qwen-Image 2.1 VAE", {n: fitted(n) for n in names}, want, CONFIG_HINT)
        state = {n: r.get(k, dtype).reshape(fitted(n)) for n, k in names.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return own_module(model).eval()
