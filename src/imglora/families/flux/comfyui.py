"""FLUX.1-dev's ComfyUI workflow, from the split files ComfyUI users have: UNETLoader +
DualCLIPLoader + VAELoader -> LoRA -> FluxGuidance -> KSampler -> image."""

from __future__ import annotations

from typing import Any

from ...export.workflows import UI_ONLY, Node, Sampling, file_name, ksampler, text_node

# The file names in ComfyUI's official FLUX.1-dev example workflow.
UNET = "flux1-dev.safetensors"
CLIP_L = "clip_l.safetensors"
T5 = "t5xxl_fp16.safetensors"
VAE = "ae.safetensors"
SAMPLING = Sampling(1024, 1024, steps=20, cfg=1.0, sampler="euler", scheduler="simple", guidance=3.5)


def nodes(lora_name: str, prompt: str, negative: str, seed: int, prefix: str, with_clip: bool = False,
          model: Any = None, default_unet: str = UNET) -> list[Node]:
    """FLUX.1-dev as split files: the very files the run trained on when it was given files
    (``model``, the preset's [model] section), else the usual names. The LoRA patches only the model
    (LoraLoaderModelOnly) unless it also holds CLIP-L weights. At cfg 1 the negative is never
    evaluated, but KSampler needs one."""
    s = SAMPLING
    comfy = getattr(model, "comfyui", "")
    unet = file_name(getattr(model, "path", ""), comfy, default_unet)
    clip_l = file_name(getattr(model, "text_encoder", ""), comfy, CLIP_L)
    t5 = file_name(getattr(model, "text_encoder_2", ""), comfy, T5)
    vae = file_name(getattr(model, "vae", ""), comfy, VAE)
    if with_clip:
        lora = Node(4, "LoraLoader", (350, 100), links=[("model", "MODEL", (1, 0)), ("clip", "CLIP", (2, 0))],
                    widgets=[("lora_name", lora_name), ("strength_model", 1.0), ("strength_clip", 1.0)],
                    outputs=["MODEL", "CLIP"], size=(315, 130))
        clip = (4, 1)
    else:
        lora = Node(4, "LoraLoaderModelOnly", (350, 100), links=[("model", "MODEL", (1, 0))],
                    widgets=[("lora_name", lora_name), ("strength_model", 1.0)], outputs=["MODEL"])
        clip = (2, 0)
    return [
        Node(1, "UNETLoader", (0, 100), widgets=[("unet_name", unet), ("weight_dtype", "default")],
             outputs=["MODEL"]),
        Node(2, "DualCLIPLoader", (0, 300),
             widgets=[("clip_name1", clip_l), ("clip_name2", t5), ("type", "flux"),
                      # optional input newer ComfyUI shows as a widget; left out of the API prompt
                      # so that older servers accept it too
                      (UI_ONLY, "default")],
             outputs=["CLIP"], size=(315, 130)),
        Node(3, "VAELoader", (0, 500), widgets=[("vae_name", vae)], outputs=["VAE"]),
        lora,
        text_node(5, (700, 100), clip, prompt),
        Node(6, "FluxGuidance", (1150, 100), links=[("conditioning", "CONDITIONING", (5, 0))],
             widgets=[("guidance", s.guidance)], outputs=["CONDITIONING"]),
        text_node(7, (700, 320), clip, negative),
        Node(8, "EmptySD3LatentImage", (700, 540), widgets=[("width", s.width), ("height", s.height),
                                                            ("batch_size", 1)], outputs=["LATENT"]),
        ksampler(9, (1500, 200), (4, 0), (6, 0), (7, 0), (8, 0), seed, s),
        Node(10, "VAEDecode", (1850, 200), links=[("samples", "LATENT", (9, 0)), ("vae", "VAE", (3, 0))],
             outputs=["IMAGE"], size=(210, 46)),
        Node(11, "SaveImage", (2100, 200), links=[("images", "IMAGE", (10, 0))],
             widgets=[("filename_prefix", prefix)], size=(315, 270)),
    ]
