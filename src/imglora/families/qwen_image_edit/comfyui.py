"""Qwen-Image-Edit's ComfyUI workflow, as Comfy-Org's example: Qwen-Image's split-file loaders and
LoRA -> ModelSamplingAuraFlow (shift 3) -> LoadImage -> ImageScaleToTotalPixels (1 MP) ->
TextEncodeQwenImageEdit (Edit) or TextEncodeQwenImageEditPlus (2509/2511; image1) for the prompt and
the negative prompt, each given the VAE so the source becomes their reference latent -> KSampler on
the encoded source's latent (for its size), real CFG 2.5 -> image."""

from __future__ import annotations

from typing import Any

from ...export.workflows import UI_ONLY, Node, Sampling, file_name, ksampler
from ..qwen_image import comfyui as qwen

UNET = "qwen_image_edit_fp8_e4m3fn.safetensors"  # Comfy-Org's file names
UNET_PLUS = "qwen_image_edit_2509_fp8_e4m3fn.safetensors"
SHIFT = 3.0  # ModelSamplingAuraFlow in Comfy-Org's Edit workflows
CFG = 2.5
SAMPLING = Sampling(1024, 1024, steps=20, cfg=CFG, sampler="euler", scheduler="simple")
NEGATIVE = " "
SOURCE = "source.png"  # the input image: a file in ComfyUI's input folder; pick your own in the UI


def nodes(lora_name: str, prompt: str, negative: str, seed: int, prefix: str, plus: bool = False,
          model: Any = None) -> list[Node]:
    comfy = getattr(model, "comfyui", "")
    encode = "TextEncodeQwenImageEditPlus" if plus else "TextEncodeQwenImageEdit"
    image_input = "image1" if plus else "image"

    def text(id_: int, pos: tuple[int, int], words: str) -> Node:
        return Node(id_, encode, pos, links=[("clip", "CLIP", (2, 0)), ("vae", "VAE", (3, 0)),
                                             (image_input, "IMAGE", (13, 0))],
                    widgets=[("prompt", words)], outputs=["CONDITIONING"], size=(400, 200))

    graph = qwen.nodes(lora_name, prompt, negative, seed, prefix, model=model)
    by_id = {n.id: n for n in graph}
    by_id[1].widgets = [("unet_name", file_name(getattr(model, "path", ""), comfy, UNET_PLUS if plus else UNET)),
                        ("weight_dtype", "default")]
    by_id[5].widgets = [("shift", SHIFT)]
    by_id[6] = text(6, (700, 150), prompt)
    by_id[7] = text(7, (700, 400), negative or NEGATIVE)
    source = [
        Node(12, "LoadImage", (0, 700), widgets=[("image", SOURCE), (UI_ONLY, "image")], outputs=["IMAGE", "MASK"],
             size=(315, 314)),
        Node(13, "ImageScaleToTotalPixels", (350, 700), links=[("image", "IMAGE", (12, 0))],
             widgets=[("upscale_method", "lanczos"), ("megapixels", 1.0)], outputs=["IMAGE"]),
        Node(14, "VAEEncode", (700, 700), links=[("pixels", "IMAGE", (13, 0)), ("vae", "VAE", (3, 0))],
             outputs=["LATENT"], size=(210, 46)),
    ]
    by_id[9] = ksampler(9, (1150, 200), (5, 0), (6, 0), (7, 0), (14, 0), seed, SAMPLING)
    return [by_id[i] for i in (1, 2, 3, 4, 5)] + source + [by_id[i] for i in (6, 7, 9, 10, 11)]
