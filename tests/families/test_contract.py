"""One contract, every image family: cache encodings, loss, gradients, adapter round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from imglora.commands.common import load_config
from imglora.adapters import inject as lora
from imglora.data import cache
from imglora.families import get_family
from imglora.models.resolve import resolve_model
from imglora.commands.train import train
from imglora.memory.wrap import resolve_swap
from loading import load_tiny

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ["sdxl", "flux"]


@pytest.fixture()
def small(small_run):
    # a square and a landscape image: two buckets
    return small_run(("01_sky", "03_table")) + ["train.max_steps=3", "train.checkpoint_every=0", "train.log_every=1",
                                                 "train.warmup_steps=0"]


def load(family: str, overrides, *extra):
    return load_config(REPO / "presets" / f"tiny-{family.replace('_', '-')}.toml", [*overrides, *extra])


@pytest.mark.parametrize("name", FAMILIES)
def test_encode_shapes_and_loss(name: str, small) -> None:
    cfg = load(name, small)
    family = get_family(name)
    model_dir = resolve_model(cfg.model.path, get_family(name))
    the_plan, _ = cache.fill_cache(cfg, family, model_dir, "cpu", progress=False)
    samples = cache.load_samples(cfg, family, model_dir, "cpu", the_plan)
    assert len(samples) == 2
    for s in samples:
        w, h = s.bucket
        e = s.variants[0]
        channels = 4 if name == "sdxl" else 16
        assert e["latents"].shape == (channels, h // 8, w // 8)
        assert e["time_ids"].shape == (6,)
        length = 77 if name == "sdxl" else 32
        assert e["prompt_embeds"].shape[0] == length and e["pooled_prompt_embeds"].shape == (32,)
    trainable = load_tiny(family, model_dir, cfg)
    lora.inject(trainable.model, family, cfg.lora, seed=0)
    batch = {k: v[None] for k, v in samples[0].variants[0].items()}
    loss = trainable.loss(batch, torch.Generator().manual_seed(0))
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    named = dict(trainable.model.named_parameters())
    assert all((p.grad is not None) == ("lora_" in n) for n, p in named.items())
    assert any(p.grad.abs().sum() > 0 for n, p in named.items() if "lora_A" in n or "lora_B" in n)


def test_flux_lora_targets_stay_inside_the_blocks() -> None:
    family = get_family("flux")
    cfg = load_config(REPO / "presets" / "tiny-flux.toml")
    src = resolve_model("tiny:flux", family)
    trainable = family.load_trainable(src, cfg, torch.device("cpu"), torch.float32, resolve_swap(family, cfg, src))
    lora.inject(trainable.model, family, cfg.lora, seed=0)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in trainable.model.named_modules() if n.endswith(".lora_A")}
    assert "proj_out" not in adapted  # the final projection has the same name as single blocks' proj_out
    assert "single_transformer_blocks.0.proj_out" in adapted
    assert "transformer_blocks.0.attn.add_q_proj" in adapted and "transformer_blocks.3.ff_context.net.2" in adapted
    assert all(n.startswith(("transformer_blocks.", "single_transformer_blocks.")) for n in adapted)


@pytest.mark.parametrize("name", [pytest.param("sdxl", marks=pytest.mark.slow), "flux"])  # (the 6-minute default run)
def test_adapter_round_trips_through_diffusers(name: str, small) -> None:
    import diffusers

    cfg = load(name, small, "lora.alpha=2", "memory.fp8=false", "memory.blocks_to_swap=0")
    result = train(cfg, out=lambda s: None)
    family = get_family(name)
    model_dir = resolve_model(cfg.model.path, get_family(name))
    weights = load_file(str(result.adapter))
    assert all(k.startswith(f"{family.denoiser}.") for k in weights)

    trainable = load_tiny(family, model_dir, cfg)
    model = trainable.model.eval()
    lora.inject(model, family, cfg.lora, seed=0)
    lora.load_adapter_state(model, {k.split(".", 1)[1]: v for k, v in weights.items()})
    pipe = getattr(diffusers, family.pipeline).from_pretrained(model_dir.root)
    pipe.load_lora_weights(str(result.adapter.parent))
    loaded = getattr(pipe, family.denoiser)
    samples = cache.load_samples(cfg, family, model_dir, "cpu",
                                 cache.plan(cfg, family, model_dir, "cpu"))
    batch = {k: v[None] for k, v in samples[0].variants[0].items()}
    with torch.no_grad():
        a = trainable.loss(batch, torch.Generator().manual_seed(3))
        trainable.model = loaded
        b = trainable.loss(batch, torch.Generator().manual_seed(3))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_flux_training_with_swap_equals_without(small) -> None:
    # One intra-op thread: with several, some CPUs' kernels split reductions differently from run to
    # run, and Adam turns last-bit differences in near-zero gradients into visible ones. The swap
    # engine itself only moves the same bytes into other buffers; this checks that under a
    # deterministic schedule (tests/memory/test_swap.py checks outputs and gradients directly).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _swap_equals_without(small)
    finally:
        torch.set_num_threads(threads)


def _swap_equals_without(small) -> None:
    runs = {}
    for swap in (0, 4):
        cfg = load("flux", small, "memory.fp8=false", f"memory.blocks_to_swap={swap}", f"run.name=swap{swap}")
        result = train(cfg, out=lambda s: None)
        runs[swap] = (load_file(str(result.adapter)),
                      [json.loads(x)["loss"] for x in (cfg.run_dir / "log.jsonl").read_text().splitlines()])
    (a, loss_a), (b, loss_b) = runs[0], runs[4]
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


def test_flux_fp8_trains_and_stays_close(small) -> None:
    cfg = load("flux", small, "memory.blocks_to_swap=0", "run.name=fp8")
    lines: list[str] = []
    train(cfg, out=lines.append)
    assert any(line.startswith("fp8:") and "Linear layers quantized" in line for line in lines)
    from imglora.runs.record import read_records

    facts = read_records(cfg.run_dir, "train")[-1]["memory"]["fp8"]
    assert facts["bytes_after"] < facts["bytes_before"]
    assert "proj_out" in facts["kept_layers"] and "x_embedder" in facts["kept_layers"]
