"""Krea 2's ComfyUI workflow, from the split files ComfyUI users have (Comfy-Org/Krea-2): UNETLoader
(Raw, the model LoRAs are trained on) + CLIPLoader (Qwen3-VL-4B, type "krea2") + VAELoader
(Qwen-Image's) -> LoRA -> the prompt and a negative prompt -> KSampler with classifier-free guidance
5.5 (Krea's 4.5 in diffusers' convention, where g means 1 + g), 28 steps, euler/simple (the model's
shift is built into ComfyUI's Krea 2 model) -> image."""

from __future__ import annotations

from typing import Any

from ...export.workflows import Node, Sampling, file_name, ksampler, text_node

UNET = "krea2_raw_bf16.safetensors"
TEXT_ENCODER = "qwen3vl_4b_fp8_scaled.safetensors"
VAE = "qwen_image_vae.safetensors"
SAMPLING = Sampling(1024, 1024, steps=28, cfg=5.5, sampler="euler", scheduler="simple")
GUIDANCE = 4.5  # Krea2Pipeline's guidance_scale (its convention: 1 + g in standard CFG)


def nodes(lora_name: str, prompt: str, negative: str, seed: int, prefix: str, model: Any = None) -> list[Node]:
    s = SAMPLING
    comfy = getattr(model, "comfyui", "")
    return [
        Node(1, "UNETLoader", (0, 100), widgets=[("unet_name", file_name(getattr(model, "path", ""), comfy, UNET)),
                                                 ("weight_dtype", "default")], outputs=["MODEL"]),
        Node(2, "CLIPLoader", (0, 300), widgets=[("clip_name", file_name(getattr(model, "text_encoder", ""), comfy,
                                                                         TEXT_ENCODER)),
                                                 ("type", "krea2")], outputs=["CLIP"]),
        Node(3, "VAELoader", (0, 500), widgets=[("vae_name", file_name(getattr(model, "vae", ""), comfy, VAE))],
             outputs=["VAE"]),
        Node(4, "LoraLoaderModelOnly", (350, 100), links=[("model", "MODEL", (1, 0))],
             widgets=[("lora_name", lora_name), ("strength_model", 1.0)], outputs=["MODEL"]),
        text_node(5, (700, 150), (2, 0), prompt),
        text_node(6, (700, 370), (2, 0), negative),
        Node(7, "EmptySD3LatentImage", (700, 590), widgets=[("width", s.width), ("height", s.height),
                                                            ("batch_size", 1)], outputs=["LATENT"]),
        ksampler(8, (1150, 200), (4, 0), (5, 0), (6, 0), (7, 0), seed, s),
        Node(9, "VAEDecode", (1500, 200), links=[("samples", "LATENT", (8, 0)), ("vae", "VAE", (3, 0))],
             outputs=["IMAGE"], size=(210, 46)),
        Node(10, "SaveImage", (1750, 200), links=[("images", "IMAGE", (9, 0))],
             widgets=[("filename_prefix", prefix)], size=(315, 270)),
    ]
