"""load_clip_l / load_t5 / load_flux_vae on ComfyUI-style files written from the tiny FLUX model."""

from __future__ import annotations

import copy

import pytest
import torch
from checks import assert_same_output, assert_same_weights, owned
from safetensors.torch import load_file, save_file

from imglora.errors import ModelSourceError
from imglora.families._shared.singlefile.text import load_clip_l, load_flux_vae, load_t5

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def pipe(flux_dir):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(flux_dir)


def test_clip_l_equals_the_folder_and_runs_identically(files, flux_dir, pipe):
    from transformers import CLIPTextConfig

    for config in (flux_dir, flux_dir / "text_encoder", CLIPTextConfig.from_pretrained(flux_dir / "text_encoder"),
                   pipe.text_encoder.config.to_dict()):
        got = load_clip_l(files["clip_l"], config, torch.float32)
        assert_same_weights(got, pipe.text_encoder)
    ids = pipe.tokenizer(["a photo of sks toy"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    mine = owned(copy.deepcopy(pipe.text_encoder))
    with torch.no_grad():
        assert_same_output(got(ids).pooler_output, pipe.text_encoder(ids).pooler_output, mine(ids).pooler_output)


def test_clip_l_with_projection_or_flat_keys(files, flux_dir, pipe, tmp_path):
    """Tolerated variants: an extra text_projection / logit_scale, keys saved by transformers 5
    without ``text_model.``."""
    sd = load_file(files["clip_l"])
    save_file({**sd, "text_projection.weight": torch.eye(32), "logit_scale": torch.tensor(4.6)},
              tmp_path / "clip_l_proj.safetensors")
    save_file({k.removeprefix("text_model."): v for k, v in sd.items()}, tmp_path / "clip_l_flat.safetensors")
    for name in ("clip_l_proj", "clip_l_flat"):
        assert_same_weights(load_clip_l(tmp_path / f"{name}.safetensors", flux_dir, torch.float32), pipe.text_encoder)


def test_t5_fp16_file(files, flux_dir, pipe):
    from transformers import T5EncoderModel

    got = load_t5(files["t5"], flux_dir, torch.float16)
    # transformers' rule for fp16 T5 (_keep_in_fp32_modules): the wo projections stay float32
    want = T5EncoderModel.from_pretrained(flux_dir, subfolder="text_encoder_2", dtype=torch.float16)
    assert {k: v.dtype for k, v in got.state_dict().items()} == {k: v.dtype for k, v in want.state_dict().items()}
    assert got.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    half = {k: v.half() for k, v in pipe.text_encoder_2.state_dict().items()}
    assert_same_weights(got, {k: v.float() if ".wo." in k else v for k, v in half.items()})
    assert got.encoder.embed_tokens.weight is got.shared.weight
    got32 = load_t5(files["t5"], flux_dir / "text_encoder_2", torch.float32)
    assert_same_weights(got32, {k: v.float() for k, v in half.items()})


def test_t5_fp8_equals_the_fp8_rounded_weights(files, flux_dir, pipe):
    got = load_t5(files["t5_fp8"], flux_dir, torch.bfloat16)
    want = {k: v.to(FP8).to(torch.bfloat16) for k, v in pipe.text_encoder_2.state_dict().items()}
    assert_same_weights(got, want)
    assert got.encoder.embed_tokens.weight is got.shared.weight
    ids = pipe.tokenizer_2(["a photo of sks toy"], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(got(ids).last_hidden_state).all()


def test_t5_tied_embedding_under_flux_config(files, flux_dir, tmp_path):
    """FLUX's T5 config says tie_word_embeddings=false; the encoder must still use the embedding."""
    from transformers import T5Config

    config = T5Config.from_pretrained(flux_dir / "text_encoder_2", tie_word_embeddings=False)
    sd = load_file(files["t5"])
    del sd["encoder.embed_tokens.weight"]
    # extra tensors some ComfyUI text-encoder files carry (a tokenizer blob, a logit scale) are skipped
    extra = {"spiece_model": torch.zeros(16, dtype=torch.uint8), "logit_scale": torch.tensor(4.6)}
    save_file({**sd, **extra}, tmp_path / "t5_shared_only.safetensors")
    got = load_t5(tmp_path / "t5_shared_only.safetensors", config, torch.float32)
    assert got.encoder.embed_tokens.weight is got.shared.weight
    assert torch.equal(got.shared.weight, sd["shared.weight"].float())


def test_flux_ae_equals_the_folder(files, flux_dir, pipe):
    got = load_flux_vae(files["ae"], flux_dir, torch.float32)
    assert_same_weights(got, pipe.vae)
    assert got.config.scaling_factor == pytest.approx(0.3611) and got.config.shift_factor == pytest.approx(0.1159)
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    mine = owned(copy.deepcopy(pipe.vae))
    with torch.no_grad():
        assert_same_output(got.encode(x).latent_dist.mean, pipe.vae.encode(x).latent_dist.mean,
                           mine.encode(x).latent_dist.mean)


def test_parts_of_a_comfyui_flux_checkpoint(files, flux_dir, pipe, tmp_path):
    """A full ComfyUI checkpoint keeps them under vae. and text_encoders.*.transformer."""
    full = {f"model.diffusion_model.{k}": v for k, v in load_file(files["bfl"]).items()}
    full |= {f"vae.{k}": v for k, v in load_file(files["ae"]).items()}
    full |= {f"text_encoders.clip_l.transformer.{k}": v for k, v in load_file(files["clip_l"]).items()}
    full |= {f"text_encoders.t5xxl.transformer.{k}": v for k, v in load_file(files["t5"]).items()}
    full["text_encoders.clip_l.logit_scale"] = torch.tensor(4.6)
    path = tmp_path / "flux1-dev-full.safetensors"
    save_file(full, path)
    assert_same_weights(load_flux_vae(path, flux_dir, torch.float32), pipe.vae)
    assert_same_weights(load_clip_l(path, flux_dir, torch.float32), pipe.text_encoder)
    assert_same_weights(load_t5(path, flux_dir, torch.float32),
                        {k: v.half().float() for k, v in pipe.text_encoder_2.state_dict().items()})
    with pytest.raises(ModelSourceError, match="without a vae.*give the separate vae file"):
        load_flux_vae(files["bfl"], flux_dir, torch.float32)


def test_wrong_files_are_named(files, flux_dir):
    with pytest.raises(ModelSourceError, match="is not a T5-XXL text encoder"):
        load_t5(files["clip_l"], flux_dir, torch.float32)
    with pytest.raises(ModelSourceError, match="is not a FLUX VAE.*vae-sdxl"):
        load_flux_vae(files["sdxl_vae"], flux_dir, torch.float32)
    with pytest.raises(ModelSourceError, match="no CLIPTextConfig"):
        load_clip_l(files["clip_l"], flux_dir / "nothing_here", torch.float32)
