"""Chroma's ComfyUI workflow, from the split files ComfyUI users have: UNETLoader + CLIPLoader (T5,
type "chroma") + VAELoader -> LoRA -> positive and negative prompts -> KSampler with real CFG
(Chroma has no distilled guidance) -> image."""

from __future__ import annotations

from typing import Any

from ...export.workflows import Node, Sampling, file_name, ksampler, text_node

UNET = "Chroma1-HD.safetensors"
T5 = "t5xxl_fp16.safetensors"
VAE = "ae.safetensors"
# CFG 4 and euler/simple at 26 steps, as the peers sample Chroma (ai-toolkit: cfg 4, 25 steps).
SAMPLING = Sampling(1024, 1024, steps=26, cfg=4.0, sampler="euler", scheduler="simple")
NEGATIVE = "low quality, blurry, deformed"


def nodes(lora_name: str, prompt: str, negative: str, seed: int, prefix: str, model: Any = None) -> list[Node]:
    s = SAMPLING
    comfy = getattr(model, "comfyui", "")
    return [
        Node(1, "UNETLoader", (0, 100), widgets=[("unet_name", file_name(getattr(model, "path", ""), comfy, UNET)),
                                                 ("weight_dtype", "default")], outputs=["MODEL"]),
        Node(2, "CLIPLoader", (0, 300), widgets=[("clip_name", file_name(getattr(model, "text_encoder", ""), comfy, T5)),
                                                 ("type", "chroma")], outputs=["CLIP"]),
        Node(3, "VAELoader", (0, 500), widgets=[("vae_name", file_name(getattr(model, "vae", ""), comfy, VAE))],
             outputs=["VAE"]),
        Node(4, "LoraLoaderModelOnly", (350, 100), links=[("model", "MODEL", (1, 0))],
             widgets=[("lora_name", lora_name), ("strength_model", 1.0)], outputs=["MODEL"]),
        text_node(5, (700, 100), (2, 0), prompt),
        text_node(6, (700, 320), (2, 0), negative or NEGATIVE),
        Node(7, "EmptySD3LatentImage", (700, 540), widgets=[("width", s.width), ("height", s.height),
                                                            ("batch_size", 1)], outputs=["LATENT"]),
        ksampler(8, (1150, 200), (4, 0), (5, 0), (6, 0), (7, 0), seed, s),
        Node(9, "VAEDecode", (1500, 200), links=[("samples", "LATENT", (8, 0)), ("vae", "VAE", (3, 0))],
             outputs=["IMAGE"], size=(210, 46)),
        Node(10, "SaveImage", (1750, 200), links=[("images", "IMAGE", (9, 0))],
             widgets=[("filename_prefix", prefix)], size=(315, 270)),
    ]
