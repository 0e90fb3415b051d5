"""Qwen-Image 2.1's ComfyUI workflow, from the split files ComfyUI users have (Comfy-Org/Qwen-Image-2.1):
UNETLoader + CLIPLoader (Qwen3-VL-8B, type "qwen_image") + VAELoader -> LoRA -> TextEncodeQwenImage21
(ComfyUI's node for 2.1: the prompt, the negative prompt and the empty 64-channel latent at the
resolution) -> KSampler without guidance (cfg 1, the model's default), euler/simple (ComfyUI's
"simple" schedule is the pipeline's, shift included), 40 steps as the pipeline -> image."""

from __future__ import annotations

from typing import Any

from ...export.workflows import Node, Sampling, file_name, ksampler

UNET = "qwen_image_2.1_bf16.safetensors"
TEXT_ENCODER = "qwen3vl_8b_bf16.safetensors"
VAE = "qwen_image_2.1_vae_bf16.safetensors"
SAMPLING = Sampling(1024, 1024, steps=40, cfg=1.0, sampler="euler", scheduler="simple")
GUIDANCE = 1.0  # QwenImage21Pipeline's true_cfg_scale: sampled without guidance


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
        Node(5, "TextEncodeQwenImage21", (700, 250), links=[("clip", "CLIP", (2, 0))],
             widgets=[("prompt", prompt), ("negative_prompt", negative), ("resolution", s.width)],
             outputs=["CONDITIONING", "CONDITIONING", "LATENT"], size=(400, 300)),
        ksampler(8, (1150, 200), (4, 0), (5, 0), (5, 1), (5, 2), seed, s),
        Node(9, "VAEDecode", (1500, 200), links=[("samples", "LATENT", (8, 0)), ("vae", "VAE", (3, 0))],
             outputs=["IMAGE"], size=(210, 46)),
        Node(10, "SaveImage", (1750, 200), links=[("images", "IMAGE", (9, 0))],
             widgets=[("filename_prefix", prefix)], size=(315, 270)),
    ]
