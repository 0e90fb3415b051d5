"""Qwen-Image's ComfyUI workflow, from the split files ComfyUI users have (Comfy-Org's example
workflow): UNETLoader + CLIPLoader (Qwen2.5-VL, type "qwen_image") + VAELoader -> LoRA ->
ModelSamplingAuraFlow (shift 3.1) -> positive and negative prompts -> KSampler with real CFG 2.5 ->
image."""

from __future__ import annotations

from typing import Any

from ...export.workflows import Node, Sampling, file_name, ksampler, text_node

UNET = "qwen_image_fp8_e4m3fn.safetensors"
TEXT_ENCODER = "qwen_2.5_vl_7b_fp8_scaled.safetensors"
VAE = "qwen_image_vae.safetensors"
SHIFT = 3.1  # ModelSamplingAuraFlow in Comfy-Org's Qwen-Image workflow
# Comfy-Org's workflow: 1328² (Qwen-Image's native size), 20 steps, cfg 2.5, euler/simple.
SAMPLING = Sampling(1328, 1328, steps=20, cfg=2.5, sampler="euler", scheduler="simple")
NEGATIVE = " "  # QwenImagePipeline's example negative prompt (real CFG needs one)


def nodes(lora_name: str, prompt: str, negative: str, seed: int, prefix: str, model: Any = None) -> list[Node]:
    s = SAMPLING
    comfy = getattr(model, "comfyui", "")
    return [
        Node(1, "UNETLoader", (0, 100), widgets=[("unet_name", file_name(getattr(model, "path", ""), comfy, UNET)),
                                                 ("weight_dtype", "default")], outputs=["MODEL"]),
        Node(2, "CLIPLoader", (0, 300), widgets=[("clip_name", file_name(getattr(model, "text_encoder", ""), comfy,
                                                                         TEXT_ENCODER)),
                                                 ("type", "qwen_image")], outputs=["CLIP"]),
        Node(3, "VAELoader", (0, 500), widgets=[("vae_name", file_name(getattr(model, "vae", ""), comfy, VAE))],
             outputs=["VAE"]),
        Node(4, "LoraLoaderModelOnly", (350, 100), links=[("model", "MODEL", (1, 0))],
             widgets=[("lora_name", lora_name), ("strength_model", 1.0)], outputs=["MODEL"]),
        Node(5, "ModelSamplingAuraFlow", (700, 0), links=[("model", "MODEL", (4, 0))], widgets=[("shift", SHIFT)],
             outputs=["MODEL"]),
        text_node(6, (700, 150), (2, 0), prompt),
        text_node(7, (700, 370), (2, 0), negative or NEGATIVE),
        Node(8, "EmptySD3LatentImage", (700, 590), widgets=[("width", s.width), ("height", s.height),
                                                            ("batch_size", 1)], outputs=["LATENT"]),
        ksampler(9, (1150, 200), (5, 0), (6, 0), (7, 0), (8, 0), seed, s),
        Node(10, "VAEDecode", (1500, 200), links=[("samples", "LATENT", (9, 0)), ("vae", "VAE", (3, 0))],
             outputs=["IMAGE"], size=(210, 46)),
        Node(11, "SaveImage", (1750, 200), links=[("images", "IMAGE", (10, 0))],
             widgets=[("filename_prefix", prefix)], size=(315, 270)),
    ]
