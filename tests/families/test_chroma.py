"""Chroma: T5 alone with its attention mask, cached as ChromaPipeline encodes it; the loss as the
transformer computes it with a boolean mask; gradient checkpointing keeps the mask in the single
blocks (diffusers' own checkpointing drops it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from imglora.adapters import inject as lora
from imglora.commands.common import load_config
from imglora.data import cache
from imglora.families import registry
from imglora.families._shared import flow_matching
from imglora.models.resolve import resolve_model
from imglora.memory.wrap import resolve_swap
from loading import load_tiny

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-chroma.toml"


@pytest.fixture()
def prepared(tmp_path: Path, sample_dataset: Path):
    data = tmp_path / "data"
    data.mkdir()
    for f in sample_dataset.glob("03_table.*"):
        shutil.copy(f, data / f.name)
    q = lambda p: json.dumps(str(p))  # noqa: E731
    cfg = load_config(PRESET, [f"data.dir={q(data)}", f"cache.dir={q(tmp_path / 'cache')}",
                               f"run.output_dir={q(tmp_path / 'runs')}", "memory.fp8=false",
                               "memory.blocks_to_swap=0", 'chroma.timestep_sampling="uniform"'])
    family = registry.get("chroma")
    src = resolve_model(cfg.model.path, family)
    the_plan, _ = cache.fill_cache(cfg, family, src, "cpu", progress=False)
    (sample,) = cache.load_samples(cfg, family, src, "cpu", the_plan)
    return cfg, family, src, sample.variants[0]


class Fixed:
    def __init__(self, noise: torch.Tensor, sigma: torch.Tensor):
        self.noise, self.sigma = noise, sigma

    def randn(self, shape, device=None, dtype=None):
        return self.noise.reshape(shape)

    def rand(self, shape, device=None):
        return self.sigma


def test_text_is_chroma_pipelines_and_the_loss_its_transformers(prepared, monkeypatch) -> None:
    from diffusers import ChromaPipeline

    cfg, family, src, entry = prepared
    caption = (Path(cfg.data.dir) / "03_table.txt").read_text().strip()
    pipe = ChromaPipeline.from_pretrained(src.root)
    for m in (pipe.text_encoder, pipe.vae):
        from imglora.util.owned import own_module

        own_module(m)
    embeds, _, mask, *_ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, max_sequence_length=32,
                                            device=torch.device("cpu"))
    n_tokens = len(pipe.tokenizer(caption).input_ids)
    assert entry["text_mask"].dtype == torch.bool and int(entry["text_mask"].sum()) == n_tokens + 1 < 32
    assert torch.equal(mask[0] > 0, entry["text_mask"])  # the pipeline's float mask, as booleans
    # Two instances of the same T5 (the pipeline's, the cache's) on the same tokens and mask: float32
    # rounding differs in the last bits where their kernels take other paths (seen: 1e-6).
    torch.testing.assert_close(entry["prompt_embeds"], embeds[0], rtol=1e-5, atol=4e-6)

    trainable = load_tiny(family, src, cfg)
    lat = entry["latents"][None]
    _, c, h, w = lat.shape
    x0 = pipe._pack_latents(lat, 1, c, h, w)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.6])
    image_ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, torch.device("cpu"), torch.float32)
    attention = pipe._prepare_attention_mask(1, x0.shape[1], torch.float32, entry["text_mask"][None])
    with torch.no_grad():
        pred = trainable.model(hidden_states=(1 - sigma) * x0 + sigma * noise,
                               encoder_hidden_states=entry["prompt_embeds"][None],
                               timestep=sigma, img_ids=image_ids, txt_ids=torch.zeros(32, 3),
                               attention_mask=attention, return_dict=False)[0]
        reference = torch.nn.functional.mse_loss(pred, noise - x0)
        monkeypatch.setattr(flow_matching, "draws", lambda generator: Fixed(noise, sigma))
        ours = trainable.loss({k: v[None] for k, v in entry.items()}, torch.Generator())
    assert torch.equal(ours, reference)
    # The mask matters: the same step with every padding token attending gives another loss.
    with torch.no_grad():
        unmasked = trainable.loss({**{k: v[None] for k, v in entry.items()},
                                   "text_mask": torch.ones(1, 32, dtype=torch.bool)}, torch.Generator())
    assert not torch.equal(unmasked, ours)


def test_checkpointing_keeps_the_mask_in_the_single_blocks(prepared) -> None:
    cfg, family, src, entry = prepared
    batch = {k: v[None] for k, v in entry.items()}

    def loss_and_grads(checkpointing: bool, hooks: bool = True):
        run_cfg = cfg.replace(memory={"gradient_checkpointing": checkpointing})
        trainable = family.load_trainable(src, run_cfg, torch.device("cpu"), torch.float32,
                                          resolve_swap(family, run_cfg, src))
        lora.inject(trainable.model, family, cfg.lora, seed=0)
        for n, p in trainable.model.named_parameters():
            if "lora_B" in n:
                p.data = torch.full_like(p, 0.01)
        if not hooks:  # diffusers' checkpointing alone
            for block in trainable.model.single_transformer_blocks:
                block._forward_pre_hooks.clear()
        loss = trainable.loss(batch, torch.Generator().manual_seed(0))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in trainable.model.named_parameters() if p.grad is not None}

    plain, plain_grads = loss_and_grads(False)
    checked, checked_grads = loss_and_grads(True)
    # The same kernels on the same inputs, the forward run again in backward: equal up to the order
    # autograd accumulates the recomputed graph's gradients (float32, rtol 1e-5).
    torch.testing.assert_close(checked, plain, rtol=1e-6, atol=0)
    for n, g in plain_grads.items():
        torch.testing.assert_close(checked_grads[n], g, rtol=1e-5, atol=1e-7, msg=n)
    dropped, _ = loss_and_grads(True, hooks=False)
    assert abs(dropped.item() - plain.item()) > 1e-4  # what diffusers' checkpointing alone would train


def test_the_fp8_base_is_read_block_by_block_and_kept_for_the_next_run(prepared) -> None:
    cfg, family, src, entry = prepared
    fp8 = cfg.replace(memory={"fp8": True, "blocks_to_swap": 2})
    swap = resolve_swap(family, fp8, src)
    first = family.load_trainable(src, fp8, torch.device("cpu"), torch.float32, swap)
    assert first.facts["quantized_cache"]["hit"] is False
    again = load_tiny(family, src, fp8)
    assert again.facts["quantized_cache"]["hit"] is True, (first.facts, again.facts)
    a, b = first.model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys()
    batch = {k: v[None] for k, v in entry.items()}
    with torch.no_grad():
        assert torch.equal(first.loss(batch, torch.Generator().manual_seed(1)),
                           again.loss(batch, torch.Generator().manual_seed(1)))
    # The approximator (Chroma's modulations) and the embedders stay in full precision.
    kept = [n for n, m in again.model.named_modules() if type(m) is torch.nn.Linear]
    assert "distilled_guidance_layer.in_proj" in kept and "x_embedder" in kept and "proj_out" in kept
    assert "transformer_blocks.0.attn.to_q" not in kept


def test_the_comfyui_workflow_loads_t5_as_chroma_and_samples_with_real_cfg() -> None:
    from imglora.export import workflows as comfyui

    api = comfyui.to_api(registry.get("chroma").comfyui_nodes("c.safetensors", "a toy", "", 7, "x", False))
    by_type = {n["class_type"]: n["inputs"] for n in api.values()}
    assert by_type["CLIPLoader"] == {"clip_name": "t5xxl_fp16.safetensors", "type": "chroma"}
    assert by_type["UNETLoader"]["unet_name"] == "Chroma1-HD.safetensors"
    assert by_type["KSampler"]["cfg"] == 4.0 and by_type["KSampler"]["seed"] == 7
    assert "FluxGuidance" not in by_type and by_type["LoraLoaderModelOnly"]["lora_name"] == "c.safetensors"
    negative = api[by_type["KSampler"]["negative"][0]]["inputs"]["text"]
    assert negative and negative != "a toy"  # real CFG: a negative prompt that is evaluated
    for node in api.values():
        for value in node["inputs"].values():
            if isinstance(value, list):
                assert value[0] in api


def test_the_approximators_table_is_made_again_for_a_model_built_on_meta() -> None:
    from diffusers import ChromaTransformer2DModel

    from imglora.families.chroma.model import _meta, with_mod_proj
    from imglora.models.tiny import random_init

    root = resolve_model("tiny:chroma", registry.get("chroma")).root
    loaded = ChromaTransformer2DModel.from_pretrained(root, subfolder="transformer")
    built = with_mod_proj(random_init(_meta(root, torch.float32), torch.float32))  # to_empty: garbage before
    assert torch.equal(built.time_text_embed.mod_proj, loaded.time_text_embed.mod_proj)


def test_an_old_key_is_pointed_at_the_presets_own_family_section() -> None:
    from imglora.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.discrete_flow_shift: unknown key \(schema 2 moved it to "
                                          r"chroma.discrete_flow_shift\)"):
        load_config(PRESET, ["train.discrete_flow_shift=2.0"])
