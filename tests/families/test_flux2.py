"""FLUX.2: captions cached as Flux2KleinPipeline encodes them (Qwen3 in its chat template with
thinking off, padded, layers 9, 18 and 27 side by side), latents as the pipeline's _encode_vae_image
(2×2 patches, batch-norm statistics), the loss as a reimplementation of the pipeline's noising and
step with its own packing and position ids (and [dev]'s guidance 1.0); the swap count; both ComfyUI
workflows; every adapter type's export under ComfyUI's FLUX map for FLUX.2
(``comfy/utils.py::flux_to_diffusers``, reimplemented below); a run that resumes exactly and whose
evaluation at strength 0 is the pipeline's own image."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import comfy_math as comfy
from comfy_nodes import validate_prompt
from imglora.adapters import inject as lora
from imglora.commands.export import export as export_run
from imglora.errors import ImgloraError, ModelSourceError
from imglora.families import registry
from imglora.families._shared import flow_matching
from imglora.families.flux2 import model as f2
from imglora.models.resolve import resolve_model
from imglora.util.owned import own_module
from imglora.memory.wrap import resolve_swap
from loading import load_tiny
import family_runs as fr
from resume_exact import assert_resumes_exactly

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-flux2.toml"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, sample_dataset: Path):
    return fr.prepared(tmp_path_factory.mktemp("f2-prepared"), sample_dataset, PRESET, "flux2")


@pytest.fixture(scope="module")
def pipe(prepared):
    from diffusers import Flux2KleinPipeline

    return fr.owned(Flux2KleinPipeline.from_pretrained(prepared[2].root))


def test_captions_are_the_pipelines_states_and_latents_its_normalised_patches(prepared, pipe) -> None:
    cfg, family, src, entries = prepared
    encoders = family.load_text_encoders(src, torch.device("cpu"), torch.float32)
    assert encoders[2] == "klein"
    for caption in ("a photo of sks toy on a wooden table", ""):
        want = pipe._get_qwen3_prompt_embeds(pipe.text_encoder, pipe.tokenizer, caption, max_sequence_length=48)[0]
        got = family.encode_text(encoders, caption, 48)["prompt_embeds"]
        # The same tokens through the same encoder with the same padding (one prompt each time).
        assert got.shape == (48, 3 * 16) and torch.equal(got, want)
    assert f2.KLEIN_TEMPLATE == pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": "{}"}], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    n = len(pipe.tokenizer(f2.KLEIN_TEMPLATE.format("a photo of sks toy")).input_ids)
    assert family.count_tokens(encoders, "a photo of sks toy", 48) == {"Qwen3": (n, 48)}

    pixels = torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        want = pipe._encode_vae_image(pixels, generator=None)
    got = family.encode_image(pipe.vae, pixels)["latents"]
    assert got.shape == (128, 4, 6) and torch.equal(got, want[0])


def reference_loss(pipe, transformer, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor,
                   text: torch.Tensor, guidance: torch.Tensor | None = None) -> torch.Tensor:
    """Flux2KleinPipeline's step as a training loss (diffusers' train_dreambooth_lora_flux2_klein.py):
    the packed ``x_σ = (1 − σ) x0 + σ ε`` with the pipeline's ids, the transformer given σ, against
    ``ε − x0``; on [B, 128, h, w] latents."""
    s = sigma.view(-1, 1, 1, 1)
    noisy = pipe._pack_latents((1 - s) * x0 + s * noise)
    pred = transformer(hidden_states=noisy, encoder_hidden_states=text, timestep=sigma, guidance=guidance,
                       img_ids=pipe._prepare_latent_ids(x0), txt_ids=pipe._prepare_text_ids(text),
                       return_dict=False)[0]
    return torch.nn.functional.mse_loss(pred, pipe._pack_latents(noise - x0))


def test_the_loss_is_the_pipelines_prediction_of_the_flow(prepared, pipe, monkeypatch) -> None:
    cfg, family, src, entries = prepared
    trainable = load_tiny(family, src, cfg)
    entry = entries[0]
    x0 = entry["latents"][None]
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.6])
    # The preset's sampling: a sigmoid of a normal draw (here logit(0.6)), shifted by e^mu for the token
    # count (FLUX.1's line: 0.5 at 256 tokens, 1.15 at 4096).
    assert cfg.family.timestep_sampling == "shift" and cfg.family.resolution_dependent_shift
    mu = 0.5 + 0.65 * (x0.shape[2] * x0.shape[3] - 256) / 3840
    shifted = torch.tensor([float(torch.exp(torch.tensor(mu)) / (torch.exp(torch.tensor(mu)) + (1 / 0.6 - 1)))])
    with torch.no_grad():
        want = reference_loss(pipe, trainable.model, x0, noise, shifted, entry["prompt_embeds"][None])
        monkeypatch.setattr(f2, "draws", lambda g: fr.Fixed(f2.tokens(noise), sigma))
        monkeypatch.setattr(flow_matching, "draws", lambda g: fr.Fixed(f2.tokens(noise), sigma))
        got = trainable.loss({k: v[None] for k, v in entry.items()}, torch.Generator())
    # σ is computed in float32 here and from Python floats there: a few float32 ulps of the loss.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_dev_feeds_its_guidance_embedding_one(prepared, pipe, monkeypatch) -> None:
    """FLUX.2 [dev] has a guidance embedding: training gives it 1.0 (as every peer does)."""
    from diffusers import Flux2Transformer2DModel

    cfg, _, _, entries = prepared
    c = dict(pipe.transformer.config)
    torch.manual_seed(0)
    dev = Flux2Transformer2DModel.from_config({**c, "guidance_embeds": True}).eval()
    trainable = f2.Flux2Trainable(dev, cfg.family, cfg.train)
    entry = entries[0]
    x0 = entry["latents"][None]
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.4])
    cfg_flat = cfg.family.__class__(timestep_sampling="sigmoid")  # σ as drawn, no shift
    trainable.settings = cfg_flat
    with torch.no_grad():
        one = reference_loss(pipe, dev, x0, noise, sigma, entry["prompt_embeds"][None], torch.tensor([1.0]))
        four = reference_loss(pipe, dev, x0, noise, sigma, entry["prompt_embeds"][None], torch.tensor([4.0]))
        monkeypatch.setattr(f2, "draws", lambda g: fr.Fixed(f2.tokens(noise), sigma))
        monkeypatch.setattr(flow_matching, "draws", lambda g: fr.Fixed(f2.tokens(noise), sigma))
        got = trainable.loss({k: v[None] for k, v in entry.items()}, torch.Generator())
    torch.testing.assert_close(got, one, rtol=1e-6, atol=0)
    assert not torch.allclose(got, four)


def test_the_model_is_named_by_its_pipeline_and_the_swap_count_by_blocks(prepared, tmp_path) -> None:
    cfg, family, src, _ = prepared
    assert f2.variant(src.root) == "klein" and f2.variant(f2.MODELS["dev"]) == "dev"
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ModelSourceError, match=r"'FluxPipeline' is not a FLUX.2 pipeline"):
        f2.variant(tmp_path)
    counts = family.block_counts(src)
    assert counts == [2, 2] and family.swap_counts(counts, family.with_blocks_to_swap(cfg, 3)) == [1, 2]
    with pytest.raises(ImgloraError, match=r"memory.blocks_to_swap = 5, but this FLUX.2 model has 2 double and 2 "
                                           r"single blocks; the largest valid number is 4"):
        family.swap_counts(counts, family.with_blocks_to_swap(cfg, 5))
    assert resolve_swap(family, family.with_blocks_to_swap(cfg, 3), src).modules() == {
        "transformer_blocks.1", "single_transformer_blocks.0", "single_transformer_blocks.1"}
    assert f2.block_counts(f2.MODELS["dev"]) == [8, 48] and f2.block_counts(f2.MODELS["klein"]) == [5, 20]


@pytest.mark.parametrize("path, kind", [("black-forest-labs/FLUX.2-klein-base-4B", "klein"),
                                        ("flux2_dev_fp8mixed.safetensors", "dev")])
def test_the_comfyui_workflows_are_comfy_orgs(path, kind) -> None:
    from types import SimpleNamespace

    from imglora.export.workflows import to_api

    family = registry.get("flux2")
    model = SimpleNamespace(path=path, text_encoder="", vae="", comfyui="")
    api = to_api(family.comfyui_nodes("mine.safetensors", "a photo of sks toy", "", 7, "imglora/mine", False, model))
    assert validate_prompt(api) == []
    by_type = {v["class_type"]: v["inputs"] for v in api.values()}
    assert by_type["CLIPLoader"]["type"] == "flux2" and by_type["VAELoader"] == {"vae_name": "flux2-vae.safetensors"}
    assert by_type["Flux2Scheduler"] == {"steps": 50, "width": 1024, "height": 1024}
    if kind == "klein":
        assert by_type["CFGGuider"]["cfg"] == 4.0 and "FluxGuidance" not in by_type
        assert by_type["CLIPLoader"]["clip_name"] == "qwen_3_4b.safetensors"
    else:
        assert by_type["FluxGuidance"]["guidance"] == 4.0 and "CFGGuider" not in by_type
        assert by_type["UNETLoader"]["unet_name"] == "flux2_dev_fp8mixed.safetensors"


# ---------------------------------------------------------------------------------------------
# ComfyUI's FLUX.2 LoRA key map: model_lora_keys_unet's Flux branch over comfy/utils.py
# flux_to_diffusers (its FLUX.2 names), reimplemented from ComfyUI's source (2026)
# ---------------------------------------------------------------------------------------------


def flux2_to_diffusers(config: dict, output_prefix: str = "") -> dict:
    """{diffusers key: ComfyUI key or (ComfyUI key, (dim, start, size))}, the block weights FLUX.2 has."""
    h = config["num_attention_heads"] * config["attention_head_dim"]
    key_map: dict = {}
    for i in range(config["num_layers"]):
        src, to = f"transformer_blocks.{i}", f"{output_prefix}double_blocks.{i}"
        for j, (img, txt) in enumerate((("to_q", "add_q_proj"), ("to_k", "add_k_proj"), ("to_v", "add_v_proj"))):
            key_map[f"{src}.attn.{img}.weight"] = (f"{to}.img_attn.qkv.weight", (0, h * j, h))
            key_map[f"{src}.attn.{txt}.weight"] = (f"{to}.txt_attn.qkv.weight", (0, h * j, h))
        for a, b in (("attn.to_out.0", "img_attn.proj"), ("attn.to_add_out", "txt_attn.proj"),
                     ("ff.linear_in", "img_mlp.0"), ("ff.linear_out", "img_mlp.2"),
                     ("ff_context.linear_in", "txt_mlp.0"), ("ff_context.linear_out", "txt_mlp.2")):
            key_map[f"{src}.{a}.weight"] = f"{to}.{b}.weight"
    for i in range(config["num_single_layers"]):
        src, to = f"single_transformer_blocks.{i}", f"{output_prefix}single_blocks.{i}"
        key_map[f"{src}.attn.to_qkv_mlp_proj.weight"] = f"{to}.linear1.weight"
        key_map[f"{src}.attn.to_out.weight"] = f"{to}.linear2.weight"
    return key_map


def flux_lora_keys(config: dict) -> dict:
    """{LoRA key prefix: target}: the Flux branch's four prefixes per diffusers ``.weight`` key."""
    out = {}
    for k, to in flux2_to_diffusers(config, "diffusion_model.").items():
        d = k[:-len(".weight")]
        for form in (f"transformer.{d}", "lycoris_" + d.replace(".", "_"), "lora_transformer_" + d.replace(".", "_"), d):
            out[form] = to
    return out


