"""Every image family's ComfyUI workflow passes ComfyUI's validate_prompt (reimplemented in
comfy_nodes from ComfyUI's node definitions): known nodes, every required input, links of the right
type, values within their limits, an output node. And the check can fail."""

from __future__ import annotations

import copy

import pytest

from comfy_nodes import validate_prompt
from imglora.export.workflows import to_api
from imglora.family import Exportable, supports
from imglora.families import registry

IMAGE_FAMILIES = [n for n in registry.names() if supports(registry.get(n), Exportable) and n != "llm"]


@pytest.mark.parametrize("with_clip", [False, True])
@pytest.mark.parametrize("name", IMAGE_FAMILIES)
def test_the_workflow_passes_comfyuis_validation(name: str, with_clip: bool) -> None:
    family = registry.get(name)
    api = to_api(family.comfyui_nodes("mine.safetensors", "a photo of sks toy", "", 7, "imglora/mine", with_clip))
    assert validate_prompt(api) == [], validate_prompt(api)
    assert any(n["class_type"] == "SaveImage" for n in api.values())
    lora = [n for n in api.values() if n["class_type"].startswith("LoraLoader")]
    assert len(lora) == 1 and lora[0]["inputs"]["lora_name"] == "mine.safetensors"


def test_the_validation_finds_what_comfyui_would_refuse() -> None:
    api = to_api(registry.get("flux").comfyui_nodes("mine.safetensors", "a", "", 7, "x", False))
    sampler = next(k for k, n in api.items() if n["class_type"] == "KSampler")
    decode = next(k for k, n in api.items() if n["class_type"] == "VAEDecode")
    broken = copy.deepcopy(api)
    del broken[sampler]["inputs"]["positive"]
    broken[sampler]["inputs"]["sampler_name"] = "euler_a"
    broken[sampler]["inputs"]["cfg"] = 200.0
    broken[decode]["inputs"]["vae"] = [sampler, 0]  # a LATENT where a VAE goes
    errors = validate_prompt(broken)
    assert any("required input 'positive' is missing" in e for e in errors)
    assert any("value not in list: 'euler_a'" in e for e in errors)
    assert any("200.0 is outside [0.0, 100.0]" in e for e in errors)
    assert any("return type mismatch, LATENT where VAE is expected" in e for e in errors)
    assert validate_prompt({k: v for k, v in api.items() if v["class_type"] != "SaveImage"}) == ["prompt has no outputs"]
