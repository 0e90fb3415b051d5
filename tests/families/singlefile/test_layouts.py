"""The test files themselves are right: diffusers' own converters read them back to the tiny
model's weights. So a loader passing the other tests cannot share a mistake with the writers."""

from __future__ import annotations

import inspect

import torch
from checks import assert_same_weights
from safetensors.torch import load_file


def test_sgm_unet_and_vae_read_back_by_diffusers_from_single_file(files, sdxl_dir):
    from diffusers import AutoencoderKL, UNet2DConditionModel

    for cls, sub in ((UNet2DConditionModel, "unet"), (AutoencoderKL, "vae")):
        got = cls.from_single_file(str(files["sgm"]), config=str(sdxl_dir), subfolder=sub, local_files_only=True)
        assert_same_weights(got, cls.from_pretrained(sdxl_dir, subfolder=sub))
    got = AutoencoderKL.from_single_file(str(files["sdxl_vae"]), config=str(sdxl_dir), subfolder="vae",
                                         local_files_only=True)
    assert_same_weights(got, AutoencoderKL.from_pretrained(sdxl_dir, subfolder="vae"))


def test_flux_ae_read_back_by_diffusers_from_single_file(files, flux_dir):
    from diffusers import AutoencoderKL

    got = AutoencoderKL.from_single_file(str(files["ae"]), config=str(flux_dir), subfolder="vae",
                                         local_files_only=True)
    assert_same_weights(got, AutoencoderKL.from_pretrained(flux_dir, subfolder="vae"))


def test_sgm_open_clip_read_back_by_diffusers_converter(files, sdxl_dir):
    """diffusers' convert_open_clip_checkpoint (its q,k,v split and text_projection transpose)."""
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint
    from transformers import CLIPTextModelWithProjection

    ref = CLIPTextModelWithProjection.from_pretrained(sdxl_dir, subfolder="text_encoder_2")
    converted = convert_open_clip_checkpoint(ref, load_file(files["sgm"]), prefix="conditioner.embedders.1.model.")
    assert_same_weights(ref, converted)


def test_bfl_read_back_by_diffusers_flux_converter(files, flux_dir):
    """diffusers' convert_flux_transformer_checkpoint_to_diffusers hard-codes FLUX.1's width
    (inner_dim = 3072); run its own source with the tiny width instead."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders import single_file_utils

    ref = FluxTransformer2DModel.from_pretrained(flux_dir, subfolder="transformer")
    hidden = ref.config.num_attention_heads * ref.config.attention_head_dim
    source = inspect.getsource(single_file_utils.convert_flux_transformer_checkpoint_to_diffusers)
    assert source.count("inner_dim = 3072") == 1
    namespace = dict(vars(single_file_utils))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {hidden}"), namespace)
    convert = namespace["convert_flux_transformer_checkpoint_to_diffusers"]
    for name in ("bfl", "bfl_prefixed"):
        assert_same_weights(ref, convert(load_file(files[name])))


def test_fp8_files_hold_fp8_block_weights_only(files):
    for name in ("bfl_fp8", "bfl_scaled"):
        sd = load_file(files[name])
        fp8 = {k for k, v in sd.items() if v.dtype == torch.float8_e4m3fn}
        assert fp8, name
        assert all(k.startswith(("double_blocks.", "single_blocks.")) and k.endswith(".weight")
                   and sd[k].ndim == 2 for k in fp8 - {"scaled_fp8"})
    sd = load_file(files["bfl_scaled"])
    assert sd["single_blocks.0.linear1.scale_weight"].dtype == torch.float32
    assert {v.dtype for v in load_file(files["t5_fp8"]).values()} == {torch.float8_e4m3fn}
    assert {v.dtype for v in load_file(files["t5"]).values()} == {torch.float16}
