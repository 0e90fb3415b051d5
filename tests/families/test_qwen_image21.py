"""Qwen-Image 2.1: captions cached as QwenImage21Pipeline encodes them (Qwen3-VL's last layer before its
final norm, the system turn dropped as the pipeline computes it), latents as its _encode_vae_image
gives them for an opaque RGBA image, the loss as a reimplementation of the pipeline's step (its
layout arguments, the joint output's last rows); captions of other lengths in one batch; the swap
count; the ComfyUI workflow; every adapter type's export under ComfyUI's 2026 map of 2.1 (LoRAs on
the halves of the fused ``img_mlp.gate_up``, reimplemented below); a run that resumes exactly and
whose evaluation at strength 0 is the pipeline's own image."""

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
from imglora.families.qwen_image21 import model as q21
from imglora.models.resolve import resolve_model
from imglora.util.owned import own_module
from loading import load_tiny
import family_runs as fr
from resume_exact import assert_resumes_exactly

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-qwen-image21.toml"


def tiny_pipeline():
    from diffusers import QwenImage21Pipeline

    root = resolve_model("tiny:qwen_image21", registry.get("qwen_image21")).root
    pipe = QwenImage21Pipeline.from_pretrained(root, processor=q21.load_processor(root))
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            own_module(component)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, sample_dataset: Path):
    return fr.prepared(tmp_path_factory.mktemp("q21-prepared"), sample_dataset, PRESET, "qwen_image21")


@pytest.fixture(scope="module")
def pipe(prepared):
    return tiny_pipeline()


def test_captions_are_the_pipelines_and_latents_its_rgba_encoding(prepared, pipe) -> None:
    cfg, family, src, entries = prepared
    tokenizer = pipe.processor.tokenizer
    # the system turn the pipeline drops, computed as it computes it (the processor's chat template);
    # the tiny tokenizer cuts it in the real one's 14 tokens
    assert q21.system_tokens(tokenizer) == pipe._drop_idx == 14
    assert pipe.prompt_template_t2i == q21.PREFIX + "{}" + q21.SUFFIX
    encoders = family.load_text_encoders(src, torch.device("cpu"), torch.float32)
    for caption in ("a photo of sks toy on a wooden table", ""):
        with torch.no_grad():
            want, mask, _ = pipe._get_qwen_prompt_embeds(caption, device=torch.device("cpu"))
        got = family.encode_text(encoders, caption, 64)["prompt_embeds"]
        # Qwen3VLModel here, the pipeline's generation model there: the same layers on the same ids
        # (float32 rounding: 1e-5). The final norm bypassed on both sides: not its output.
        assert got.shape == want[0].shape and mask.all()
        torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-6)
        normed = encoders[1].language_model.norm(got)
        assert not torch.allclose(normed, got, atol=1e-3)
    n = family.count_tokens(encoders, "a photo of sks toy", 64)["Qwen3-VL"][0]
    assert n == family.encode_text(encoders, "a photo of sks toy", 64)["prompt_embeds"].shape[0]
    long = " ".join(["toy"] * 80)
    assert family.encode_text(encoders, long, 20)["prompt_embeds"].shape[0] == 20  # cut at the limit, suffix kept

    pixels = torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    from PIL import Image

    image = Image.fromarray(((pixels[0].permute(1, 2, 0) + 1) * 127.5).round().byte().numpy()).convert("RGBA")
    rgba = pipe.image_processor.preprocess(image, height=64, width=96).unsqueeze(2)  # the pipeline's input
    ours = q21.rgba(pipe.image_processor.preprocess(image.convert("RGB"), height=64, width=96))
    assert torch.equal(rgba, ours)  # an opaque image: alpha 1, as convert("RGBA") gives
    with torch.no_grad():
        want = pipe._encode_vae_image(rgba, generator=None)
    got = family.encode_image(pipe.vae, ours[:, :3, 0])["latents"]
    assert got.shape == (64, 4, 6) and torch.equal(got, want[0, :, 0])


