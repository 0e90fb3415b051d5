"""FLUX.1 Kontext [dev]'s ComfyUI workflow, as ComfyUI's example: FLUX.1's split-file loaders and LoRA,
then LoadImage -> FluxKontextImageScale -> VAEEncode -> ReferenceLatent on the prompt's conditioning ->
FluxGuidance 2.5 -> KSampler on the encoded source's latent (for its size) -> image."""

from __future__ import annotations

from typing import Any

from ...export.workflows import UI_ONLY, Node
from ..flux import comfyui as flux

UNET = "flux1-kontext-dev.safetensors"  # Black Forest Labs' file name
SOURCE = "source.png"  # the input image: a file in ComfyUI's input folder; pick your own in the UI
GUIDANCE = 2.5  # ComfyUI's and diffusers' examples for Kontext


def nodes(lora_name: str, prompt: str, negative: str, seed: int, prefix: str, with_clip: bool = False,
          model: Any = None) -> list[Node]:
    graph = flux.nodes(lora_name, prompt, negative, seed, prefix, with_clip, model, default_unet=UNET)
    by_id = {n.id: n for n in graph}
    by_id[6].links = [("conditioning", "CONDITIONING", (15, 0))]  # FluxGuidance on the referenced prompt
    by_id[6].widgets = [("guidance", GUIDANCE)]
    sampler = by_id[9]
    sampler.links = [link if link[0] != "latent_image" else ("latent_image", "LATENT", (14, 0)) for link in sampler.links]
    source = [
        Node(12, "LoadImage", (0, 700), widgets=[("image", SOURCE), (UI_ONLY, "image")], outputs=["IMAGE", "MASK"],
             size=(315, 314)),
        Node(13, "FluxKontextImageScale", (350, 700), links=[("image", "IMAGE", (12, 0))], outputs=["IMAGE"]),
        Node(14, "VAEEncode", (700, 700), links=[("pixels", "IMAGE", (13, 0)), ("vae", "VAE", (3, 0))],
             outputs=["LATENT"], size=(210, 46)),
        Node(15, "ReferenceLatent", (1150, 300), links=[("conditioning", "CONDITIONING", (5, 0)),
                                                        ("latent", "LATENT", (14, 0))], outputs=["CONDITIONING"]),
    ]
    out = [n for n in graph if n.type != "EmptySD3LatentImage"]
    at = next(i for i, n in enumerate(out) if n.id == 6)
    return out[:at] + source + out[at:]
