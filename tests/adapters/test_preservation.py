"""Output preservation (train.dop_weight, train.blank_preservation_weight): the other captions are
cached and batched beside the image's own, the loss adds weight x MSE(adapter's prediction, base
model's prediction) on the same noisy latents, the config refuses what cannot work, and the plan
counts the extra passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imglora.adapters import inject as lora, preservation
from imglora.training import step as loop
from imglora.plan import predict as plan, timing as plan_time
from imglora.commands.common import family_of, load_config
from imglora.data import cache
from imglora.data.batches import Batcher
from imglora.errors import ConfigError
from imglora.models.resolve import resolve_model
from imglora.memory.wrap import resolve_swap
from loading import load_tiny

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-flux.toml"
DOP = ["train.dop_weight=0.7", 'train.dop_class="ball"', "train.blank_preservation_weight=0.3",
       'data.trigger_word="sks toy"', "memory.fp8=false", "memory.blocks_to_swap=0", "data.buckets=false"]


@pytest.fixture()
def prepared(small_run):
    cfg = load_config(PRESET, [*small_run(("01_sky", "03_table")), *DOP])
    family = family_of(cfg)
    src = resolve_model(cfg.model, family)
    the_plan, _ = cache.fill_cache(cfg, family, src, "cpu", progress=False)
    return cfg, family, src, the_plan


def test_the_class_and_empty_captions_are_cached_and_batched_beside_the_image(prepared) -> None:
    cfg, family, src, the_plan = prepared
    captions = {i.path.stem: i.caption for i in the_plan.scan.items}
    assert all(c.startswith("sks toy") for c in captions.values())
    want = {stem: {"dop": "ball" + c[len("sks toy"):], "blank": ""} for stem, c in captions.items()}
    assert {i.path.stem: p for i, p in the_plan.preserve.items()} == want
    assert set(the_plan.texts) == {*captions.values(), *(w["dop"] for w in want.values()), ""}
    samples = cache.load_samples(cfg, family, src, "cpu", the_plan)
    batch = Batcher(samples, 2, seed=0, collate=family.collate).batch(0, torch.device("cpu"))
    stores = cache.Cache(cfg.cache.dir)
    for prefix, text in (("dop.", want["01_sky"]["dop"]), ("blank.", "")):
        entry = stores.get("text", the_plan.texts[text].key)
        row = [i for i, s in enumerate(samples) if s.preserve[prefix[:-1]]["prompt_embeds"].equal(entry["prompt_embeds"])]
        assert row and torch.equal(batch[f"{prefix}prompt_embeds"][row[0]], entry["prompt_embeds"])
        assert torch.equal(batch[f"{prefix}latents"], batch["latents"])  # the same images (and posterior draws)


def test_the_loss_adds_the_weighted_distance_to_the_base_models_prediction(prepared) -> None:
    cfg, family, src, the_plan = prepared
    samples = cache.load_samples(cfg, family, src, "cpu", the_plan)
    batch = Batcher(samples, 2, seed=0, collate=family.collate).batch(0, torch.device("cpu"))
    inner = load_tiny(family, src, cfg)
    lora.inject(inner.model, family, cfg.lora, seed=0)
    g = torch.Generator().manual_seed(3)
    for n, p in inner.model.named_parameters():
        if "lora_" in n:  # B starts at zero: the adapter would change nothing
            p.data = torch.randn(p.shape, generator=g) * 0.1
    wrapped = preservation.wrap(inner, cfg)
    assert wrapped.model is inner.model and wrapped.facts == inner.facts

    def predict(prefix: str, strength: float) -> torch.Tensor:
        out = []
        hook = inner.model.register_forward_hook(lambda m, a, o: out.append(o[0]))
        lora.set_strength(inner.model, strength)
        try:
            with torch.no_grad():
                inner.loss({k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix)},
                           torch.Generator().manual_seed(11))
        finally:
            hook.remove()
            lora.set_strength(inner.model, 1.0)
        return out[0]

    with torch.no_grad():
        own = inner.loss({k: v for k, v in batch.items() if "." not in k}, torch.Generator().manual_seed(11))
        terms = {p: torch.nn.functional.mse_loss(predict(p, 1.0), predict(p, 0.0)) for p in ("dop.", "blank.")}
        got = wrapped.loss(batch, torch.Generator().manual_seed(11))
    assert all(t > 0 for t in terms.values())
    torch.testing.assert_close(got, own + 0.7 * terms["dop."] + 0.3 * terms["blank."], rtol=1e-6, atol=0)
    # The term trains the adapter only (the target has no gradient) and vanishes when it changes nothing.
    loss = wrapped.loss(batch, torch.Generator().manual_seed(11))
    loss.backward()
    assert all(p.grad is None for n, p in inner.model.named_parameters() if "lora_" not in n)
    assert any(p.grad.abs().sum() > 0 for n, p in inner.model.named_parameters() if "lora_B" in n)


def test_what_cannot_work_is_refused_at_once() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(PRESET, ["train.dop_weight=1.0", 'data.trigger_word=""'])
    msg = str(exc.value)
    assert "train.dop_class: train.dop_weight = 1 needs the class word" in msg
    assert "train.dop_weight: differential output preservation replaces the trigger word" in msg
    with pytest.raises(ConfigError, match="train.dop_class: is read only with train.dop_weight > 0"):
        load_config(PRESET, ['train.dop_class="dog"'])
    with pytest.raises(ConfigError, match="output preservation denoises other captions with cached text-encoder "
                                          "outputs, and lora.text_encoder trains the text encoders"):
        load_config(REPO / "presets" / "tiny-sdxl.toml", ["train.blank_preservation_weight=1", "lora.text_encoder=true"])
    with pytest.raises(ConfigError, match=r"train.blank_preservation_weight: output preservation is for the image "
                                          r"families \(sdxl, flux"):
        load_config(REPO / "presets" / "tiny-llm.toml", ["train.blank_preservation_weight=1"])


@pytest.mark.slow  # (two plans and a real step: 11 s; CI runs it)
def test_the_plan_counts_the_extra_passes() -> None:
    cfg = load_config(PRESET, ["memory.fp8=false", "memory.blocks_to_swap=0"])
    with_dop = cfg.replace(train={"dop_weight": 1.0, "dop_class": "ball"}, data={"trigger_word": "sks toy"})
    family = family_of(cfg)
    src = resolve_model(cfg.model, family)
    setting = [plan.Setting("model", 0)]
    h200 = plan_time.gpu("h200")
    base, dop = (plan.predict(c, family, setting, device_kind="cpu", src=src, time_device=h200).settings[0]
                 for c in (cfg, with_dop))
    # One forward without gradient and one with, and its backward: about 1 + 1/4 + 1 updates of work.
    ratio = dop.predicted.seconds / base.predicted.seconds
    assert 1.8 < ratio < 2.6, ratio
    assert dop.term("activations_saved") > base.term("activations_saved")
    # ... and the memory prediction holds against a real step of the wrapped trainable (within 10 %).
    swap = resolve_swap(family, with_dop, src)
    trainable = preservation.wrap(family.load_trainable(src, with_dop, torch.device("cpu"), torch.float32, swap),
                                  with_dop)
    session = loop.build_session(with_dop, family, trainable, loop.accelerator_for(with_dop), swap=swap, total=10,
                                 out=lambda s: None)
    batch = preservation.synthetic(family.synthetic_batch(trainable, with_dop.data.resolution, with_dop,
                                                          torch.device("cpu")), with_dop)
    real = loop.measured_peak(session, batch)
    assert 0.9 * real <= dop.device_peak <= 1.1 * real, (dop.device_peak, real)