def base_transformer():
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel.from_pretrained(resolve_model("tiny:flux2", registry.get("flux2")).root,
                                                   subfolder="transformer").eval()


def comfy_weights(transformer) -> dict[str, torch.Tensor]:
    """The tiny transformer's block weights in ComfyUI's (BFL's) layout: q, k and v fused."""
    sd, out = transformer.state_dict(), {}
    for k, to in flux2_to_diffusers(dict(transformer.config), "diffusion_model.").items():
        if isinstance(to, tuple):
            target, (_, start, size) = to
            fused = out.setdefault(target, torch.zeros(3 * size, *sd[k].shape[1:]))
            fused[start:start + size] = sd[k]
        else:
            out[to] = sd[k]
    return out


@pytest.fixture(scope="module")
def typed_runs(tmp_path_factory, sample_dataset):
    return fr.typed_runs(tmp_path_factory, sample_dataset, PRESET, "f2")


@pytest.mark.parametrize("kind", ["dora", pytest.param("lora", marks=pytest.mark.slow),
                                  pytest.param("loha", marks=pytest.mark.slow), pytest.param("lokr", marks=pytest.mark.slow),
                                  pytest.param("oft", marks=pytest.mark.slow)])
def test_every_key_maps_in_comfyui_and_patches_bfls_weights_as_trained(typed_runs, kind, tmp_path) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    cfg, run = typed_runs(kind)
    sd = load_file(str(export_run(run, out=tmp_path / "f.safetensors", dtype="fp32").path))
    base = base_transformer()
    keys = flux_lora_keys(dict(base.config))
    patches, not_loaded = comfy.load_lora(sd, keys)
    assert not_loaded == set(), sorted(not_loaded)[:5]
    model = base_transformer()
    family = registry.get("flux2")
    lora.inject(model, family, cfg.lora, seed=0)
    lora.load_adapter_state(model, family.read_adapter(run / "adapter"))
    merged = {}
    for name, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            layer = copy.deepcopy(m)
            layer.merge(safe_merge=True)
            merged[name] = layer.get_base_layer().weight.detach().clone()
    assert {f"transformer.{n}" for n in merged} == set(patches)
    assert any(n.endswith("attn.to_qkv_mlp_proj") for n in merged) and any(n.endswith(".attn.to_out") for n in merged)
    fused = comfy_weights(base)
    patched = {k: v.clone() for k, v in fused.items()}
    for key, adapter in patches.items():
        target = keys[key]
        if isinstance(target, tuple):
            name, (dim, start, size) = target
            patched[name].narrow(dim, start, size).copy_(
                comfy.calculate_weight(adapter, fused[name].narrow(dim, start, size), key))
        else:
            patched[target] = comfy.calculate_weight(adapter, fused[target], key)
        assert adapter.error is None, adapter.error
    mapping = flux2_to_diffusers(dict(base.config), "diffusion_model.")
    want = {k: v.clone() for k, v in fused.items()}
    for name, w in merged.items():
        to = mapping[f"{name}.weight"]
        if isinstance(to, tuple):
            want[to[0]][to[1][1]:to[1][1] + to[1][2]] = w
        else:
            want[to] = w
    for name in want:  # float32 rounding of two computations of the same sums: rtol 1e-5
        torch.testing.assert_close(patched[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    with safe_open(str(tmp_path / "f.safetensors"), framework="pt") as fh:
        meta = fh.metadata()
    assert meta["ss_base_model_version"] == "flux2_klein" and meta["imglora.adapter_type"] == kind


# ---------------------------------------------------------------------------------------------
# A run: FP8 base, a swapped block, batch 2
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def f2_run(tmp_path_factory, sample_dataset):
    cfg, result = fr.four_update_run(tmp_path_factory.mktemp("f2-run"), sample_dataset, PRESET)
    assert cfg.memory.fp8 and cfg.memory.blocks_to_swap == 1
    return cfg, result


def test_a_resumed_run_ends_exactly_as_an_uninterrupted_one(f2_run, tmp_path: Path) -> None:
    cfg, result = f2_run
    assert len(assert_resumes_exactly(cfg, result, tmp_path)) == 4


@pytest.mark.slow  # (the default run keeps under 6 minutes; CI runs it)
def test_eval_at_strength_0_is_the_klein_pipeline_with_real_cfg(f2_run) -> None:
    import numpy as np
    from diffusers import Flux2KleinPipeline
    from PIL import Image

    from imglora.commands.evaluate import evaluate

    cfg, _ = f2_run
    result = evaluate(cfg.run_dir, overrides=['eval.fp8="off"', "eval.blocks_to_swap=0"], out=lambda s: None)
    (step,) = result.images
    family = registry.get("flux2")
    prompt = family.default_prompts(cfg)[0]
    pipe = Flux2KleinPipeline.from_pretrained(resolve_model("tiny:flux2", family).root)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            own_module(component)
    pipe.set_progress_bar_config(disable=True)
    side = cfg.data.resolution
    base = pipe(prompt=prompt, guidance_scale=4.0, height=side, width=side, num_inference_steps=2,
                max_sequence_length=cfg.cache.text_max_length, generator=torch.Generator().manual_seed(0)).images[0]
    got = [np.asarray(Image.open(p).convert("RGB")) for p in result.images[step][0]]
    assert got[0].shape == (side, side, 3) and np.array_equal(got[0], np.asarray(base))
    assert not np.array_equal(got[1], np.asarray(base))
