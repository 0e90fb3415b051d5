"""Z-Image from the single files ComfyUI users have (Comfy-Org/z_image_turbo's split files): the
transformer (``z_image_turbo_bf16.safetensors``, or Base's ``z_image_bf16.safetensors``: the original
layout, bare or under ``model.diffusion_model.``), Qwen3-4B (``qwen_3_4b.safetensors``: Hugging Face's
layout, ``model.layers.*``) and FLUX.1's VAE (``ae.safetensors``), found by path or by bare name in a
ComfyUI install, with the shipped Z-Image Turbo configs and Qwen's tokenizer (the Hugging Face
cache, or ComfyUI's ``qwen25_tokenizer``, which Z-Image's text encoder uses too).

The transformer's original names differ from diffusers' in a few places, as diffusers'
``convert_z_image_transformer_checkpoint_to_diffusers`` maps them (checked against it in the
tests): ``x_embedder`` and ``final_layer`` are the 2×2 patch entries of ``all_x_embedder`` /
``all_final_layer``, the attention's ``out`` is ``to_out.0``, ``q_norm``/``k_norm`` are
``norm_q``/``norm_k``, and the fused ``qkv`` rows are q, k and v. It is read block by block (each
block handed to ``on_block`` as it is read), so the host never holds it whole in its load dtype.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ...errors import ModelSourceError
from ...memory.host import release_free_memory
from ...models.safefiles import check_shapes, diffusers_config, empty_model, fill, hf_config, note_ignored, open_file
from ...util.owned import own_module
from .._shared.singlefile.inspect import expect

SHIPPED = Path(__file__).parent / "configs" / "z-image-turbo"
KIND = "z-image-transformer"
TOKENIZER = [("Tongyi-MAI/Z-Image-Turbo", "tokenizer"), ("Tongyi-MAI/Z-Image", "tokenizer"), ("Qwen/Qwen3-4B", "")]
# part -> (preset key, ComfyUI folders, the kind of file, an example name)
PARTS = {"text_encoder": ("text_encoder", ("text_encoders", "clip"), "qwen3-4b", "qwen_3_4b.safetensors"),
         "vae": ("vae", ("vae",), "vae-flux", "ae.safetensors")}
# original name part -> diffusers' (diffusers' converter, in its order)
RENAMES = (("final_layer.", "all_final_layer.2-1."), ("x_embedder.", "all_x_embedder.2-1."),
           (".attention.out.", ".attention.to_out.0."), (".attention.k_norm.", ".attention.norm_k."),
           (".attention.q_norm.", ".attention.norm_q."))
DROPPED = ("norm_final.weight",)  # in some files; the model has no such weight (diffusers drops it too)


def diffusers_names(names: list[str]) -> dict[str, tuple[str, int | None]]:
    """{diffusers key: (original key, which third of its rows or None)} for the original keys ``names``
    (without their file prefix)."""
    out: dict[str, tuple[str, int | None]] = {}
    for name in names:
        if name in DROPPED:
            continue
        new = name
        for old, to in RENAMES:
            new = new.replace(old, to)
        if new.endswith(".attention.qkv.weight"):
            for i, part in enumerate(("to_q", "to_k", "to_v")):
                out[new.replace(".qkv.", f".{part}.")] = (name, i)
        else:
            out[new] = (name, None)
    return out


def _get(r: Any, key: str, third: int | None, dtype: torch.dtype) -> torch.Tensor:
    t = r.get(key, dtype)
    return t if third is None else t.chunk(3, dim=0)[third].clone()


def load_transformer(path: Path, root: Path, dtype: torch.dtype = torch.float32, on_block: Any = None, *,
                     blocks: dict[str, str]) -> Any:
    """ZImageTransformer2DModel from a ComfyUI file, block by block: what is outside the block lists
    (``blocks``: {kind: attribute}) first, then each block of each list, handed to
    ``on_block(kind, index, block)`` as soon as it is read."""
    from diffusers import ZImageTransformer2DModel

    layout = expect(path, KIND)
    config = diffusers_config(ZImageTransformer2DModel, root, "transformer")
    with torch.device("meta"):
        model = ZImageTransformer2DModel.from_config(config)
    model.requires_grad_(False)
    want = {k: v.shape for k, v in model.state_dict().items()}
    with open_file(path) as r:
        names = diffusers_names([k[len(layout.prefix):] for k in r.with_prefix(layout.prefix)])
        shapes = {n: r.shape(layout.prefix + k) if third is None else
                  (r.shape(layout.prefix + k)[0] // 3, *r.shape(layout.prefix + k)[1:]) for n, (k, third) in names.items()}
        check_shapes(layout.path, "Z-Image transformer", shapes, want,
                     "the Z-Image config given (model.config, or the shipped Z-Image Turbo's)")
        inside = tuple(f"{name}." for name in blocks.values())
        model.load_state_dict({n: _get(r, layout.prefix + k, third, dtype) for n, (k, third) in names.items()
                               if not n.startswith(inside)}, strict=False, assign=True)
        own_module(model)
        for kind, name in blocks.items():
            for index, block in enumerate(getattr(model, name)):
                pre = f"{name}.{index}."
                block.load_state_dict({n[len(pre):]: _get(r, layout.prefix + k, third, dtype)
                                       for n, (k, third) in names.items() if n.startswith(pre)},
                                      strict=True, assign=True)
                own_module(block)
                if on_block is not None:
                    on_block(kind, index, block)
                release_free_memory()
    return model.eval()


def resolve_files(model: Any, find: Any) -> Any:
    """The transformer file (``model.path``, in ComfyUI's diffusion_models folder), Qwen3-4B
    (``model.text_encoder``) and FLUX.1's VAE (``model.vae``), with the shipped configs (or
    ``model.config``) and Qwen's tokenizer."""
    from ...models.source import ModelSource
    from .._shared.singlefile.configdir import assemble, find_parts, find_tokenizer, override

    path = find(model.path, ("diffusion_models", "unet", "checkpoints"), "model.path")
    expect(path, KIND)
    parts, missing = find_parts(model, find, PARTS, expect)
    if model.text_encoder_2:
        raise ModelSourceError("model.text_encoder_2: Z-Image has one text encoder (Qwen3-4B); give it as "
                               "model.text_encoder")
    if missing:
        raise ModelSourceError(f"{path} is a Z-Image transformer alone; Z-Image also needs Qwen3-4B and FLUX.1's "
                               f"VAE as files: set {', '.join(missing)}")
    files = {"transformer": path, **parts}
    if model.config:
        return ModelSource(override(model.config), files)
    tokenizer, _ = find_tokenizer("qwen25", TOKENIZER, model.comfyui, "Z-Image's Qwen3")
    return ModelSource(assemble("z-image-turbo", SHIPPED, {"tokenizer": tokenizer}, {}), files)


