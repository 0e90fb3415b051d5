"""Qwen-Image: captions cached as QwenImagePipeline encodes them (Qwen2.5-VL in its chat template,
the template's tokens dropped), latents normalised as diffusers' training script does, the loss
as the transformer computes it when the pipeline calls it; captions of other lengths in one batch
padded and masked; the last block's unused text outputs left unadapted; the swap count; the
ComfyUI workflow."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from imglora.adapters import inject as lora
from imglora.commands.common import load_config
from imglora.data import cache
from imglora.errors import ImgloraError
from imglora.families import registry
from imglora.families._shared import flow_matching
from imglora.families.qwen_image import model as qwen_model
from imglora.models.resolve import resolve_model
from imglora.util.owned import own_module
from imglora.memory.wrap import resolve_swap
from loading import load_tiny
from resume_exact import assert_resumes_exactly

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-qwen-image.toml"


@pytest.fixture()
def prepared(tmp_path: Path, sample_dataset: Path):
    data = tmp_path / "data"
    data.mkdir()
    for stem in ("01_sky", "03_table"):
        for f in sample_dataset.glob(f"{stem}.*"):
            shutil.copy(f, data / f.name)
    q = lambda p: json.dumps(str(p))  # noqa: E731
    cfg = load_config(PRESET, [f"data.dir={q(data)}", f"cache.dir={q(tmp_path / 'cache')}",
                               f"run.output_dir={q(tmp_path / 'runs')}", "memory.fp8=false",
                               "memory.blocks_to_swap=0", "data.buckets=false"])
    family = registry.get("qwen_image")
    src = resolve_model(cfg.model.path, family)
    the_plan, _ = cache.fill_cache(cfg, family, src, "cpu", progress=False)
    samples = cache.load_samples(cfg, family, src, "cpu", the_plan)
    return cfg, family, src, [s.variants[0] for s in samples]


@pytest.fixture()
def pipe(prepared):
    from diffusers import QwenImagePipeline

    _, _, src, _ = prepared
    pipe = QwenImagePipeline.from_pretrained(src.root)
    for m in (pipe.text_encoder, pipe.vae, pipe.transformer):
        own_module(m)
    return pipe


class Fixed:
    def __init__(self, noise: torch.Tensor, sigma: torch.Tensor):
        self.noise, self.sigma = noise, sigma

    def randn(self, shape, device=None, dtype=None):
        return self.noise.reshape(shape) if len(shape) > 1 else torch.logit(self.sigma)  # sigmoid(logit) = sigma


def test_the_template_is_cut_where_the_real_tokenizer_cuts_it(pipe) -> None:
    # The tiny tokenizer splits QwenImagePipeline's template as Qwen2.5-VL's does: 34 tokens before the
    # caption (the pipeline's prompt_template_encode_start_idx), 5 after it.
    before, after = qwen_model.TEMPLATE.split("{}")
    assert len(pipe.tokenizer(before).input_ids) == qwen_model.TEMPLATE_TOKENS == pipe.prompt_template_encode_start_idx
    assert len(pipe.tokenizer(after).input_ids) == 5
    assert qwen_model.TEMPLATE == pipe.prompt_template_encode and qwen_model.TEXT_MAX_LENGTH == pipe.tokenizer_max_length


def test_captions_are_the_pipelines_embeddings_and_latents_the_training_scripts(prepared, pipe) -> None:
    cfg, family, src, entries = prepared
    encoders = (pipe.tokenizer, pipe.text_encoder)
    for caption in ("a photo of sks toy on a wooden table", ""):
        want, mask = pipe._get_qwen_prompt_embeds([caption], device=torch.device("cpu"))
        got = family.encode_text(encoders, caption, 1024)["prompt_embeds"]
        # One encoder instance on the same tokens (the pipeline pads nothing for one prompt).
        assert torch.equal(got, want[0]) and bool(mask.all())
    # Cut at the cache's token length as the pipeline cuts at its own (1024): the templated text is
    # truncated, so the closing tokens go too.
    long = family.encode_text(encoders, "a photo of sks toy on a wooden table", 3)["prompt_embeds"]
    assert long.shape[0] == 3
    assert family.count_tokens(encoders, "a photo of sks toy", 32) == {"Qwen2.5-VL": (5 + 5, 32)}

    # diffusers' train_dreambooth_lora_qwen_image.py: (mode - latents_mean) * (1 / latents_std), on [B, C, 1, H, W].
    pixels = torch.rand(1, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():
        want = (vae.encode(pixels[:, :, None]).latent_dist.mode() - mean) * inv_std
    got = family.encode_image(vae, pixels)["latents"]
    assert got.shape == (16, 8, 6) and torch.equal(got, want[0, :, 0])
    # ... and the pipeline's decode inverts it: x / (1 / std) + mean is the VAE's mean again.
    torch.testing.assert_close(got[None, :, None] / inv_std + mean, (want / inv_std + mean), rtol=0, atol=0)


def test_the_loss_is_the_transformers_prediction_as_the_pipeline_calls_it(prepared, pipe, monkeypatch) -> None:
    cfg, family, src, entries = prepared
    entry = entries[0]
    trainable = load_tiny(family, src, cfg)
    lat = entry["latents"][None]
    _, c, h, w = lat.shape
    x0 = pipe._pack_latents(lat, 1, c, h, w)  # QwenImagePipeline's packing
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.6])
    text = entry["prompt_embeds"][None]
    # The preset's sampling: a sigmoid of a normal draw (here logit(0.6)), shifted by e^mu for the image's
    # token count (the scheduler's dynamic shift).
    assert cfg.family.timestep_sampling == "shift" and cfg.family.resolution_dependent_shift
    e_mu = torch.exp(torch.tensor(trainable.shift_mu(x0.shape[1]), dtype=torch.float64))
    sig = (e_mu / (e_mu + (1 / sigma.double() - 1))).float()
    with torch.no_grad():
        # As QwenImagePipeline.__call__ calls it: t / 1000, img_shapes per sample, no guidance embedding.
        pred = trainable.model(hidden_states=(1 - sig) * x0 + sig * noise, timestep=sig, guidance=None,
                               encoder_hidden_states_mask=None, encoder_hidden_states=text,
                               img_shapes=[[(1, h // 2, w // 2)]], return_dict=False)[0]
        reference = torch.nn.functional.mse_loss(pred, noise - x0)
        monkeypatch.setattr(flow_matching, "draws", lambda generator: Fixed(noise, sigma))
        ours = trainable.loss({k: v[None] for k, v in entry.items()}, torch.Generator())
    # sigma is computed in float64 here and in Python floats there (then float32): a last-bit
    # difference in sigma moves the loss by at most a few float32 ulps.
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=0)


def test_the_shift_is_the_schedulers_dynamic_shift(prepared, pipe) -> None:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    _, _, src, _ = prepared
    mu = qwen_model.shift_mu(src.root)
    c = pipe.scheduler.config
    for tokens in (256, 1024, 4096, 8192):
        want = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        assert mu(tokens) == pytest.approx(want, rel=1e-12)
    assert round(float(torch.exp(torch.tensor(mu(4096)))), 2) == 2.0  # 1024²: about 2.0


def test_captions_of_other_lengths_are_padded_and_masked(prepared) -> None:
    cfg, family, src, entries = prepared
    a, b = entries
    b = {**b, "latents": a["latents"], "prompt_embeds": b["prompt_embeds"][:-2]}  # one bucket, shorter text
    assert a["prompt_embeds"].shape[0] != b["prompt_embeds"].shape[0]
    batch = family.collate([a, b])
    n = max(a["prompt_embeds"].shape[0], b["prompt_embeds"].shape[0])
    assert batch["prompt_embeds"].shape == (2, n, a["prompt_embeds"].shape[1])
    assert batch["prompt_mask"].tolist() == [[i < e["prompt_embeds"].shape[0] for i in range(n)] for e in (a, b)]
    assert "prompt_mask" not in family.collate([a, a])  # equal lengths: no mask (the unmasked kernels)
    # Each sample's prediction in the padded batch is its prediction alone (the mask hides the padding):
    # the same math in batches of other shapes (float32 rounding: 1e-5).
    trainable = load_tiny(family, src, cfg)
    _, _, h, w = batch["latents"].shape
    packed = flow_matching.pack_latents(batch["latents"])

    def predict(rows: slice, embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        m = len(range(2)[rows])
        return trainable.model(hidden_states=packed[rows], encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                               timestep=torch.full((m,), 0.5), img_shapes=[[(1, h // 2, w // 2)]] * m,
                               return_dict=False)[0]

    with torch.no_grad():
        both = predict(slice(0, 2), batch["prompt_embeds"], batch["prompt_mask"])
        for i, e in enumerate((a, b)):
            alone = predict(slice(i, i + 1), e["prompt_embeds"][None], None)
            torch.testing.assert_close(both[i], alone[0], rtol=1e-5, atol=1e-6)
        unmasked = predict(slice(0, 2), batch["prompt_embeds"], None)
    assert not torch.allclose(unmasked[1], both[1], rtol=1e-3, atol=1e-4)  # the padding would matter


def test_the_last_blocks_text_outputs_take_no_adapter_and_every_adapter_learns(prepared) -> None:
    cfg, family, src, entries = prepared
    swap = resolve_swap(family, cfg.replace(lora={"type": "dora"}), src)
    trainable = family.load_trainable(src, cfg.replace(lora={"type": "dora"}), torch.device("cpu"), torch.float32, swap)
    lora.inject(trainable.model, family, cfg.replace(lora={"type": "dora"}).lora, seed=0)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in trainable.model.named_modules() if n.endswith(".lora_A")}
    last = len(trainable.model.transformer_blocks) - 1
    assert f"transformer_blocks.{last}.attn.add_k_proj" in adapted and "transformer_blocks.0.txt_mlp.net.2" in adapted
    assert not adapted & set(qwen_model.unused_outputs(trainable.model))
    assert len(adapted) == 12 * (last + 1) - 4
    loss = trainable.loss(family.collate([entries[0]]), torch.Generator().manual_seed(0))
    loss.backward()
    assert all(p.grad is not None for n, p in trainable.model.named_parameters() if p.requires_grad)


def test_blocks_to_swap_counts_blocks_and_says_the_largest(prepared) -> None:
    cfg, family, src, _ = prepared
    counts = family.block_counts(src)
    assert counts == [3] and family.swap_counts(counts, family.with_blocks_to_swap(cfg, 2)) == [2]
    with pytest.raises(ImgloraError, match=r"memory.blocks_to_swap = 4, but Qwen-Image has only 3 blocks .* 3$"):
        family.swap_counts(counts, family.with_blocks_to_swap(cfg, 4))
    two = resolve_swap(family, family.with_blocks_to_swap(cfg, 2), src)
    assert two.modules() == {"transformer_blocks.1", "transformer_blocks.2"} and family.full_block_counts(cfg) == [60]


def test_the_comfyui_workflow_loads_the_split_files_and_samples_with_real_cfg() -> None:
    from imglora.export.workflows import to_api

    family = registry.get("qwen_image")
    api = to_api(family.comfyui_nodes("mine.safetensors", "a photo of sks toy", "", 7, "imglora/mine", False))
    by_type = {v["class_type"]: v["inputs"] for v in api.values()}
    assert by_type["CLIPLoader"] == {"clip_name": "qwen_2.5_vl_7b_fp8_scaled.safetensors", "type": "qwen_image"}
    assert by_type["UNETLoader"]["unet_name"] == "qwen_image_fp8_e4m3fn.safetensors"
    assert by_type["VAELoader"] == {"vae_name": "qwen_image_vae.safetensors"}
    assert by_type["ModelSamplingAuraFlow"]["shift"] == 3.1
    assert by_type["LoraLoaderModelOnly"]["lora_name"] == "mine.safetensors"
    k = by_type["KSampler"]
    assert (k["steps"], k["cfg"], k["sampler_name"], k["scheduler"]) == (20, 2.5, "euler", "simple")
    aura = next(i for i, v in api.items() if v["class_type"] == "ModelSamplingAuraFlow")
    assert k["model"] == [aura, 0]  # the LoRA'd model goes through the shift node to the sampler


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory, sample_dataset):
    """4 updates with the preset's FP8 base and a swapped block, batch 2 (captions of other lengths
    padded and masked), a checkpoint every 2."""
    from imglora.commands.train import train

    root = tmp_path_factory.mktemp("qwen")
    data = root / "data"
    data.mkdir()
    for stem in ("01_sky", "02_grass", "03_table", "04_wall"):
        for f in sample_dataset.glob(f"{stem}.*"):
            shutil.copy(f, data / f.name)
    q = lambda p: json.dumps(str(p))  # noqa: E731
    cfg = load_config(PRESET, [f"data.dir={q(data)}", f"cache.dir={q(root / 'cache')}", f"run.output_dir={q(root / 'runs')}",
                               "data.buckets=false", "data.resolution=64", "train.batch_size=2", "train.max_steps=4",
                               "train.warmup_steps=0", "train.log_every=1", "train.checkpoint_every=2",
                               "eval.strengths=[0, 1]", "eval.sample_steps=2"])
    assert cfg.memory.fp8 and cfg.memory.blocks_to_swap == 1
    return cfg, train(cfg, out=lambda s: None)


@pytest.mark.slow  # (the default run keeps under 6 minutes; CI runs it)
def test_a_resumed_run_ends_exactly_as_an_uninterrupted_one(qwen_run, tmp_path: Path) -> None:
    cfg, result = qwen_run
    assert len(assert_resumes_exactly(cfg, result, tmp_path)) == 4


@pytest.mark.slow  # (the default run keeps under 6 minutes; CI runs it)
def test_eval_at_strength_0_is_the_base_pipeline_with_real_cfg(qwen_run) -> None:
    import numpy as np
    from diffusers import QwenImagePipeline
    from PIL import Image

    from imglora.commands.evaluate import evaluate

    cfg, _ = qwen_run
    result = evaluate(cfg.run_dir, overrides=['eval.fp8="off"', "eval.blocks_to_swap=0"], out=lambda s: None)
    (step,) = result.images
    prompt = registry.get("qwen_image").default_prompts(cfg)[0]
    pipe = QwenImagePipeline.from_pretrained(resolve_model("tiny:qwen_image", registry.get("qwen_image")).root)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            own_module(component)
    pipe.set_progress_bar_config(disable=True)
    side = cfg.data.resolution
    base = pipe(prompt=prompt, negative_prompt=" ", true_cfg_scale=2.5, height=side, width=side, num_inference_steps=2,
                generator=torch.Generator().manual_seed(0)).images[0]
    got = [np.asarray(Image.open(p).convert("RGB")) for p in result.images[step][0]]
    assert got[0].shape == (side, side, 3) and np.array_equal(got[0], np.asarray(base))
    assert not np.array_equal(got[1], np.asarray(base))  # the adapter at strength 1 changes the image
