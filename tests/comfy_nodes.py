"""The inputs and outputs of the ComfyUI nodes imglora's workflows use, and ComfyUI's
``execution.validate_prompt`` over them, reimplemented for the tests.

Read from Comfy-Org/ComfyUI (nodes.py, comfy/samplers.py, comfy_extras/nodes_sd3.py,
nodes_flux.py, nodes_edit_model.py, nodes_model_advanced.py, nodes_post_processing.py,
nodes_qwen.py, the Z-Image template's ConditioningZeroOut, nodes_custom_sampler.py and
nodes_flux.py's FLUX.2 nodes). What ``validate_prompt`` / ``validate_inputs`` check, and this does too: every
node's class exists; every required input is given; a link names an existing node and one of its
outputs, whose type is the input's; an INT or FLOAT value converts and lies within min/max; a
combo's value is one of its options (options that list the files of the user's model folders are
not checkable here and accept any name); at least one output node (SaveImage).
"""

from __future__ import annotations

from typing import Any

FILES = "FILES"  # a combo of the files in a ComfyUI model folder: any file name
MAX_RESOLUTION = 16384
SAMPLERS = ["euler", "euler_cfg_pp", "euler_ancestral", "euler_ancestral_cfg_pp", "heun", "heunpp2", "dpm_2",
            "dpm_2_ancestral", "lms", "dpm_fast", "dpm_adaptive", "dpmpp_2s_ancestral", "dpmpp_2s_ancestral_cfg_pp",
            "dpmpp_sde", "dpmpp_sde_gpu", "dpmpp_2m", "dpmpp_2m_cfg_pp", "dpmpp_2m_sde", "dpmpp_2m_sde_gpu",
            "dpmpp_2m_sde_heun", "dpmpp_2m_sde_heun_gpu", "dpmpp_3m_sde", "dpmpp_3m_sde_gpu", "ddpm", "lcm", "ipndm",
            "ipndm_v", "deis", "res_multistep", "res_multistep_cfg_pp", "res_multistep_ancestral",
            "res_multistep_ancestral_cfg_pp", "gradient_estimation", "gradient_estimation_cfg_pp", "er_sde", "seeds_2",
            "seeds_3", "sa_solver", "sa_solver_pece", "ddim", "uni_pc", "uni_pc_bh2"]
SCHEDULERS = ["simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal", "linear_quadratic",
              "kl_optimal"]
CLIP_TYPES = ["stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart", "cosmos",
              "lumina2", "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image", "hunyuan_image", "flux2", "krea2"]  # (2026: flux2, krea2)
DUAL_CLIP_TYPES = ["sdxl", "sd3", "flux", "hunyuan_video", "hidream", "hunyuan_image"]


def _int(lo: float, hi: float) -> tuple[str, dict]:
    return ("INT", {"min": lo, "max": hi})


def _float(lo: float, hi: float) -> tuple[str, dict]:
    return ("FLOAT", {"min": lo, "max": hi})


