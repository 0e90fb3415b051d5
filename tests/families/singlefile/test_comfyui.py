"""Bare file names resolved in a ComfyUI folder as ComfyUI resolves them."""

from __future__ import annotations

import pytest
import torch
from checks import assert_same_weights
from layouts import make_comfyui_tree

from imglora.errors import ModelSourceError
from imglora.models.comfyui import find_model_file, model_folders, tokenizer_dirs
from imglora.families.flux.singlefile import load_flux_transformer
from imglora.families._shared.singlefile.inspect import describe


@pytest.fixture()
def comfy(tmp_path, files, flux_dir):
    """A ComfyUI folder with FLUX in the legacy folders (models/unet, models/clip) and SDXL in
    checkpoints, plus a shared model folder outside it named in extra_model_paths.yaml."""
    shared = tmp_path / "shared_models"
    root = make_comfyui_tree(tmp_path / "ComfyUI", {
        "models/unet/flux1-dev.safetensors": files["bfl"],
        "models/clip/clip_l.safetensors": files["clip_l"],
        "models/clip/t5xxl_fp16.safetensors": files["t5"],
        "models/vae/flux/ae.safetensors": files["ae"],
        "models/checkpoints/sd_xl_base_1.0.safetensors": files["sgm"],
        # the same name in two built-in folders: models/unet is searched first
        "models/diffusion_models/flux1-dev.safetensors": files["bfl_fp8"],
        "../shared_models/te/t5xxl_fp8_e4m3fn.safetensors": files["t5_fp8"],
        "../shared_models/te2/clip_l.safetensors": files["sdxl_vae"],  # shadowed by models/clip (not default)
        "../shared_models/ckpt/sd_xl_base_1.0.safetensors": files["sgm_vpred"],  # default: wins
        "../shared_models/unet/only_here.safetensors": files["bfl_prefixed"],
    }, extra_yaml={
        "shared": {"base_path": "../shared_models", "text_encoders": "te\nte2\n",
                   "unet": "unet"},  # legacy key name
        "fast_disk": {"base_path": str(shared), "is_default": True, "checkpoints": "ckpt"},
        "empty_section": None,
    }, tokenizers_from=flux_dir)
    return root


def test_legacy_folders_and_their_order(comfy, files):
    assert find_model_file(comfy, "diffusion_models", "flux1-dev.safetensors") == \
        comfy / "models" / "unet" / "flux1-dev.safetensors"
    assert describe(find_model_file(comfy, "unet", "flux1-dev.safetensors")).fp8 is False
    assert find_model_file(comfy, "clip", "t5xxl_fp16.safetensors") == comfy / "models" / "clip" / "t5xxl_fp16.safetensors"
    assert find_model_file(comfy, "text_encoders", "clip_l.safetensors") == comfy / "models" / "clip" / "clip_l.safetensors"
    assert find_model_file(comfy, "vae", "flux/ae.safetensors") == comfy / "models" / "vae" / "flux" / "ae.safetensors"


def test_extra_model_paths_yaml(comfy, tmp_path):
    shared = tmp_path / "shared_models"
    assert model_folders(comfy, "text_encoders") == [comfy / "models" / "text_encoders", comfy / "models" / "clip",
                                                     shared / "te", shared / "te2"]
    assert model_folders(comfy, "checkpoints") == [shared / "ckpt", comfy / "models" / "checkpoints"]
    assert model_folders(comfy, "diffusion_models")[-1] == shared / "unet"
    assert find_model_file(comfy, "text_encoders", "t5xxl_fp8_e4m3fn.safetensors") == shared / "te" / "t5xxl_fp8_e4m3fn.safetensors"
    assert find_model_file(comfy, "checkpoints", "sd_xl_base_1.0.safetensors") == shared / "ckpt" / "sd_xl_base_1.0.safetensors"
    assert find_model_file(comfy, "unet", "only_here.safetensors") == shared / "unet" / "only_here.safetensors"


