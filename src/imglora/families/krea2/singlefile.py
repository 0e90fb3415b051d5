"""Krea 2 from the single files ComfyUI users have (Comfy-Org/Krea-2): the transformer in Krea's
original layout (``krea2_raw_bf16.safetensors``, ``krea2_raw_fp8_scaled.safetensors``, Krea's own
``raw.safetensors``: bare or under ``model.diffusion_model.``), Qwen3-VL-4B
(``qwen3vl_4b_bf16.safetensors`` / ``_fp8_scaled``: transformers' layout, ``model.language_model.*``
and ``model.visual.*``, or ``model.*`` and ``visual.*``) and Qwen-Image's VAE
(``qwen_image_vae.safetensors``, read as the qwen_image family reads it), found by path or by bare
name in a ComfyUI install, with the shipped Krea 2 Raw configs and Qwen's tokenizer (the Hugging Face
cache, or ComfyUI's ``qwen25_tokenizer``, which ComfyUI's Krea 2 text encoder uses too).

Only Qwen3-VL's language model is read (Qwen3VLTextModel): a caption is text alone, and the states
Qwen3VLModel gives for text are its language model's. The transformer's names map as diffusers'
``convert_krea2_transformer_checkpoint_to_diffusers`` maps them (checked against it in the tests):
``first``/``tmlp``/``tproj``/``txtmlp``/``txtfusion``/``last`` prefixes, ``wq``/``wk``/``wv``/``wo``/
``gate`` attention names, ``mlp`` → ``ff``, norm ``scale``s as ``weight``s (stored zero-centred, as
Krea2RMSNorm reads them), and each block's flat ``mod.lin`` as its (6, width) ``scale_shift_table``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...errors import ModelSourceError
from ...models.safefiles import Reader
from .._shared.singlefile import streamed
from .._shared.singlefile.inspect import expect
from .._shared.singlefile.streamed import Part

SHIPPED = Path(__file__).parent / "configs" / "krea-2-raw"
KIND = "krea2-transformer"
TEXT_KIND = "qwen3vl-4b"
TOKENIZER = [("krea/Krea-2-Raw", "tokenizer"), ("krea/Krea-2-Turbo", "tokenizer"), ("Qwen/Qwen3-VL-4B-Instruct", "")]
# part -> (preset key, ComfyUI folders, the kind of file, an example name)
PARTS = {"text_encoder": ("text_encoder", ("text_encoders", "clip"), TEXT_KIND, "qwen3vl_4b_bf16.safetensors"),
         "vae": ("vae", ("vae",), "vae-qwen-image", "qwen_image_vae.safetensors")}
# original prefix -> diffusers' (the first that matches), then the names inside the blocks (all that match)
PREFIXES = (("first.", "img_in."), ("tmlp.0.", "time_embed.linear_1."), ("tmlp.2.", "time_embed.linear_2."),
            ("tproj.1.", "time_mod_proj."), ("txtmlp.0.scale", "txt_in.norm.weight"), ("txtmlp.1.", "txt_in.linear_1."),
            ("txtmlp.3.", "txt_in.linear_2."), ("txtfusion.", "text_fusion."), ("blocks.", "transformer_blocks."),
            ("last.linear.", "final_layer.linear."), ("last.norm.scale", "final_layer.norm.weight"),
            ("last.modulation.lin", "final_layer.scale_shift_table"))
INSIDE = ((".attn.wq.", ".attn.to_q."), (".attn.wk.", ".attn.to_k."), (".attn.wv.", ".attn.to_v."),
          (".attn.wo.", ".attn.to_out.0."), (".attn.gate.", ".attn.to_gate."),
          (".attn.qknorm.qnorm.scale", ".attn.norm_q.weight"), (".attn.qknorm.knorm.scale", ".attn.norm_k.weight"),
          (".mlp.", ".ff."), (".prenorm.scale", ".norm1.weight"), (".postnorm.scale", ".norm2.weight"),
          (".mod.lin", ".scale_shift_table"))


def diffusers_names(r: Reader, prefix: str) -> streamed.Names:
    """{diffusers key: its part of the file} for Krea's keys under ``prefix``; the modulation tables
    reshaped to the model's (6, width) and (2, width)."""
    out: streamed.Names = {}
    for key in r.with_prefix(prefix):
        name = key[len(prefix):]
        for old, new in PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        for old, new in INSIDE:
            name = name.replace(old, new)
        out[name] = Part(key, reshape=name.endswith("scale_shift_table"))
    return out


def _names(path: Path) -> tuple[Any, Any]:
    layout = expect(path, KIND)
    return layout, lambda r: diffusers_names(r, layout.prefix)


def load_transformer(path: Path, root: Path, dtype: torch.dtype = torch.float32, on_block: Any = None, *,
                     blocks: dict[str, str]) -> Any:
    """Krea2Transformer2DModel (the config of ``root``) from Krea's original layout, block by block."""
    layout, names = _names(path)
    return streamed.load_transformer(layout.path, "Krea2Transformer2DModel", root, names, blocks, dtype, on_block,
                                     "Krea 2 transformer",
                                     "the Krea 2 config given (model.config, or the shipped Krea 2 Raw's)")


def base_weights(src: Any, component: str, paths: list[str]) -> dict[str, torch.Tensor]:
    if component != "transformer":
        raise ModelSourceError(f"no base weights of Krea 2's {component} are read for export")
    layout, names = _names(src.files["transformer"])
    return streamed.base_weights(layout.path, names, paths, "Krea 2 transformer")


def resolve_files(model: Any, find: Any) -> Any:
    """The transformer file (``model.path``, in ComfyUI's diffusion_models folder), Qwen3-VL-4B
    (``model.text_encoder``) and Qwen-Image's VAE (``model.vae``), with the shipped Krea 2 Raw
    configs (or ``model.config``) and Qwen's tokenizer."""
    from ...models.source import ModelSource
    from .._shared.singlefile.configdir import assemble, find_parts, find_tokenizer, override

    path = find(model.path, ("diffusion_models", "unet", "checkpoints"), "model.path")
    expect(path, KIND)
    parts, missing = find_parts(model, find, PARTS, expect)
    if model.text_encoder_2:
        raise ModelSourceError("model.text_encoder_2: Krea 2 has one text encoder (Qwen3-VL-4B); give it as "
                               "model.text_encoder")
    if missing:
        raise ModelSourceError(f"{path} is a Krea 2 transformer alone; Krea 2 also needs Qwen3-VL-4B and "
                               f"Qwen-Image's VAE as files: set {', '.join(missing)}")
    files = {"transformer": path, **parts}
    if model.config:
        return ModelSource(override(model.config), files)
    tokenizer, _ = find_tokenizer("qwen25", TOKENIZER, model.comfyui, "Krea 2's Qwen3-VL")
    return ModelSource(assemble("krea-2-raw", SHIPPED, {"tokenizer": tokenizer}, {}), files)


def load_text_encoder(src: Any, dtype: torch.dtype) -> Any:
    from .._shared.singlefile.text import load_qwen3vl_text

    return load_qwen3vl_text(src.files["text_encoder"], src.root, dtype, (TEXT_KIND,), "Krea 2's Qwen3-VL-4B",
                             "the Qwen3-VL-4B config given (model.config, or the shipped Krea 2 Raw's)")


def load_vae(src: Any, dtype: torch.dtype) -> Any:
    """Qwen-Image's VAE from ComfyUI's file (Wan 2.1's layout), as the qwen_image family reads it."""
    from ..qwen_image import singlefile as qwen_image

    return qwen_image.load_vae(src, dtype)
