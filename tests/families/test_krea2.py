"""Krea 2: captions cached as Krea2Pipeline encodes them (Qwen3-VL's twelve tapped layers in Qwen-Image's
template, the prefix dropped; the cache keeps the real tokens, which the pipeline's padding and mask
leave as they are), latents as the training scripts normalise Qwen-Image's VAE's, the loss as a
reimplementation of the pipeline's step on its own padded layout; captions of other lengths in one
batch; the swap count; the ComfyUI workflow; every adapter type's export under ComfyUI's Krea 2 map
(``comfy/utils.py::krea2_to_diffusers``, reimplemented below); a run that resumes exactly and whose
evaluation at strength 0 is the pipeline's own image."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import comfy_math as comfy
from comfy_nodes import validate_prompt
from imglora.adapters import inject as lora
from imglora.commands.export import export as export_run
from imglora.errors import ImgloraError
from imglora.families import registry
from imglora.families._shared import flow_matching
from imglora.families.krea2 import model as k2
from imglora.models.resolve import resolve_model
from imglora.util.owned import own_module
from loading import load_tiny
import family_runs as fr
from resume_exact import assert_resumes_exactly

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-krea2.toml"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, sample_dataset: Path):
    return fr.prepared(tmp_path_factory.mktemp("k2-prepared"), sample_dataset, PRESET, "krea2")


@pytest.fixture(scope="module")
def pipe(prepared):
    from diffusers import Krea2Pipeline

    return fr.owned(Krea2Pipeline.from_pretrained(prepared[2].root))


def test_captions_are_the_pipelines_real_tokens_and_latents_the_training_scripts(prepared, pipe) -> None:
    cfg, family, src, entries = prepared
    encoders = (pipe.tokenizer, pipe.text_encoder)
    assert pipe.prompt_template_encode_prefix == k2.PREFIX and pipe.prompt_template_encode_suffix == k2.SUFFIX
    assert len(pipe.tokenizer(k2.PREFIX).input_ids) == k2.PREFIX_TOKENS == pipe.prompt_template_encode_start_idx
    assert tuple(pipe.text_encoder_select_layers) == k2.LAYERS
    for caption in ("a photo of sks toy on a wooden table", ""):
        with torch.no_grad():
            want, mask = pipe.get_text_hidden_states(caption, max_sequence_length=64, device=torch.device("cpu"))
        got = family.encode_text(encoders, caption, 64)["prompt_embeds"]
        # The pipeline's real tokens (the mask) are ours; its padding is masked everywhere downstream. The
        # same sums over the real tokens in sequences of other lengths (float32 rounding: 1e-5).
        assert got.shape == (int(mask.sum()), 12, 16)
        torch.testing.assert_close(got, want[0][mask[0]], rtol=1e-5, atol=1e-6)
    n = family.count_tokens(encoders, "a photo of sks toy", 64)["Qwen3-VL"][0]
    assert n == family.encode_text(encoders, "a photo of sks toy", 64)["prompt_embeds"].shape[0]

    pixels = torch.rand(1, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():
        want = (vae.encode(pixels[:, :, None]).latent_dist.mode() - mean) / std
    got = family.encode_image(vae, pixels)["latents"]
    assert got.shape == (16, 8, 6) and torch.equal(got, want[0, :, 0])


def test_the_loss_is_the_pipelines_step_on_its_padded_layout(prepared, pipe, monkeypatch) -> None:
    cfg, family, src, entries = prepared
    trainable = load_tiny(family, src, cfg)
    entry = entries[0]
    lat = entry["latents"][None]
    _, c, h, w = lat.shape
    x0 = pipe._pack_latents(lat, 1, c, h, w)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.6])
    assert cfg.family.timestep_sampling == "shift" and cfg.family.resolution_dependent_shift
    mu = 0.5 + 0.65 * (x0.shape[1] - 256) / (6400 - 256)  # the pipeline's calculate_shift over its scheduler config
    e_mu = torch.exp(torch.tensor(mu, dtype=torch.float64))
    sig = (e_mu / (e_mu + (1 / sigma.double() - 1))).float()
    # The pipeline's text layout: padded to a fixed length with a mask (here 40 rows).
    real = entry["prompt_embeds"]
    padded = torch.cat([real, torch.randn(40 - real.shape[0], *real.shape[1:])])[None]  # padding's values unseen
    mask = (torch.arange(40) < real.shape[0])[None]
    with torch.no_grad():
        pred = trainable.model(hidden_states=(1 - sig) * x0 + sig * noise, encoder_hidden_states=padded, timestep=sig,
                               position_ids=pipe.prepare_position_ids(40, h // 2, w // 2, torch.device("cpu")),
                               encoder_attention_mask=mask, return_dict=False)[0]
        want = torch.nn.functional.mse_loss(pred, noise - x0)
        monkeypatch.setattr(flow_matching, "draws", lambda g: fr.Fixed(noise, sigma))
        got = trainable.loss({k: v[None] for k, v in entry.items()}, torch.Generator())
    # Masked keys against fewer keys: the same softmax sums in another order (float32: 1e-5).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_blocks_to_swap_counts_blocks_and_the_workflow_is_comfy_orgs(prepared) -> None:
    from imglora.export.workflows import to_api

    cfg, family, src, _ = prepared
    counts = family.block_counts(src)
    assert counts == [3] and family.swap_counts(counts, family.with_blocks_to_swap(cfg, 2)) == [2]
    with pytest.raises(ImgloraError, match=r"memory.blocks_to_swap = 4, but Krea 2 has only 3 blocks; .* 3$"):
        family.swap_counts(counts, family.with_blocks_to_swap(cfg, 4))
    assert k2.block_counts(k2.CONFIGS) == [28]
    api = to_api(family.comfyui_nodes("mine.safetensors", "a photo of sks toy", "", 7, "imglora/mine", False))
    assert validate_prompt(api) == []
    by_type = {v["class_type"]: v["inputs"] for v in api.values()}
    assert by_type["CLIPLoader"] == {"clip_name": "qwen3vl_4b_fp8_scaled.safetensors", "type": "krea2"}
    k = by_type["KSampler"]
    assert (k["steps"], k["cfg"], k["sampler_name"], k["scheduler"]) == (28, 5.5, "euler", "simple")


# ---------------------------------------------------------------------------------------------
# ComfyUI's Krea 2 LoRA key map (comfy/lora.py's Krea2 branch over comfy/utils.py krea2_to_diffusers),
# reimplemented from ComfyUI's source (2026)
# ---------------------------------------------------------------------------------------------

KREA2_BLOCK = {"attn.to_q": "attn.wq", "attn.to_k": "attn.wk", "attn.to_v": "attn.wv", "attn.to_gate": "attn.gate",
               "attn.to_out.0": "attn.wo", "attn.to_out": "attn.wo", "ff.gate": "mlp.gate", "ff.up": "mlp.up",
               "ff.down": "mlp.down"}


def krea2_to_diffusers(config: dict, output_prefix: str = "") -> dict:
    key_map = {}
    blocks = [(f"transformer_blocks.{i}", f"blocks.{i}") for i in range(config["num_layers"])]
    blocks += [(f"text_fusion.layerwise_blocks.{i}", f"txtfusion.layerwise_blocks.{i}") for i in range(2)]
    blocks += [(f"text_fusion.refiner_blocks.{i}", f"txtfusion.refiner_blocks.{i}") for i in range(2)]
    for d_from, c_to in blocks:
        for d, c in KREA2_BLOCK.items():
            key_map[f"{d_from}.{d}.weight"] = f"{output_prefix}{c_to}.{c}.weight"
    for d, c in (("img_in", "first"), ("time_embed.linear_1", "tmlp.0"), ("time_embed.linear_2", "tmlp.2"),
                 ("time_mod_proj", "tproj.1"), ("txt_in.linear_1", "txtmlp.1"), ("txt_in.linear_2", "txtmlp.3"),
                 ("text_fusion.projector", "txtfusion.projector"), ("final_layer.linear", "last.linear")):
        key_map[f"{d}.weight"] = f"{output_prefix}{c}.weight"
    return key_map


def krea2_lora_keys(config: dict) -> dict:
    out = {}
    for k, to in krea2_to_diffusers(config, "diffusion_model.").items():
        d = k[:-len(".weight")]
        for form in (f"diffusion_model.{d}", f"transformer.{d}", "lycoris_" + d.replace(".", "_"), d):
            out[form] = to
    return out


def base_transformer():
    from diffusers import Krea2Transformer2DModel

    return Krea2Transformer2DModel.from_pretrained(resolve_model("tiny:krea2", registry.get("krea2")).root,
                                                   subfolder="transformer").eval()


@pytest.fixture(scope="module")
def typed_runs(tmp_path_factory, sample_dataset):
    return fr.typed_runs(tmp_path_factory, sample_dataset, PRESET, "k2")


@pytest.mark.parametrize("kind", ["lokr", pytest.param("lora", marks=pytest.mark.slow),
                                  pytest.param("dora", marks=pytest.mark.slow), pytest.param("loha", marks=pytest.mark.slow),
                                  pytest.param("oft", marks=pytest.mark.slow)])
def test_every_key_maps_in_comfyui_and_patches_the_weights_as_trained(typed_runs, kind, tmp_path) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    cfg, run = typed_runs(kind)
    sd = load_file(str(export_run(run, out=tmp_path / "k.safetensors", dtype="fp32").path))
    assert sd and all(k.startswith("transformer.transformer_blocks.") for k in sd)
    base = base_transformer()
    keys = krea2_lora_keys(dict(base.config))
    patches, not_loaded = comfy.load_lora(sd, keys)
    assert not_loaded == set(), sorted(not_loaded)[:5]
    model = base_transformer()
    family = registry.get("krea2")
    lora.inject(model, family, cfg.lora, seed=0)
    lora.load_adapter_state(model, family.read_adapter(run / "adapter"))
    base_sd = base.state_dict()
    assert {f"transformer.{n}" for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)} == set(patches)
    for name, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            layer = copy.deepcopy(m)
            layer.merge(safe_merge=True)
            want = layer.get_base_layer().weight.detach()
            got = comfy.calculate_weight(patches[f"transformer.{name}"], base_sd[f"{name}.weight"], name)
            assert patches[f"transformer.{name}"].error is None
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
            assert not torch.equal(got, base_sd[f"{name}.weight"])
    with safe_open(str(tmp_path / "k.safetensors"), framework="pt") as fh:
        assert fh.metadata()["ss_base_model_version"] == "krea2"


@pytest.fixture(scope="module")
def k2_run(tmp_path_factory, sample_dataset):
    cfg, result = fr.four_update_run(tmp_path_factory.mktemp("k2-run"), sample_dataset, PRESET)
    assert cfg.memory.fp8 and cfg.memory.blocks_to_swap == 1
    return cfg, result


def test_a_resumed_run_ends_exactly_as_an_uninterrupted_one(k2_run, tmp_path: Path) -> None:
    cfg, result = k2_run
    assert len(assert_resumes_exactly(cfg, result, tmp_path)) == 4


@pytest.mark.slow  # (the default run keeps under 6 minutes; CI runs it)
def test_eval_at_strength_0_is_the_pipeline_with_guidance(k2_run) -> None:
    import numpy as np
    from diffusers import Krea2Pipeline
    from PIL import Image

    from imglora.commands.evaluate import evaluate

    cfg, _ = k2_run
    result = evaluate(cfg.run_dir, overrides=['eval.fp8="off"', "eval.blocks_to_swap=0"], out=lambda s: None)
    (step,) = result.images
    family = registry.get("krea2")
    prompt = family.default_prompts(cfg)[0]
    pipe = Krea2Pipeline.from_pretrained(resolve_model("tiny:krea2", family).root)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            own_module(component)
    pipe.set_progress_bar_config(disable=True)
    side = cfg.data.resolution
    base = pipe(prompt=prompt, negative_prompt="", guidance_scale=4.5, height=side, width=side, num_inference_steps=2,
                max_sequence_length=cfg.cache.text_max_length, generator=torch.Generator().manual_seed(0)).images[0]
    got = [np.asarray(Image.open(p).convert("RGB")) for p in result.images[step][0]]
    assert got[0].shape == (side, side, 3)
    # the pipeline pads both prompts to max_sequence_length, imglora to the longer of the two (masked
    # either way): the same image up to float32 rounding, a few levels of 255 at most
    assert np.abs(got[0].astype(int) - np.asarray(base).astype(int)).max() <= 2
    assert np.abs(got[1].astype(int) - np.asarray(base).astype(int)).max() > 2  # the adapter at strength 1
