"""Z-Image: captions cached as ZImagePipeline encodes them (Qwen3 in its chat template, the
second-to-last hidden states, padding dropped), latents as diffusers' training script scales them,
the loss as a reimplementation of the pipeline's noising and prediction (the time 1 − σ, the
negated output); captions of other lengths in one batch; the swap count; the ComfyUI workflow; every
adapter type's export under ComfyUI's Z-Image key map (``comfy/utils.py::z_image_to_diffusers``,
reimplemented below: q, k and v as row slices of the fused ``qkv``); a run that resumes exactly and
whose evaluation at strength 0 is the pipeline's own image."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import comfy_math as comfy
from comfy_nodes import validate_prompt
from imglora.adapters import inject as lora
from imglora.commands.export import export as export_run
from imglora.errors import ImgloraError
from imglora.families import registry
from imglora.families._shared import flow_matching
from imglora.families.z_image import model as z_model
from imglora.models.resolve import resolve_model
from imglora.util.owned import own_module
from imglora.memory.wrap import resolve_swap
from loading import load_tiny
import family_runs as fr
from resume_exact import assert_resumes_exactly

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-z-image.toml"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, sample_dataset: Path):
    return fr.prepared(tmp_path_factory.mktemp("z-prepared"), sample_dataset, PRESET, "z_image")


@pytest.fixture(scope="module")
def pipe(prepared):
    from diffusers import ZImagePipeline

    return fr.owned(ZImagePipeline.from_pretrained(prepared[2].root))


def test_captions_are_the_pipelines_embeddings_and_latents_the_training_scripts(prepared, pipe) -> None:
    cfg, family, src, entries = prepared
    encoders = (pipe.tokenizer, pipe.text_encoder)
    for caption in ("a photo of sks toy on a wooden table", ""):
        want = pipe.encode_prompt(caption, device=torch.device("cpu"), do_classifier_free_guidance=False,
                                  max_sequence_length=64)[0][0]
        got = family.encode_text(encoders, caption, 64)["prompt_embeds"]
        # The pipeline pads to 64 tokens and drops the padding; Qwen3 is causal, so its tokens' states are
        # the same sums, computed in a batch of another length (float32 rounding: 1e-6).
        assert got.shape == want.shape
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    # The template's tokens are counted: the pipeline cuts the templated text at max_sequence_length.
    assert family.encode_text(encoders, "a photo of sks toy on a wooden table", 6)["prompt_embeds"].shape[0] == 6
    n = len(pipe.tokenizer(z_model.TEMPLATE.format("a photo of sks toy")).input_ids)
    assert family.count_tokens(encoders, "a photo of sks toy", 32) == {"Qwen3": (n, 32)}
    assert z_model.TEMPLATE == pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": "{}"}], tokenize=False, add_generation_prompt=True, enable_thinking=True)

    # diffusers' train_dreambooth_lora_z_image.py: (latents - shift_factor) * scaling_factor.
    pixels = torch.rand(1, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    vae = pipe.vae
    with torch.no_grad():
        want = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    got = family.encode_image(vae, pixels)["latents"]
    assert got.shape == (16, 8, 6) and torch.equal(got, want[0])


def reference_loss(transformer, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor,
                   captions: list[torch.Tensor]) -> torch.Tensor:
    """ZImagePipeline's step, as a training loss (diffusers' train_dreambooth_lora_z_image.py):
    ``x_σ = (1 − σ) x0 + σ ε``, the transformer called with lists and the time ``(1000 − σ·1000) / 1000``,
    its output negated (``noise_pred = -noise_pred``), against ``ε − x0``; on [B, C, h, w] latents."""
    s = sigma.view(-1, 1, 1, 1)
    noisy = (1 - s) * x0 + s * noise
    timestep = (1000 - sigma * 1000) / 1000
    out = transformer(list(noisy.unsqueeze(2).unbind(0)), timestep, captions, return_dict=False)[0]
    pred = -torch.stack([t.float() for t in out]).squeeze(2)
    return torch.nn.functional.mse_loss(pred, noise - x0)


def test_the_loss_is_the_pipelines_prediction_of_the_flow(prepared, monkeypatch) -> None:
    cfg, family, src, entries = prepared
    trainable = load_tiny(family, src, cfg)
    entry = entries[0]
    x0 = entry["latents"][None]
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.6])
    # The preset's sampling: a sigmoid of a normal draw (here logit(0.6)), shifted by Turbo's 3.0.
    assert cfg.family.timestep_sampling == "shift" and cfg.family.discrete_flow_shift == 3.0
    shifted = sigma * 3.0 / (1 + 2.0 * sigma)
    with torch.no_grad():
        want = reference_loss(trainable.model, x0, noise, shifted, [entry["prompt_embeds"]])
        # ours draws its noise in the packed layout: the same values, as packed tokens
        monkeypatch.setattr(flow_matching, "draws", lambda g: fr.Fixed(flow_matching.pack_latents(noise), sigma))
        got = trainable.loss({k: v[None] for k, v in entry.items()}, torch.Generator())
    # σ is computed in float32 here and from Python floats there: a last-bit difference in σ moves the
    # loss by a few float32 ulps.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # The time is 1 − σ: at σ the model is told the image is 1 − σ clean (the other way is far off).
    with torch.no_grad():
        wrong = reference_loss(trainable.model, x0, noise, 1 - shifted, [entry["prompt_embeds"]])
    assert not torch.allclose(got, wrong, rtol=1e-3)
    assert z_model.unpacked(flow_matching.pack_latents(x0), *x0.shape[2:]).equal(x0)  # unpacking inverts packing


def test_captions_of_other_lengths_are_padded_and_each_sample_sees_its_own(prepared) -> None:
    cfg, family, src, entries = prepared
    a, b = entries
    b = {**b, "latents": a["latents"], "prompt_embeds": b["prompt_embeds"][:-2]}
    batch = family.collate([a, b])
    n = max(a["prompt_embeds"].shape[0], b["prompt_embeds"].shape[0])
    assert batch["prompt_embeds"].shape == (2, n, a["prompt_embeds"].shape[1])
    assert batch["prompt_mask"].tolist() == [[i < e["prompt_embeds"].shape[0] for i in range(n)] for e in (a, b)]
    assert "prompt_mask" not in family.collate([a, a])
    trainable = load_tiny(family, src, cfg)
    noise = torch.randn(2, *a["latents"].shape, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.3, 0.7])

    def loss(items: list[dict], rows: slice) -> torch.Tensor:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(flow_matching, "draws",
                       lambda g: fr.Fixed(flow_matching.pack_latents(noise[rows]), sigma[rows]))
            with torch.no_grad():
                return trainable.loss(family.collate(items), torch.Generator())

    both = loss([a, b], slice(0, 2))
    alone = (loss([a], slice(0, 1)) + loss([b], slice(1, 2))) / 2  # each caption without padding
    torch.testing.assert_close(both, alone, rtol=1e-5, atol=1e-7)


def test_blocks_to_swap_counts_the_main_blocks_and_says_the_largest(prepared) -> None:
    cfg, family, src, _ = prepared
    counts = family.block_counts(src)
    assert counts == [1, 1, 3] and family.swap_counts(counts, family.with_blocks_to_swap(cfg, 2)) == [0, 0, 2]
    with pytest.raises(ImgloraError, match=r"memory.blocks_to_swap = 4, but Z-Image has only 3 main blocks .* 3$"):
        family.swap_counts(counts, family.with_blocks_to_swap(cfg, 4))
    two = resolve_swap(family, family.with_blocks_to_swap(cfg, 2), src)
    assert two.modules() == {"layers.1", "layers.2"} and family.full_block_counts(cfg) == [2, 2, 30]
    assert z_model.block_counts(z_model.CONFIGS) == [2, 2, 30]  # the real model


def test_the_comfyui_workflow_is_comfy_orgs_turbo_template() -> None:
    from imglora.export.workflows import to_api

    family = registry.get("z_image")
    api = to_api(family.comfyui_nodes("mine.safetensors", "a photo of sks toy", "", 7, "imglora/mine", False))
    assert validate_prompt(api) == []
    by_type = {v["class_type"]: v["inputs"] for v in api.values()}
    assert by_type["CLIPLoader"] == {"clip_name": "qwen_3_4b.safetensors", "type": "lumina2"}
    assert by_type["UNETLoader"]["unet_name"] == "z_image_turbo_bf16.safetensors"
    assert by_type["VAELoader"] == {"vae_name": "ae.safetensors"}
    assert by_type["ModelSamplingAuraFlow"]["shift"] == 3.0
    k = by_type["KSampler"]
    assert (k["steps"], k["cfg"], k["sampler_name"], k["scheduler"]) == (8, 1.0, "res_multistep", "simple")
    zero = next(i for i, v in api.items() if v["class_type"] == "ConditioningZeroOut")
    assert k["negative"] == [zero, 0]  # Turbo's negative: the prompt zeroed out


# ---------------------------------------------------------------------------------------------
# ComfyUI's Z-Image LoRA key map (comfy/lora.py model_lora_keys_unet, Lumina2 branch, over
# comfy/utils.py z_image_to_diffusers), reimplemented from ComfyUI's source (2026)
# ---------------------------------------------------------------------------------------------


def z_image_to_diffusers(config: dict, output_prefix: str = "") -> dict:
    """{diffusers key: ComfyUI key, or (ComfyUI key, (dim, start, size))}, as comfy/utils.py."""
    n_layers, hidden, n_refiner = config.get("n_layers", 0), config.get("dim", 0), config.get("n_refiner_layers", 2)
    key_map: dict = {}

    def add_block_keys(prefix_from: str, prefix_to: str) -> None:
        for end in ("weight", "bias"):
            qkv = f"{prefix_to}.attention.qkv.{end}"
            for i, p in enumerate(("to_q", "to_k", "to_v")):
                key_map[f"{prefix_from}.attention.{p}.{end}"] = (qkv, (0, hidden * i, hidden))
        block_map = {"attention.norm_q.weight": "attention.q_norm.weight",
                     "attention.norm_k.weight": "attention.k_norm.weight",
                     "attention.to_out.0.weight": "attention.out.weight", "attention.to_out.0.bias": "attention.out.bias",
                     **{f"{n}.weight": f"{n}.weight" for n in ("attention_norm1", "attention_norm2", "feed_forward.w1",
                                                               "feed_forward.w2", "feed_forward.w3", "ffn_norm1",
                                                               "ffn_norm2")},
                     "adaLN_modulation.0.weight": "adaLN_modulation.0.weight",
                     "adaLN_modulation.0.bias": "adaLN_modulation.0.bias"}
        for k, v in block_map.items():
            key_map[f"{prefix_from}.{k}"] = f"{prefix_to}.{v}"

    for name, count in (("layers", n_layers), ("context_refiner", n_refiner), ("noise_refiner", n_refiner)):
        for i in range(count):
            add_block_keys(f"{name}.{i}", f"{output_prefix}{name}.{i}")
    for comfy_name, diffusers in (("final_layer.linear.weight", "all_final_layer.2-1.linear.weight"),
                                  ("x_embedder.weight", "all_x_embedder.2-1.weight"),
                                  ("cap_embedder.1.weight", "cap_embedder.1.weight"),
                                  ("t_embedder.mlp.0.weight", "t_embedder.mlp.0.weight"),
                                  ("t_embedder.mlp.2.weight", "t_embedder.mlp.2.weight")):
        key_map[diffusers] = f"{output_prefix}{comfy_name}"
    return key_map


def lumina2_lora_keys(config: dict) -> dict:
    """{LoRA key prefix: target}: the Lumina2 branch's four prefixes per diffusers ``.weight`` key."""
    out = {}
    for k, to in z_image_to_diffusers(config, output_prefix="diffusion_model.").items():
        if k.endswith(".weight"):
            key = k[:-len(".weight")]
            for form in (f"diffusion_model.{key}", f"transformer.{key}", "lycoris_" + key.replace(".", "_"), key):
                out[form] = to
    return out