def load_text_encoder(src: Any, dtype: torch.dtype) -> Any:
    """Qwen3Model (no LM head: the hidden states are what Z-Image reads) from ComfyUI's file, whose
    ``model.*`` keys are the model's; ``lm_head`` (if the file has it) is not read."""
    from transformers import Qwen3Config, Qwen3Model

    path = src.files["text_encoder"]
    layout = expect(path, "qwen3-4b")
    config = hf_config(Qwen3Config, src.root, "text_encoder")
    encoder = empty_model(lambda: Qwen3Model(config))
    with open_file(path) as r:
        keys = r.with_prefix(layout.prefix + "model.")
        note_ignored(r.path, [k for k in r.with_prefix(layout.prefix) if k not in set(keys)])
        state = {k[len(layout.prefix + "model."):]: r.get(k, dtype) for k in keys}
    return fill(encoder, state, path=layout.path, what="Qwen3-4B text encoder",
                hint="the Qwen3-4B config given (model.config, or the shipped Z-Image's)")


def load_vae(src: Any, dtype: torch.dtype) -> Any:
    from .._shared.singlefile.text import load_flux_vae

    return load_flux_vae(src.files["vae"], src.root / "vae", dtype)


def base_weights(src: Any, component: str, paths: list[str]) -> dict[str, torch.Tensor]:
    """fp32 weights (``<path>.weight``) of transformer modules, from the file (DoRA's export): q, k
    and v as their rows of the fused ``qkv``."""
    if component != "transformer":
        raise ModelSourceError(f"no base weights of Z-Image's {component} are read for export")
    layout = expect(src.files["transformer"], KIND)
    out = {}
    with ExitStack() as stack:
        r = stack.enter_context(open_file(src.files["transformer"]))
        names = diffusers_names([k[len(layout.prefix):] for k in r.with_prefix(layout.prefix)])
        for p in paths:
            if f"{p}.weight" not in names:
                raise ModelSourceError(f"{src.files['transformer']}: no weight for the adapted module {p}")
            key, third = names[f"{p}.weight"]
            out[p] = _get(r, layout.prefix + key, third, torch.float32)
    return out
