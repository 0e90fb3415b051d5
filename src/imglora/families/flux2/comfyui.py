"""FLUX.2's ComfyUI workflows, from the split files ComfyUI users have (Comfy-Org's FLUX.2 templates):
UNETLoader + CLIPLoader (type "flux2": Qwen3 for [klein], Mistral-Small-3 for [dev]) + VAELoader
(flux2-vae) -> LoRA -> SamplerCustomAdvanced with Flux2Scheduler (the resolution- and step-dependent
shift of the pipelines), euler, EmptyFlux2LatentImage. [klein] base is sampled with real
classifier-free guidance (CFGGuider, cfg 4 with a negative prompt); [dev] with its embedded
guidance (FluxGuidance 4, BasicGuider)."""

from __future__ import annotations

import re
from typing import Any

from ...export.workflows import UI_ONLY, Node, Sampling, file_name, text_node

FILES = {"klein": ("flux-2-klein-base-4b.safetensors", "qwen_3_4b.safetensors"),
         "dev": ("flux2_dev_fp8mixed.safetensors", "mistral_3_small_flux2_fp8.safetensors")}
VAE = "flux2-vae.safetensors"
SAMPLING = {"klein": Sampling(1024, 1024, steps=50, cfg=4.0, sampler="euler", scheduler="simple"),
            "dev": Sampling(1024, 1024, steps=50, cfg=1.0, sampler="euler", scheduler="simple", guidance=4.0)}


def variant_named(path: str) -> str:
    """"dev" for a FLUX.2 [dev] file or repository name, else "klein"."""
    return "dev" if re.search(r"flux[._-]?2[._-]?dev", path.lower()) else "klein"


def nodes(lora_name: str, prompt: str, negative: str, seed: int, prefix: str, model: Any = None) -> list[Node]:
    kind = variant_named(str(getattr(model, "path", "") or ""))
    s, (unet, te) = SAMPLING[kind], FILES[kind]
    comfy = getattr(model, "comfyui", "")
    out = [
        Node(1, "UNETLoader", (0, 100), widgets=[("unet_name", file_name(getattr(model, "path", ""), comfy, unet)),
                                                 ("weight_dtype", "default")], outputs=["MODEL"]),
        Node(2, "CLIPLoader", (0, 300), widgets=[("clip_name", file_name(getattr(model, "text_encoder", ""), comfy, te)),
                                                 ("type", "flux2")], outputs=["CLIP"]),
        Node(3, "VAELoader", (0, 500), widgets=[("vae_name", file_name(getattr(model, "vae", ""), comfy, VAE))],
             outputs=["VAE"]),
        Node(4, "LoraLoaderModelOnly", (350, 100), links=[("model", "MODEL", (1, 0))],
             widgets=[("lora_name", lora_name), ("strength_model", 1.0)], outputs=["MODEL"]),
        text_node(5, (350, 250), (2, 0), prompt),
    ]
    if kind == "dev":
        out += [Node(6, "FluxGuidance", (800, 250), links=[("conditioning", "CONDITIONING", (5, 0))],
                     widgets=[("guidance", s.guidance)], outputs=["CONDITIONING"]),
                Node(7, "BasicGuider", (1100, 100), links=[("model", "MODEL", (4, 0)),
                                                           ("conditioning", "CONDITIONING", (6, 0))],
                     outputs=["GUIDER"])]
    else:
        out += [text_node(6, (350, 470), (2, 0), negative),
                Node(7, "CFGGuider", (1100, 100), links=[("model", "MODEL", (4, 0)), ("positive", "CONDITIONING", (5, 0)),
                                                         ("negative", "CONDITIONING", (6, 0))],
                     widgets=[("cfg", s.cfg)], outputs=["GUIDER"])]
    return out + [
        Node(8, "RandomNoise", (1100, 300), widgets=[("noise_seed", seed), (UI_ONLY, "fixed")], outputs=["NOISE"]),
        Node(9, "KSamplerSelect", (1100, 450), widgets=[("sampler_name", s.sampler)], outputs=["SAMPLER"]),
        Node(10, "Flux2Scheduler", (1100, 550), widgets=[("steps", s.steps), ("width", s.width), ("height", s.height)],
             outputs=["SIGMAS"]),
        Node(11, "EmptyFlux2LatentImage", (1100, 700), widgets=[("width", s.width), ("height", s.height),
                                                               ("batch_size", 1)], outputs=["LATENT"]),
        Node(12, "SamplerCustomAdvanced", (1450, 200), links=[
            ("noise", "NOISE", (8, 0)), ("guider", "GUIDER", (7, 0)), ("sampler", "SAMPLER", (9, 0)),
            ("sigmas", "SIGMAS", (10, 0)), ("latent_image", "LATENT", (11, 0))], outputs=["LATENT", "LATENT"],
             size=(272, 124)),
        Node(13, "VAEDecode", (1800, 200), links=[("samples", "LATENT", (12, 0)), ("vae", "VAE", (3, 0))],
             outputs=["IMAGE"], size=(210, 46)),
        Node(14, "SaveImage", (2050, 200), links=[("images", "IMAGE", (13, 0))],
             widgets=[("filename_prefix", prefix)], size=(315, 270)),
    ]
