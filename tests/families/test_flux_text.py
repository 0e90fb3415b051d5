"""FLUX.1's text: T5's attention mask as kohya applies it (``[flux] apply_t5_attn_mask``: T5 reads
the tokenizer's mask, the transformer's joint attention ignores the padding), keyed in the text
cache; FLUX.1-schnell's 256 T5 tokens by default (dev: 512)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from imglora.commands.common import load_config
from imglora.data import cache
from imglora.family import text_length
from imglora.families import registry
from imglora.families.flux import model as flux_model
from imglora.models.resolve import resolve_model
from loading import load_tiny

REPO = Path(__file__).resolve().parents[2]


def config(small_run, *extra: str):
    return load_config(REPO / "presets" / "tiny-flux.toml", [*small_run(("03_table",)), "memory.fp8=false",
                                                              "memory.blocks_to_swap=0", *extra])


def cached(cfg):
    family = registry.get("flux")
    src = resolve_model(cfg.model.path, family)
    the_plan, _ = cache.fill_cache(cfg, family, src, "cpu", progress=False)
    (sample,) = cache.load_samples(cfg, family, src, "cpu", the_plan)
    return family, src, the_plan, sample.variants[0]


def test_t5_reads_its_mask_and_the_mask_keys_the_text_cache(small_run) -> None:
    from transformers import T5EncoderModel, T5TokenizerFast

    _, _, plain_plan, plain = cached(config(small_run))
    family, src, plan, entry = cached(config(small_run, "flux.apply_t5_attn_mask=true"))
    assert "text_mask" not in plain and plan.text_options == {"t5_attention_mask": True}
    (caption,) = plan.texts
    assert plan.texts[caption].key != plain_plan.texts[caption].key  # the flag keys the entry
    assert [s.key for s in plan.latents] == [s.key for s in plain_plan.latents]  # latents are not affected
    tok = T5TokenizerFast.from_pretrained(src.root, subfolder="tokenizer_2")
    t = tok(caption, padding="max_length", max_length=32, truncation=True, return_tensors="pt")
    assert entry["text_mask"].dtype == torch.bool and torch.equal(entry["text_mask"], t.attention_mask[0].bool())
    assert 0 < int(entry["text_mask"].sum()) < 32
    t5 = T5EncoderModel.from_pretrained(src.root, subfolder="text_encoder_2").eval()
    with torch.no_grad():
        want = t5(t.input_ids, attention_mask=t.attention_mask)[0][0]  # kohya's encode_tokens with the mask
    # Two instances of the same T5 on the same tokens: float32 rounding may differ in the last bits.
    torch.testing.assert_close(entry["prompt_embeds"], want, rtol=1e-5, atol=4e-6)
    assert not torch.allclose(plain["prompt_embeds"], entry["prompt_embeds"], rtol=1e-3, atol=1e-4)


def test_the_masked_loss_is_kohyas_and_ignores_the_padding(small_run, monkeypatch) -> None:
    family, src, plan, entry = cached(config(small_run, "flux.apply_t5_attn_mask=true"))
    cfg = config(small_run, "flux.apply_t5_attn_mask=true")
    trainable = load_tiny(family, src, cfg)
    batch = {k: v[None] for k, v in entry.items()}

    def loss(b):
        with torch.no_grad():
            return trainable.loss(b, torch.Generator().manual_seed(3))

    masked = loss(batch)
    pads = ~batch["text_mask"][0]
    noisy = batch["prompt_embeds"].clone()
    noisy[0, pads] = torch.randn(int(pads.sum()), noisy.shape[-1], generator=torch.Generator().manual_seed(1))
    # The padding's embeddings reach no other token: their attention weights are exactly 0 (softmax of
    # -inf); the sums run over other values in the same order (float32: 1e-6 for safety).
    torch.testing.assert_close(loss({**batch, "prompt_embeds": noisy}), masked, rtol=1e-6, atol=0)
    unmasked = {k: v for k, v in batch.items() if k != "text_mask"}
    assert abs(loss({**unmasked, "prompt_embeds": noisy}).item() - loss(unmasked).item()) > 1e-5

    # kohya's mask: the keys of the joint sequence, text as the tokenizer's mask says, every image token.
    lat = batch["latents"]
    x0 = flux_model.pack_latents(lat)
    mask = torch.cat([batch["text_mask"], torch.ones(1, x0.shape[1], dtype=torch.bool)], 1)[:, None, None, :]
    assert torch.equal(flux_model.attention_mask(batch["text_mask"], x0.shape[1]), mask)


def test_schnell_reads_256_t5_tokens_unless_the_preset_says(small_run, tmp_path: Path) -> None:
    family = registry.get("flux")
    tiny = resolve_model("tiny:flux", family)
    schnell = tmp_path / "schnell"
    shutil.copytree(tiny.root, schnell, ignore=shutil.ignore_patterns("*.safetensors"))
    c = json.loads((schnell / "transformer" / "config.json").read_text())
    (schnell / "transformer" / "config.json").write_text(json.dumps({**c, "guidance_embeds": False}))
    from imglora.models.source import ModelSource

    cfg = config(small_run, "cache.text_max_length=0")
    assert text_length(family, cfg, ModelSource(schnell, {})) == 256
    assert text_length(family, cfg, tiny) == 512
    assert text_length(family, config(small_run), ModelSource(schnell, {})) == 32  # the preset's own


def test_the_export_header_and_the_evaluation_say_the_mask_was_used(small_run) -> None:
    family, src, _, entry = cached(config(small_run, "flux.apply_t5_attn_mask=true"))
    cfg = config(small_run, "flux.apply_t5_attn_mask=true")
    assert family.export_metadata(cfg, {})["ss_apply_t5_attn_mask"] is True
    assert family.export_metadata(config(small_run), {})["ss_apply_t5_attn_mask"] is False
    assert registry.get("chroma").export_metadata(load_config(REPO / "presets" / "tiny-chroma.toml"),
                                                  {})["ss_apply_t5_attn_mask"] is True
    # The evaluation samples as trained: every transformer call gets the prompt's mask.
    trainable = load_tiny(family, src, cfg)
    seen = []

    def sample(embeds, seed):  # stands in for the pipeline: one transformer call, what it was given recorded
        handle = trainable.model.register_forward_pre_hook(
            lambda m, a, kw: seen.append((kw.get("joint_attention_kwargs") or {}).get("attention_mask")),
            with_kwargs=True)
        h = torch.zeros(1, 4, trainable.model.config.in_channels)
        trainable.model(hidden_states=h, encoder_hidden_states=embeds["prompt_embeds"][None],
                        pooled_projections=embeds["pooled_prompt_embeds"][None], timestep=torch.ones(1),
                        img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(32, 3), guidance=torch.ones(1))
        handle.remove()
        return "image"

    sample.settings = {}
    masked = flux_model.masked_sampler(sample, trainable.model)
    with torch.no_grad():
        assert masked(entry, 0) == "image" and masked.settings["t5_attention_mask"] is True
    assert torch.equal(seen[-1], flux_model.attention_mask(entry["text_mask"][None], 4))
    assert not trainable.model._forward_pre_hooks  # the mask's hook is gone after the call


def test_the_mask_stays_when_clip_l_trains_with_the_adapter(small_run) -> None:
    # lora.text_encoder: CLIP-L's output is computed per step from tokens; T5's output and its mask stay cached.
    cfg = config(small_run, "flux.apply_t5_attn_mask=true", "lora.text_encoder=true")
    family, src, plan, entry = cached(cfg)
    assert {"prompt_embeds", "text_mask", "input_ids"} <= set(entry) and "pooled_prompt_embeds" not in entry
