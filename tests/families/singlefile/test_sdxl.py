"""load_sdxl / prediction_type on SGM files written from the tiny SDXL model."""

from __future__ import annotations

import pytest
import torch
import copy

from checks import assert_same_output, assert_same_weights, owned
from safetensors.torch import load_file, save_file

from imglora.errors import ModelSourceError
from imglora.families.sdxl.singlefile import load_sdxl, prediction_type, zero_terminal_snr
from imglora.families._shared.singlefile.text import load_clip_l


@pytest.fixture(scope="module")
def pipe(sdxl_dir):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(sdxl_dir)


@pytest.fixture(scope="module")
def loaded(files, sdxl_dir):
    return load_sdxl(files["sgm"], sdxl_dir, dtype=torch.float32)


def test_every_part_equals_the_diffusers_folder(loaded, pipe):
    assert list(loaded) == ["unet", "vae", "text_encoder", "text_encoder_2"]
    for name, module in loaded.items():
        assert type(module) is type(getattr(pipe, name))
        assert_same_weights(module, getattr(pipe, name))
        assert not module.training


def test_unet_forward_is_identical(loaded, pipe):
    g = torch.Generator().manual_seed(0)
    cfg = pipe.unet.config
    sample = torch.randn(1, cfg.in_channels, 16, 16, generator=g)
    context = torch.randn(1, 7, cfg.cross_attention_dim, generator=g)
    pooled = torch.randn(1, pipe.text_encoder_2.config.projection_dim, generator=g)
    cond = {"text_embeds": pooled, "time_ids": torch.tensor([[16.0, 16.0, 0.0, 0.0, 16.0, 16.0]])}
    mine = owned(copy.deepcopy(pipe.unet))
    with torch.no_grad():
        raw = pipe.unet(sample, 500, context, added_cond_kwargs=cond).sample
        want = mine(sample, 500, context, added_cond_kwargs=cond).sample
        got = loaded["unet"](sample, 500, context, added_cond_kwargs=cond).sample
    assert_same_output(got, raw, want)


def test_text_encoders_give_identical_outputs(loaded, pipe):
    ids = pipe.tokenizer(["a photo of sks toy"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    te1, te2 = (owned(copy.deepcopy(e)) for e in (pipe.text_encoder, pipe.text_encoder_2))
    with torch.no_grad():
        assert_same_output(loaded["text_encoder"](ids).last_hidden_state, pipe.text_encoder(ids).last_hidden_state,
                           te1(ids).last_hidden_state)
        assert_same_output(loaded["text_encoder_2"](ids).text_embeds, pipe.text_encoder_2(ids).text_embeds,
                           te2(ids).text_embeds)


def test_agrees_with_diffusers_from_single_file(files, sdxl_dir, loaded):
    from diffusers import AutoencoderKL, UNet2DConditionModel

    for cls, sub in ((UNet2DConditionModel, "unet"), (AutoencoderKL, "vae")):
        theirs = cls.from_single_file(str(files["sgm"]), config=str(sdxl_dir), subfolder=sub, local_files_only=True)
        assert_same_weights(loaded[sub], theirs)


def test_separate_vae_subsets_and_dtype(files, sdxl_dir, pipe):
    got = load_sdxl(files["sgm_novae"], sdxl_dir, dtype=torch.float16, vae_path=files["sdxl_vae"],
                    parts=("vae", "text_encoder"))
    assert list(got) == ["vae", "text_encoder"]
    assert_same_weights(got["vae"], {k: v.half() for k, v in pipe.vae.state_dict().items()})
    assert got["text_encoder"].dtype == torch.float16
    with pytest.raises(ModelSourceError, match="has no vae.*pass vae_path"):
        load_sdxl(files["sgm_novae"], sdxl_dir, dtype=torch.float32, parts=("vae",))
    with pytest.raises(ValueError, match="unknown SDXL parts"):
        load_sdxl(files["sgm"], sdxl_dir, dtype=torch.float32, parts=("unet", "tokenizer"))


def test_clip_l_loader_reads_the_sgm_copy(files, sdxl_dir, pipe):
    assert_same_weights(load_clip_l(files["sgm"], sdxl_dir, torch.float32), pipe.text_encoder)


def test_bare_ldm_unet_file(files, sdxl_dir, pipe, tmp_path):
    """An SDXL UNet saved without prefix (e.g. into ComfyUI's diffusion_models folder)."""
    p = "model.diffusion_model."
    bare = {k[len(p):]: v for k, v in load_file(files["sgm"]).items() if k.startswith(p)}
    save_file(bare, tmp_path / "sdxl_unet.safetensors")
    got = load_sdxl(tmp_path / "sdxl_unet.safetensors", sdxl_dir, dtype=torch.float32, parts=("unet",))
    assert_same_weights(got["unet"], pipe.unet)
    with pytest.raises(ModelSourceError, match="has no text_encoder.*full SDXL checkpoint"):
        load_sdxl(tmp_path / "sdxl_unet.safetensors", sdxl_dir, dtype=torch.float32, parts=("text_encoder",))


def test_a_missing_weight_is_named(files, sdxl_dir, tmp_path):
    sd = load_file(files["sgm"])
    del sd["model.diffusion_model.out.2.weight"]
    del sd["conditioner.embedders.1.model.transformer.resblocks.1.ln_2.bias"]
    save_file(sd, tmp_path / "damaged.safetensors")
    with pytest.raises(ModelSourceError, match=r"damaged.safetensors: the UNet does not fit .*1 missing: conv_out.weight"):
        load_sdxl(tmp_path / "damaged.safetensors", sdxl_dir, dtype=torch.float32, parts=("unet",))
    with pytest.raises(ModelSourceError, match=r"OpenCLIP bigG .*1 missing: text_model.encoder.layers.1.layer_norm2.bias"):
        load_sdxl(tmp_path / "damaged.safetensors", sdxl_dir, dtype=torch.float32, parts=("text_encoder_2",))


def test_prediction_type_from_keys_and_metadata(files, tmp_path):
    assert prediction_type(files["sgm"]) == "epsilon"
    assert prediction_type(files["sgm_vpred"]) == "v_prediction"
    assert not zero_terminal_snr(files["sgm_vpred"])
    base = {"model.diffusion_model.out.2.bias": torch.zeros(4)}
    cases = [({"edm_vpred.sigma_max": torch.tensor(120.0)}, None, "v_prediction"),
             ({"ztsnr": torch.tensor([]), "v_pred": torch.tensor([])}, None, "v_prediction"),
             ({}, {"modelspec.prediction_type": "v"}, "v_prediction"),  # kohya
             ({}, {"modelspec.predict_key": "v"}, "v_prediction"),  # ComfyUI
             ({}, {"modelspec.prediction_type": "epsilon"}, "epsilon"),
             ({}, {"format": "pt"}, "epsilon")]
    for i, (extra, meta, want) in enumerate(cases):
        path = tmp_path / f"case{i}.safetensors"
        save_file({**base, **extra}, path, metadata=meta)
        assert prediction_type(path) == want, (extra, meta)
    assert zero_terminal_snr(tmp_path / "case1.safetensors")
