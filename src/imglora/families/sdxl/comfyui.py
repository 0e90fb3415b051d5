"""SDXL's ComfyUI workflow: checkpoint -> LoRA (model and CLIP) -> prompt -> KSampler -> image."""

from __future__ import annotations

from typing import Any

from ...export.workflows import Node, Sampling, file_name, ksampler, text_node

# The base-model file name ComfyUI users have (the official example workflows').
CHECKPOINT = "sd_xl_base_1.0.safetensors"
SAMPLING = Sampling(1024, 1024, steps=30, cfg=7.0, sampler="euler", scheduler="normal")


def nodes(lora_name: str, prompt: str, negative: str, seed: int, prefix: str, with_clip: bool = True,
          model: Any = None) -> list[Node]:
    """The checkpoint the run trained on when it was given as a file (``model``, the preset's
    [model] section; with its separate VAE if it had one), else SDXL base. ``with_clip`` is
    ignored: LoraLoader patches the text encoders when the LoRA has weights for them."""
    s = SAMPLING
    comfy = getattr(model, "comfyui", "")
    ckpt = file_name(getattr(model, "path", ""), comfy, CHECKPOINT)
    vae_file = file_name(getattr(model, "vae", ""), comfy, "")
    extra = [Node(9, "VAELoader", (1150, 500), widgets=[("vae_name", vae_file)], outputs=["VAE"])] if vae_file else []
    vae = (9, 0) if vae_file else (1, 2)
    return [
        Node(1, "CheckpointLoaderSimple", (0, 200), widgets=[("ckpt_name", ckpt)],
             outputs=["MODEL", "CLIP", "VAE"]),
        Node(2, "LoraLoader", (350, 200), links=[("model", "MODEL", (1, 0)), ("clip", "CLIP", (1, 1))],
             widgets=[("lora_name", lora_name), ("strength_model", 1.0), ("strength_clip", 1.0)],
             outputs=["MODEL", "CLIP"], size=(315, 130)),
        text_node(3, (700, 100), (2, 1), prompt),
        text_node(4, (700, 300), (2, 1), negative),
        Node(5, "EmptyLatentImage", (700, 500), widgets=[("width", s.width), ("height", s.height),
                                                         ("batch_size", 1)], outputs=["LATENT"]),
        ksampler(6, (1150, 200), (2, 0), (3, 0), (4, 0), (5, 0), seed, s),
        *extra,
        Node(7, "VAEDecode", (1500, 200), links=[("samples", "LATENT", (6, 0)), ("vae", "VAE", vae)],
             outputs=["IMAGE"], size=(210, 46)),
        Node(8, "SaveImage", (1750, 200), links=[("images", "IMAGE", (7, 0))],
             widgets=[("filename_prefix", prefix)], size=(315, 270)),
    ]