def comfy_weights(transformer) -> dict[str, torch.Tensor]:
    """The tiny transformer's weights in ComfyUI's layout: q, k and v fused into ``attention.qkv``."""
    sd = transformer.state_dict()
    out = {}
    for k, to in z_image_to_diffusers(dict(transformer.config), "diffusion_model.").items():
        if k not in sd:
            continue
        if isinstance(to, tuple):
            target, (_, start, size) = to
            fused = out.setdefault(target, torch.zeros(3 * size, *sd[k].shape[1:]))
            fused[start:start + size] = sd[k]
        else:
            out[to] = sd[k]
    return out


def base_transformer():
    from diffusers import ZImageTransformer2DModel

    family = registry.get("z_image")
    return ZImageTransformer2DModel.from_pretrained(resolve_model("tiny:z_image", family).root,
                                                    subfolder="transformer").eval()


def merged_weights(cfg, run: Path) -> dict[str, torch.Tensor]:
    """{diffusers module: peft's merged weight} of the run's adapter on the unquantized base."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    family = registry.get("z_image")
    model = base_transformer()
    lora.inject(model, family, cfg.lora, seed=0)
    lora.load_adapter_state(model, family.read_adapter(run / "adapter"))
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            layer = copy.deepcopy(m)
            layer.merge(safe_merge=True)
            out[name] = layer.get_base_layer().weight.detach().clone()
    return out


@pytest.fixture(scope="module")
def typed_runs(tmp_path_factory, sample_dataset):
    return fr.typed_runs(tmp_path_factory, sample_dataset, PRESET, "z", {"oft": ["lora.rank=2", "lora.alpha=0"], "lokr": ["lora.rank=4", "lora.factor=4"]})


@pytest.mark.parametrize("kind", ["dora", "lokr", pytest.param("lora", marks=pytest.mark.slow),
                                  pytest.param("loha", marks=pytest.mark.slow),
                                  pytest.param("oft", marks=pytest.mark.slow)])
def test_every_key_maps_in_comfyui_and_patches_the_fused_weights_as_trained(typed_runs, kind, tmp_path) -> None:
    cfg, run = typed_runs(kind)
    sd = load_file(str(export_run(run, out=tmp_path / "z.safetensors", dtype="fp32").path))
    assert sd and all(k.startswith("diffusion_model.layers.") for k in sd), sorted(sd)[:3]
    base = base_transformer()
    keys = lumina2_lora_keys(dict(base.config))
    patches, not_loaded = comfy.load_lora(sd, keys)
    assert not_loaded == set(), sorted(not_loaded)[:5]
    merged = merged_weights(cfg, run)
    assert {f"diffusion_model.{n}" for n in merged} == set(patches)
    fused = comfy_weights(base)
    patched = {k: v.clone() for k, v in fused.items()}
    for key, adapter in patches.items():
        target = keys[key]
        if isinstance(target, tuple):  # q, k or v: its rows of the fused qkv, patched in place (offset)
            name, (dim, start, size) = target
            patched[name].narrow(dim, start, size).copy_(
                comfy.calculate_weight(adapter, fused[name].narrow(dim, start, size), key))
        else:
            patched[target] = comfy.calculate_weight(adapter, fused[target], key)
        assert adapter.error is None, adapter.error
    # ComfyUI's model after the LoRA is the trained model: each fused weight is q, k and v merged by
    # peft, stacked (float32 rounding of two computations of the same sums: rtol 1e-5)
    want = comfy_weights(base)
    for name, w in merged.items():
        to = z_image_to_diffusers(dict(base.config), "diffusion_model.")[f"{name}.weight"]
        if isinstance(to, tuple):
            want[to[0]][to[1][1]:to[1][1] + to[1][2]] = w
        else:
            want[to] = w
    changed = 0
    for name in want:
        torch.testing.assert_close(patched[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
        changed += not torch.equal(patched[name], fused[name])
    assert changed == len({(keys[k][0] if isinstance(keys[k], tuple) else keys[k]) for k in patches})
    from safetensors import safe_open

    with safe_open(str(tmp_path / "z.safetensors"), framework="pt") as fh:
        meta = fh.metadata()
    assert meta["ss_base_model_version"] == "z_image" and meta["imglora.adapter_type"] == kind


# ---------------------------------------------------------------------------------------------
# A run: FP8 base, a swapped block, batch 2 with captions of other lengths
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def z_run(tmp_path_factory, sample_dataset):
    cfg, result = fr.four_update_run(tmp_path_factory.mktemp("z-run"), sample_dataset, PRESET)
    assert cfg.memory.fp8 and cfg.memory.blocks_to_swap == 1
    return cfg, result


def test_a_resumed_run_ends_exactly_as_an_uninterrupted_one(z_run, tmp_path: Path) -> None:
    cfg, result = z_run
    assert len(assert_resumes_exactly(cfg, result, tmp_path)) == 4


@pytest.mark.slow  # (the default run keeps under 6 minutes; CI runs it)
def test_eval_at_strength_0_is_the_turbo_pipeline_without_guidance(z_run) -> None:
    import numpy as np
    from diffusers import ZImagePipeline
    from PIL import Image

    from imglora.commands.evaluate import evaluate

    cfg, _ = z_run
    result = evaluate(cfg.run_dir, overrides=['eval.fp8="off"', "eval.blocks_to_swap=0"], out=lambda s: None)
    (step,) = result.images
    family = registry.get("z_image")
    prompt = family.default_prompts(cfg)[0]
    pipe = ZImagePipeline.from_pretrained(resolve_model("tiny:z_image", family).root)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            own_module(component)
    pipe.set_progress_bar_config(disable=True)
    side = cfg.data.resolution
    base = pipe(prompt=prompt, guidance_scale=0.0, height=side, width=side, num_inference_steps=2,
                max_sequence_length=cfg.cache.text_max_length, generator=torch.Generator().manual_seed(0)).images[0]
    got = [np.asarray(Image.open(p).convert("RGB")) for p in result.images[step][0]]
    assert got[0].shape == (side, side, 3) and np.array_equal(got[0], np.asarray(base))
    assert not np.array_equal(got[1], np.asarray(base))  # the adapter at strength 1 changes the image