LATENT_SIZE = {"width": _int(16, MAX_RESOLUTION), "height": _int(16, MAX_RESOLUTION), "batch_size": _int(1, 4096)}
# class -> (required inputs, optional inputs, output types, is an output node)
NODES: dict[str, tuple[dict[str, Any], dict[str, Any], list[str], bool]] = {
    "CheckpointLoaderSimple": ({"ckpt_name": FILES}, {}, ["MODEL", "CLIP", "VAE"], False),
    "UNETLoader": ({"unet_name": FILES, "weight_dtype": ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]}, {},
                   ["MODEL"], False),
    "CLIPLoader": ({"clip_name": FILES, "type": CLIP_TYPES}, {"device": ["default", "cpu"]}, ["CLIP"], False),
    "DualCLIPLoader": ({"clip_name1": FILES, "clip_name2": FILES, "type": DUAL_CLIP_TYPES},
                       {"device": ["default", "cpu"]}, ["CLIP"], False),
    "VAELoader": ({"vae_name": FILES}, {}, ["VAE"], False),
    "LoraLoader": ({"model": "MODEL", "clip": "CLIP", "lora_name": FILES, "strength_model": _float(-100, 100),
                    "strength_clip": _float(-100, 100)}, {}, ["MODEL", "CLIP"], False),
    "LoraLoaderModelOnly": ({"model": "MODEL", "lora_name": FILES, "strength_model": _float(-100, 100)}, {},
                            ["MODEL"], False),
    "CLIPTextEncode": ({"text": "STRING", "clip": "CLIP"}, {}, ["CONDITIONING"], False),
    "KSampler": ({"model": "MODEL", "seed": _int(0, 0xffffffffffffffff), "steps": _int(1, 10000),
                  "cfg": _float(0.0, 100.0), "sampler_name": SAMPLERS, "scheduler": SCHEDULERS,
                  "positive": "CONDITIONING", "negative": "CONDITIONING", "latent_image": "LATENT",
                  "denoise": _float(0.0, 1.0)}, {}, ["LATENT"], False),
    "EmptyLatentImage": (LATENT_SIZE, {}, ["LATENT"], False),
    "EmptySD3LatentImage": (LATENT_SIZE, {}, ["LATENT"], False),
    "VAEDecode": ({"samples": "LATENT", "vae": "VAE"}, {}, ["IMAGE"], False),
    "VAEEncode": ({"pixels": "IMAGE", "vae": "VAE"}, {}, ["LATENT"], False),
    "SaveImage": ({"images": "IMAGE", "filename_prefix": "STRING"}, {}, [], True),
    "LoadImage": ({"image": FILES}, {}, ["IMAGE", "MASK"], False),
    "FluxGuidance": ({"conditioning": "CONDITIONING", "guidance": _float(0.0, 100.0)}, {}, ["CONDITIONING"], False),
    "FluxKontextImageScale": ({"image": "IMAGE"}, {}, ["IMAGE"], False),
    "ReferenceLatent": ({"conditioning": "CONDITIONING"}, {"latent": "LATENT"}, ["CONDITIONING"], False),
    # comfy_extras/nodes_custom_sampler.py and nodes_flux.py (FLUX.2's templates)
    "RandomNoise": ({"noise_seed": _int(0, 0xffffffffffffffff)}, {}, ["NOISE"], False),
    "CFGGuider": ({"model": "MODEL", "positive": "CONDITIONING", "negative": "CONDITIONING", "cfg": _float(0.0, 100.0)},
                  {}, ["GUIDER"], False),
    "BasicGuider": ({"model": "MODEL", "conditioning": "CONDITIONING"}, {}, ["GUIDER"], False),
    "KSamplerSelect": ({"sampler_name": SAMPLERS}, {}, ["SAMPLER"], False),
    "Flux2Scheduler": ({"steps": _int(1, 4096), "width": _int(1, MAX_RESOLUTION), "height": _int(1, MAX_RESOLUTION)},
                       {}, ["SIGMAS"], False),
    "EmptyFlux2LatentImage": (LATENT_SIZE, {}, ["LATENT"], False),
    "SamplerCustomAdvanced": ({"noise": "NOISE", "guider": "GUIDER", "sampler": "SAMPLER", "sigmas": "SIGMAS",
                               "latent_image": "LATENT"}, {}, ["LATENT", "LATENT"], False),
    "ConditioningZeroOut": ({"conditioning": "CONDITIONING"}, {}, ["CONDITIONING"], False),
    "ModelSamplingAuraFlow": ({"model": "MODEL", "shift": _float(0.0, 100.0)}, {}, ["MODEL"], False),
    "ImageScaleToTotalPixels": ({"image": "IMAGE", "upscale_method": ["nearest-exact", "bilinear", "area", "bicubic",
                                                                      "lanczos"], "megapixels": _float(0.01, 16.0)},
                                {}, ["IMAGE"], False),
    "TextEncodeQwenImageEdit": ({"clip": "CLIP", "prompt": "STRING"}, {"vae": "VAE", "image": "IMAGE"},
                                ["CONDITIONING"], False),
    # comfy_extras/nodes_qwen.py (2026): Qwen-Image 2.1's encoder node gives both conditionings and the empty
    # 64-channel latent at its resolution (reference images, an Autogrow input, optional)
    "TextEncodeQwenImage21": ({"clip": "CLIP", "prompt": "STRING", "negative_prompt": "STRING",
                               "resolution": _int(0, 4096)}, {"vae": "VAE"},
                              ["CONDITIONING", "CONDITIONING", "LATENT"], False),
    "TextEncodeQwenImageEditPlus": ({"clip": "CLIP", "prompt": "STRING"},
                                    {"vae": "VAE", "image1": "IMAGE", "image2": "IMAGE", "image3": "IMAGE"},
                                    ["CONDITIONING"], False),
}


def validate_prompt(prompt: dict[str, Any]) -> list[str]:
    """The errors ComfyUI's validate_prompt reports for an API-format ``prompt`` ([] when valid)."""
    errors: list[str] = []
    outputs = 0
    for node_id, node in prompt.items():
        cls = node.get("class_type")
        if cls not in NODES:
            errors.append(f"{node_id}: class_type {cls!r} is not a ComfyUI node")
            continue
        required, optional, _, is_output = NODES[cls]
        outputs += is_output
        given = node.get("inputs", {})
        for name, spec in {**required, **optional}.items():
            if name not in given:
                if name in required:
                    errors.append(f"{node_id} {cls}: required input {name!r} is missing")
                continue
            errors += _check(prompt, node_id, cls, name, spec, given[name])
    if not outputs:
        errors.append("prompt has no outputs")
    return errors


def _check(prompt: dict[str, Any], node_id: str, cls: str, name: str, spec: Any, value: Any) -> list[str]:
    where = f"{node_id} {cls}.{name}"
    if isinstance(value, list):  # a link [source id, output index]
        if len(value) != 2 or str(value[0]) not in prompt:
            return [f"{where}: links to a node that is not in the prompt: {value}"]
        source = prompt[str(value[0])]
        types = NODES.get(source.get("class_type"), ({}, {}, [], False))[2]
        if not isinstance(value[1], int) or not 0 <= value[1] < len(types):
            return [f"{where}: output {value[1]} of {source.get('class_type')} does not exist"]
        want = spec if isinstance(spec, str) else spec[0] if isinstance(spec, tuple) else None
        if types[value[1]] != want:
            return [f"{where}: return type mismatch, {types[value[1]]} where {want} is expected"]
        return []
    if spec == FILES or spec == "STRING":
        return [] if isinstance(value, str) else [f"{where}: {value!r} is not a string"]
    if isinstance(spec, list):
        return [] if value in spec else [f"{where}: value not in list: {value!r}"]
    if isinstance(spec, tuple):
        kind, limits = spec
        try:
            number = int(value) if kind == "INT" else float(value)
        except (TypeError, ValueError):
            return [f"{where}: {value!r} is not {kind}"]
        if number < limits["min"] or number > limits["max"]:
            return [f"{where}: {number} is outside [{limits['min']}, {limits['max']}]"]
        return []
    return [f"{where}: {spec} takes a link, got {value!r}"]
