"""Qwen-Image from the single files ComfyUI users have: the transformer (``qwen_image_bf16.safetensors``
or ``qwen_image_fp8_e4m3fn.safetensors``: diffusers' module names, bare or under
``model.diffusion_model.``), Qwen2.5-VL-7B (``qwen_2.5_vl_7b_fp8_scaled.safetensors``: the original
Hugging Face layout, ``model.layers.*`` and ``visual.*``, its Linear weights fp8 with a
``scale_weight`` each) and the VAE (``qwen_image_vae.safetensors``: Wan 2.1's original layout),
found by path or by bare name in a ComfyUI install, with the shipped Qwen-Image configs and Qwen2.5's
tokenizer (the Hugging Face cache, or ComfyUI's ``qwen25_tokenizer``).

fp8 files are upcast tensor by tensor (times their scale where they have one). The transformer is
read block by block (``_shared.stream`` calls :func:`load_transformer` with each block's callback), so
the host never holds it whole in its load dtype.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ...errors import ModelSourceError
from ...memory.host import release_free_memory
from ...util.owned import own_module
from ...models.safefiles import check_shapes, diffusers_config, empty_model, fill, hf_config, note_ignored, open_file
from .._shared.singlefile.inspect import expect

SHIPPED = Path(__file__).parent / "configs" / "qwen-image"
KIND = "qwen-image-transformer"
TOKENIZER = [("Qwen/Qwen-Image", "tokenizer"), ("Qwen/Qwen2.5-VL-7B-Instruct", "")]
# part -> (preset key, ComfyUI folders, the kind of file, an example name)
PARTS = {"text_encoder": ("text_encoder", ("text_encoders", "clip"), "qwen25-vl-7b",
                          "qwen_2.5_vl_7b_fp8_scaled.safetensors"),
         "vae": ("vae", ("vae",), "vae-qwen-image", "qwen_image_vae.safetensors")}


def resolve_files(model: Any, find: Any, overlay: Path | None = None) -> Any:
    """The transformer file (``model.path``, in ComfyUI's diffusion_models folder), Qwen2.5-VL
    (``model.text_encoder``) and the VAE (``model.vae``), with the shipped configs (or
    ``model.config``) and Qwen2.5's tokenizer. ``overlay``: configs of a model that differs from
    Qwen-Image only there (the Edit models' model_index.json and image processor)."""
    from ...models.source import ModelSource
    from .._shared.singlefile.configdir import assemble, find_parts, find_tokenizer, override

    path = find(model.path, ("diffusion_models", "unet", "checkpoints"), "model.path")
    expect(path, KIND)
    parts, missing = find_parts(model, find, PARTS, expect)
    files = {"transformer": path, **parts}
    if model.text_encoder_2:
        raise ModelSourceError("model.text_encoder_2: Qwen-Image has one text encoder (Qwen2.5-VL-7B); give it as "
                               "model.text_encoder")
    if missing:
        raise ModelSourceError(f"{path} is a Qwen-Image transformer alone; Qwen-Image also needs Qwen2.5-VL-7B and "
                               f"its VAE as files: set {', '.join(missing)}")
    if model.config:
        return ModelSource(override(model.config), files)
    tokenizer, _ = find_tokenizer("qwen25", TOKENIZER, model.comfyui, "Qwen-Image's Qwen2.5-VL")
    return ModelSource(assemble(overlay.name if overlay else "qwen-image", SHIPPED, {"tokenizer": tokenizer}, {},
                                overlay), files)


def load_transformer(path: Path, root: Path, dtype: torch.dtype = torch.float32, on_block: Any = None) -> Any:
    """QwenImageTransformer2DModel from a ComfyUI file, block by block: what is outside the blocks
    first, then each block, handed to ``on_block("block", index, block)`` as soon as it is read."""
    from diffusers import QwenImageTransformer2DModel

    layout = expect(path, KIND)
    prefix = layout.prefix
    config = diffusers_config(QwenImageTransformer2DModel, root, "transformer")
    with torch.device("meta"):
        model = QwenImageTransformer2DModel.from_config(config)
    model.requires_grad_(False)
    want = {k: v.shape for k, v in model.state_dict().items()}
    with open_file(path) as r:
        names = {k[len(prefix):]: k for k in r.with_prefix(prefix)}
        check_shapes(layout.path, "Qwen-Image transformer", {n: r.shape(k) for n, k in names.items()}, want,
                     "the Qwen-Image config given (model.config, or the shipped Qwen-Image's)")
        model.load_state_dict({n: r.get(k, dtype) for n, k in names.items() if not n.startswith("transformer_blocks.")},
                              strict=False, assign=True)
        own_module(model)
        for index, block in enumerate(model.transformer_blocks):
            pre = f"transformer_blocks.{index}."
            block.load_state_dict({n[len(pre):]: r.get(k, dtype) for n, k in names.items() if n.startswith(pre)},
                                  strict=True, assign=True)
            own_module(block)
            if on_block is not None:
                on_block("block", index, block)
            release_free_memory()
    return model.eval()


def load_text_encoder(src: Any, dtype: torch.dtype) -> Any:
    """Qwen2.5-VL (language model and vision tower, no LM head: the hidden states are what Qwen-Image
    reads) from ComfyUI's file: ``model.*`` is the language model's, ``visual.*`` the vision tower's;
    ``lm_head`` (if the file has it) is not read."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    path = src.files["text_encoder"]
    layout = expect(path, "qwen25-vl-7b")
    config = hf_config(Qwen2_5_VLConfig, src.root, "text_encoder")
    model = empty_model(lambda: Qwen2_5_VLModel(config))
    with open_file(path) as r:
        names = {}
        for key in r.with_prefix(layout.prefix):
            name = key[len(layout.prefix):]
            if name.startswith("model."):
                names[key] = "language_model." + name[len("model."):]
            elif name.startswith("visual."):
                names[key] = name
        note_ignored(r.path, [k for k in r.with_prefix(layout.prefix) if k not in names])
        state = {names[k]: r.get(k, dtype) for k in names}
    return fill(model, state, path=layout.path, what="Qwen2.5-VL text encoder",
                hint="the Qwen2.5-VL-7B config given (model.config, or the shipped Qwen-Image's)")


def load_vae(src: Any, dtype: torch.dtype) -> Any:
    """AutoencoderKLQwenImage from ComfyUI's file (Wan 2.1's original layout, which diffusers'
    ``convert_wan_vae_to_diffusers`` maps: Qwen-Image's VAE has Wan 2.1's module names)."""
    from diffusers import AutoencoderKLQwenImage
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    path = src.files["vae"]
    layout = expect(path, "vae-qwen-image")
    config = diffusers_config(AutoencoderKLQwenImage, src.root, "vae")
    model = empty_model(lambda: AutoencoderKLQwenImage.from_config(config))
    with open_file(path) as r:
        state = convert_wan_vae_to_diffusers({k[len(layout.prefix):]: r.get(k, dtype)
                                              for k in r.with_prefix(layout.prefix)})
    return fill(model, state, path=layout.path, what="Qwen-Image VAE",
                hint="the Qwen-Image VAE config given (model.config, or the shipped one)")


def base_weights(src: Any, component: str, paths: list[str]) -> dict[str, torch.Tensor]:
    """fp32 weights (``<path>.weight``) of transformer modules, from the file (DoRA's export)."""
    if component != "transformer":
        raise ModelSourceError(f"no base weights of Qwen-Image's {component} are read for export")
    prefix = expect(src.files["transformer"], KIND).prefix
    out = {}
    with ExitStack() as stack:
        r = stack.enter_context(open_file(src.files["transformer"]))
        for p in paths:
            key = f"{prefix}{p}.weight"
            if key not in r.key_set:
                raise ModelSourceError(f"{src.files['transformer']}: no weight {key} for the adapted module {p}")
            out[p] = r.get(key, torch.float32)
    return out