def test_the_loss_is_the_pipelines_step(prepared, pipe, monkeypatch) -> None:
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    cfg, family, src, entries = prepared
    trainable = load_tiny(family, src, cfg)
    entry = entries[0]
    lat = entry["latents"][None]
    _, c, h, w = lat.shape
    x0 = pipe._pack_latents(lat, 1, c, h, w)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.6])
    assert cfg.family.timestep_sampling == "shift" and cfg.family.resolution_dependent_shift
    s = pipe.scheduler.config
    mu = calculate_shift(x0.shape[1], s.base_image_seq_len, s.max_image_seq_len, s.base_shift, s.max_shift)
    e_mu = torch.exp(torch.tensor(mu, dtype=torch.float64))
    sig = (e_mu / (e_mu + (1 / sigma.double() - 1))).float()
    embeds = entry["prompt_embeds"][None]
    # the pipeline's layout for one prompt: its image_pad_mask (no image in the caption) and one slot per
    # 2×2 target tokens appended; the transformer's output rows for the whole sequence, the last N kept
    img_mask = torch.cat([torch.zeros(1, embeds.shape[1], dtype=torch.bool),
                          torch.ones(1, x0.shape[1] // 4, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        out = trainable.model(hidden_states=(1 - sig) * x0 + sig * noise, encoder_hidden_states=embeds,
                              encoder_hidden_states_mask=None, timestep=sig, img_shapes=[[(1, h, w)]],
                              img_mask=img_mask, return_dict=False)[0]
        want = torch.nn.functional.mse_loss(out[:, -x0.shape[1]:], noise - x0)
        monkeypatch.setattr(flow_matching, "draws", lambda g: fr.Fixed(noise, sigma))
        monkeypatch.setattr(q21, "draws", lambda g: fr.Fixed(noise, sigma))
        got = trainable.loss({k: v[None] for k, v in entry.items()}, torch.Generator())
        assert torch.equal(got, want)  # the same calls on the same tensors
        # the output's first rows are the caption's: a loss on them is not the pipeline's
        wrong = torch.nn.functional.mse_loss(out[:, :x0.shape[1]], noise - x0)
        assert not torch.allclose(wrong, want, rtol=1e-3)


def test_captions_of_other_lengths_train_in_one_batch_with_a_mask(prepared) -> None:
    cfg, family, src, entries = prepared
    a, b = entries[0], dict(entries[1])
    b["prompt_embeds"] = a["prompt_embeds"][:-3]
    batch = family.collate([a, b])
    assert batch["prompt_embeds"].shape[1] == a["prompt_embeds"].shape[0]
    assert batch["prompt_mask"].tolist()[1] == [True] * (a["prompt_embeds"].shape[0] - 3) + [False] * 3
    trainable = load_tiny(family, src, cfg)
    loss = trainable.loss(batch, torch.Generator().manual_seed(0))
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_blocks_to_swap_counts_blocks_sizes_and_the_workflow_is_comfyuis(prepared) -> None:
    from imglora.export.workflows import to_api

    cfg, family, src, entries = prepared
    counts = family.block_counts(src)
    assert counts == [3] and family.swap_counts(counts, family.with_blocks_to_swap(cfg, 2)) == [2]
    with pytest.raises(ImgloraError, match=r"memory.blocks_to_swap = 4, but Qwen-Image 2.1 has only 3 blocks; .* 3$"):
        family.swap_counts(counts, family.with_blocks_to_swap(cfg, 4))
    assert q21.block_counts(q21.CONFIGS) == [32]
    with pytest.raises(ImgloraError, match=r"multiples of 32 pixels; got latents of 3×4"):
        q21.layout(1, 5, 3, 4, torch.device("cpu"))
    api = to_api(family.comfyui_nodes("mine.safetensors", "a photo of sks toy", "", 7, "imglora/mine", False))
    assert validate_prompt(api) == []
    by_type = {v["class_type"]: v["inputs"] for v in api.values()}
    assert by_type["CLIPLoader"] == {"clip_name": "qwen3vl_8b_bf16.safetensors", "type": "qwen_image"}
    assert by_type["TextEncodeQwenImage21"]["resolution"] == 1024
    k = by_type["KSampler"]
    assert (k["steps"], k["cfg"], k["sampler_name"], k["scheduler"]) == (40, 1.0, "euler", "simple")
    assert k["negative"][1] == 1 and k["latent_image"][1] == 2  # the encoder node's negative and latent outputs


# ---------------------------------------------------------------------------------------------
# ComfyUI's Qwen-Image 2.1 model and LoRA key map (comfy/ldm/qwen_image21/model.py's names;
# comfy/lora.py's QwenImage branch, 2026), reimplemented from ComfyUI's source
# ---------------------------------------------------------------------------------------------

def comfy_weights(transformer) -> dict[str, torch.Tensor]:
    """The model's weights as ComfyUI holds them: diffusers' names under ``diffusion_model.``, each
    block's img_mlp.gate_layer and img_mlp.proj fused into img_mlp.gate_up at load (gate rows first)."""
    sd, out = transformer.state_dict(), {}
    for k, v in sd.items():
        if k.endswith(".img_mlp.gate_layer.weight"):
            up = sd[k.replace(".gate_layer.", ".proj.")]
            out["diffusion_model." + k.replace(".gate_layer.", ".gate_up.")] = torch.cat([v, up])
        elif not k.endswith(".img_mlp.proj.weight"):
            out["diffusion_model." + k] = v
    return out


def qwen_image21_lora_keys(weights: dict[str, torch.Tensor]) -> dict:
    key_map: dict = {}
    for k in weights:
        if not k.endswith(".weight"):
            continue
        key_lora = k[len("diffusion_model."):-len(".weight")]
        key_map[k[:-len(".weight")]] = k  # the generic map: the model's own names under diffusion_model.
        targets = [(key_lora, k)]
        if key_lora.endswith(".img_mlp.gate_up"):
            half = weights[k].shape[0] // 2
            targets = [(key_lora.replace(".gate_up", ".gate_layer"), (k, (0, 0, half))),
                       (key_lora.replace(".gate_up", ".proj"), (k, (0, half, half)))]
        for name, to in targets:
            key_map[name] = to
            key_map["transformer." + name] = to
            key_map["lycoris_" + name.replace(".", "_")] = to
    return key_map


def base_transformer():
    from diffusers import QwenImage21Transformer2DModel

    return QwenImage21Transformer2DModel.from_pretrained(
        resolve_model("tiny:qwen_image21", registry.get("qwen_image21")).root, subfolder="transformer").eval()


@pytest.fixture(scope="module")
def typed_runs(tmp_path_factory, sample_dataset):
    return fr.typed_runs(tmp_path_factory, sample_dataset, PRESET, "q21")


@pytest.mark.parametrize("kind", ["lora", pytest.param("lokr", marks=pytest.mark.slow),
                                  pytest.param("dora", marks=pytest.mark.slow), pytest.param("loha", marks=pytest.mark.slow),
                                  pytest.param("oft", marks=pytest.mark.slow)])
def test_every_key_maps_in_comfyui_and_patches_the_fused_weights_as_trained(typed_runs, kind, tmp_path) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    cfg, run = typed_runs(kind)
    sd = load_file(str(export_run(run, out=tmp_path / "q.safetensors", dtype="fp32").path))
    assert sd and all(k.startswith("transformer.transformer_blocks.") for k in sd)
    base = base_transformer()
    fused = comfy_weights(base)
    keys = qwen_image21_lora_keys(fused)
    patches, not_loaded = comfy.load_lora(sd, keys)
    assert not_loaded == set(), sorted(not_loaded)[:5]
    model = base_transformer()
    family = registry.get("qwen_image21")
    lora.inject(model, family, cfg.lora, seed=0)
    lora.load_adapter_state(model, family.read_adapter(run / "adapter"))
    merged = {}
    for name, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            layer = copy.deepcopy(m)
            layer.merge(safe_merge=True)
            merged[name] = layer.get_base_layer().weight.detach().clone()
    assert {f"transformer.{n}" for n in merged} == set(patches)
    assert any(n.endswith("img_mlp.gate_layer") for n in merged) and any(n.endswith("img_mlp.proj") for n in merged)
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
    want = comfy_weights(type(base).from_config(base.config).eval().requires_grad_(False))  # (shapes only)
    trained = {**base.state_dict(), **{f"{n}.weight": w for n, w in merged.items()}}
    for k in want:
        if k.endswith(".img_mlp.gate_up.weight"):
            d = k[len("diffusion_model."):].replace(".gate_up.", ".{}.")
            want[k] = torch.cat([trained[d.format("gate_layer")], trained[d.format("proj")]])
        else:
            want[k] = trained[k[len("diffusion_model."):]]
    for name in want:  # float32 rounding of two computations of the same sums: rtol 1e-5
        torch.testing.assert_close(patched[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    changed = [k for k in fused if not torch.equal(patched[k], fused[k])]
    assert len(changed) == 3 * 6  # per block: q, k, v, out, the MLP's out and fused gate_up; nothing outside
    with safe_open(str(tmp_path / "q.safetensors"), framework="pt") as fh:
        meta = fh.metadata()
    assert meta["ss_base_model_version"] == "qwen_image_2.1" and meta["imglora.adapter_type"] == kind


@pytest.fixture(scope="module")
def q21_run(tmp_path_factory, sample_dataset):
    cfg, result = fr.four_update_run(tmp_path_factory.mktemp("q21-run"), sample_dataset, PRESET)
    assert cfg.memory.fp8 and cfg.memory.blocks_to_swap == 1
    return cfg, result


def test_a_resumed_run_ends_exactly_as_an_uninterrupted_one(q21_run, tmp_path: Path) -> None:
    cfg, result = q21_run
    assert len(assert_resumes_exactly(cfg, result, tmp_path)) == 4


@pytest.mark.slow  # (the default run keeps under 6 minutes; CI runs it)
def test_eval_at_strength_0_is_the_pipelines_image(q21_run) -> None:
    import numpy as np
    from PIL import Image

    from imglora.commands.evaluate import evaluate

    cfg, _ = q21_run
    result = evaluate(cfg.run_dir, overrides=['eval.fp8="off"', "eval.blocks_to_swap=0"], out=lambda s: None)
    (step,) = result.images
    prompt = registry.get("qwen_image21").default_prompts(cfg)[0]
    side = cfg.data.resolution
    base = tiny_pipeline()(prompt=prompt, height=side, width=side, num_inference_steps=2,
                           generator=torch.Generator().manual_seed(0)).images[0]
    assert base.mode == "RGBA"  # the VAE's four channels; imglora's samples are their RGB
    got = [np.asarray(Image.open(p)) for p in result.images[step][0]]
    assert got[0].shape == (side, side, 3)
    base = base.convert("RGB")
    # imglora's cached caption (Qwen3VLModel) against the pipeline's encoding (its generation model):
    # float32 rounding, a level of 255 at most
    assert np.abs(got[0].astype(int) - np.asarray(base).astype(int)).max() <= 1
    assert np.abs(got[1].astype(int) - np.asarray(base).astype(int)).max() > 2  # the adapter at strength 1