def test_portable_layout_and_names_that_climb_out(comfy, tmp_path):
    assert find_model_file(tmp_path, "vae", "flux/ae.safetensors") == comfy / "models" / "vae" / "flux" / "ae.safetensors"
    (comfy / "models" / "secret.safetensors").write_bytes(b"x")
    with pytest.raises(ModelSourceError):
        find_model_file(comfy, "vae", "../secret.safetensors")
    with pytest.raises(ModelSourceError, match="not a ComfyUI folder"):
        find_model_file(tmp_path / "shared_models", "vae", "ae.safetensors")
    with pytest.raises(ModelSourceError, match="unknown ComfyUI model folder 'upscale'"):
        find_model_file(comfy, "upscale", "x.safetensors")


def test_not_found_names_every_folder_searched(comfy, tmp_path):
    with pytest.raises(ModelSourceError) as exc:
        find_model_file(comfy, "clip", "t5xxl_fp16_typo.safetensors")
    message = str(exc.value)
    for folder in model_folders(comfy, "text_encoders"):
        assert str(folder) in message
    assert "text_encoders folders" in message and "t5xxl_fp16.safetensors" in message  # what is there


def test_bad_yaml_is_named(comfy):
    (comfy / "extra_model_paths.yaml").write_text("shared: [unclosed\n")
    with pytest.raises(ModelSourceError, match="extra_model_paths.yaml is not valid YAML"):
        find_model_file(comfy, "vae", "flux/ae.safetensors")


def test_shipped_tokenizers_load_offline_and_match(comfy, flux_dir):
    from transformers import CLIPTokenizer, T5TokenizerFast

    dirs = tokenizer_dirs(comfy)
    assert dirs == {"clip": comfy / "comfy" / "sd1_tokenizer", "t5": comfy / "comfy" / "text_encoders" / "t5_tokenizer"}
    clip = CLIPTokenizer.from_pretrained(dirs["clip"], model_max_length=77)
    t5 = T5TokenizerFast.from_pretrained(dirs["t5"])
    text = "a photo of sks toy"
    assert clip(text).input_ids == CLIPTokenizer.from_pretrained(flux_dir / "tokenizer")(text).input_ids
    assert t5(text).input_ids == T5TokenizerFast.from_pretrained(flux_dir / "tokenizer_2")(text).input_ids
    (dirs["t5"] / "tokenizer.json").unlink()
    with pytest.raises(ModelSourceError, match="t5_tokenizer/tokenizer.json"):
        tokenizer_dirs(comfy)


def test_found_file_loads(comfy, flux_dir):
    from diffusers import FluxTransformer2DModel

    path = find_model_file(comfy, "diffusion_models", "flux1-dev.safetensors")
    got = load_flux_transformer(path, flux_dir, dtype=torch.float32)  # config from the diffusers folder
    assert_same_weights(got, FluxTransformer2DModel.from_pretrained(flux_dir, subfolder="transformer"))


@pytest.mark.parametrize("broken, said", [("yaml", "extra_model_paths.yaml is not valid YAML"),
                                          ("folder", "is not a ComfyUI folder")])
def test_a_broken_comfyui_folder_is_said_once(comfy, tmp_path, broken, said):
    """A bare name is looked up in several folder kinds (diffusion_models, then checkpoints); a fault
    of the ComfyUI folder itself is the same for each and is said once, not once per kind."""
    from imglora.config import ModelConfig
    from imglora.families import registry
    from imglora.models.resolve import resolve_model

    root = comfy
    if broken == "yaml":
        (comfy / "extra_model_paths.yaml").write_text("shared: [unclosed\n")
    else:
        root = tmp_path / "not_comfy"
        root.mkdir()
    with pytest.raises(ModelSourceError) as exc:
        resolve_model(ModelConfig(family="flux", path="flux1-dev.safetensors", comfyui=str(root)), registry.get("flux"))
    message = str(exc.value)
    assert message.count(said) == 1 and "\n" not in message, message  # once, on one line
    assert message.count(str(root)) == 1 if broken == "folder" else message.count("extra_model_paths.yaml") == 1
