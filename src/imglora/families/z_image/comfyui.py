"""Z-Image's ComfyUI workflow, from the split files ComfyUI users have (Comfy-Org's "Z-Image Turbo"
template, image_z_image_turbo.json): UNETLoader + CLIPLoader (Qwen3-4B, type "lumina2") + VAELoader
(FLUX.1's ae) -> LoRA -> ModelSamplingAuraFlow (shift 3) -> the prompt, and as negative the prompt
zeroed out (ConditioningZeroOut: Turbo runs without guidance) -> KSampler, 8 steps, cfg 1,
res_multistep/simple -> image."""

from __future__ import annotations

from typing import Any

from ...export.workflows import Node, Sampling, file_name, ksampler, text_node

UNET = "z_image_turbo_bf16.safetensors"
TEXT_ENCODER = "qwen_3_4b.safetensors"
VAE = "ae.safetensors"
SHIFT = 3.0  # ModelSamplingAuraFlow in Comfy-Org's template (Turbo's scheduler shift)
SAMPLING = Sampling(1024, 1024, steps=8, cfg=1.0, sampler="res_multistep", scheduler="simple")
GUIDANCE = 0.0  # ZImagePipeline's guidance_scale for Turbo: no classifier-free guidance (ComfyUI's cfg 1)


def nodes(lora_name: str, prompt: str, negative: str, seed: int, prefix: str, model: Any = None) -> list[Node]:
    s = SAMPLING
    comfy = getattr(model, "comfyui", "")
    return [
        Node(1, "UNETLoader", (0, 100), widgets=[("unet_name", file_name(getattr(model, "path", ""), comfy, UNET)),
                                                 ("weight_dtype", "default")], outputs=["MODEL"]),
        Node(2, "CLIPLoader", (0, 300), widgets=[("clip_name", file_name(getattr(model, "text_encoder", ""), comfy,
                                                                         TEXT_ENCODER)),
                                                 ("type", "lumina2")], outputs=["CLIP"]),
        Node(3, "VAELoader", (0, 500), widgets=[("vae_name", file_name(getattr(model, "vae", ""), comfy, VAE))],
             outputs=["VAE"]),
        Node(4, "LoraLoaderModelOnly", (350, 100), links=[("model", "MODEL", (1, 0))],
             widgets=[("lora_name", lora_name), ("strength_model", 1.0)], outputs=["MODEL"]),
        Node(5, "ModelSamplingAuraFlow", (700, 0), links=[("model", "MODEL", (4, 0))], widgets=[("shift", SHIFT)],
             outputs=["MODEL"]),
        text_node(6, (700, 150), (2, 0), prompt),
        Node(7, "ConditioningZeroOut", (700, 370), links=[("conditioning", "CONDITIONING", (6, 0))],
             outputs=["CONDITIONING"], size=(200, 30)),
        Node(8, "EmptySD3LatentImage", (700, 470), widgets=[("width", s.width), ("height", s.height),
                                                            ("batch_size", 1)], outputs=["LATENT"]),
        ksampler(9, (1150, 200), (5, 0), (6, 0), (7, 0), (8, 0), seed, s),
        Node(10, "VAEDecode", (1500, 200), links=[("samples", "LATENT", (9, 0)), ("vae", "VAE", (3, 0))],
             outputs=["IMAGE"], size=(210, 46)),
        Node(11, "SaveImage", (1750, 200), links=[("images", "IMAGE", (10, 0))],
             widgets=[("filename_prefix", prefix)], size=(315, 270)),
    ]
