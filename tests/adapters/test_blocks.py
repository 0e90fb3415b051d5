"""lora.blocks / block_ranks / block_alphas / block_lr: which blocks get the adapter and at what rank,
alpha and learning rate (kohya's block selection, block_dims / block_alphas and lr weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

from imglora.adapters import inject as lora
from imglora.commands.common import load_config
from imglora.commands.train import train
from imglora.errors import ConfigError
from imglora.families import registry
from imglora.models.resolve import resolve_model
from imglora.memory.wrap import resolve_swap

REPO = Path(__file__).resolve().parents[2]


def injected(preset: str, *overrides: str):
    cfg = load_config(REPO / "presets" / f"{preset}.toml", ["memory.fp8=false", "memory.blocks_to_swap=0", *overrides])
    family = registry.get(cfg.model.family)
    src = resolve_model(cfg.model.path, family)
    trainable = family.load_trainable(src, cfg, torch.device("cpu"), torch.float32, resolve_swap(family, cfg, src))
    lora.inject(trainable.model, family, cfg.lora, seed=0)
    adapted = {n: m for n, m in trainable.model.named_modules() if isinstance(m, BaseTunerLayer)}
    return cfg, family, trainable.model, adapted


def test_every_problem_with_the_selectors_is_named_at_once() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "presets" / "tiny-flux.toml", [
            'lora.blocks=["double:0-1", "triple", "single:4-2", "double:x"]', 'lora.block_ranks={"single" = 2.5}',
            'lora.block_lr={"double" = 0}', 'lora.block_alphas={"up" = 4}'])
    msg = "\n".join(e.value.problems)
    assert "'triple': no block kind 'triple' in this model; its kinds are double, single" in msg
    assert "'single:4-2': the range ends before it starts" in msg
    assert "'double:x' is not a block selector: write <kind>, <kind>:<index> or <kind>:<first>-<last>" in msg
    assert "lora.block_ranks: 'single' = 2.5; expected a whole number from 1 to 1024" in msg
    assert "lora.block_lr: 'double' = 0; expected a multiplier above 0" in msg and "'up': no block kind" in msg
    with pytest.raises(ConfigError, match=r"lora.blocks: block selection is for the image families; the llm family"):
        load_config(REPO / "presets" / "tiny-llm.toml", ['lora.blocks=["layer:0"]'])
    with pytest.raises(ConfigError, match=r"LoKr's rank is of its factors"):
        load_config(REPO / "presets" / "tiny-flux.toml", ['lora.type="lokr"', 'lora.block_ranks={"double" = 2}'])


def test_only_the_selected_blocks_get_the_adapter_at_their_rank_and_alpha() -> None:
    cfg, family, model, adapted = injected("tiny-flux", 'lora.blocks=["double:1-2", "single:5"]',
                                           'lora.block_ranks={"double:2" = 2}', 'lora.block_alphas={"single" = 1.0}')
    blocks = {".".join(n.split(".")[:2]) for n in adapted}
    assert blocks == {"transformer_blocks.1", "transformer_blocks.2", "single_transformer_blocks.5"}
    # every default target of those blocks, and nothing else (FLUX's final proj_out stays out)
    assert len(adapted) == 2 * 12 + 5 and "proj_out" not in adapted
    r = {n: m.r["default"] for n, m in adapted.items()}
    scale = {n: m.scaling["default"] for n, m in adapted.items()}
    assert r["transformer_blocks.2.attn.to_q"] == 2 and r["transformer_blocks.1.attn.to_q"] == cfg.lora.rank == 8
    assert scale["transformer_blocks.2.attn.to_q"] == cfg.lora.alpha / 2  # the block's rank, lora.alpha
    assert scale["single_transformer_blocks.5.proj_out"] == 1.0 / 8  # the block's alpha
    with pytest.raises(ConfigError, match=r"'single:9': the model has 8 single blocks \(0-7\)"):
        injected("tiny-flux", 'lora.blocks=["single:9"]')


def test_sdxl_selects_down_mid_and_up_and_mid_takes_no_index() -> None:
    _, _, _, adapted = injected("tiny-sdxl", 'lora.blocks=["mid", "up:1"]')
    assert {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("up_") else "") for n in adapted} == {
        "mid_block", "up_blocks.1"}
    with pytest.raises(ConfigError, match=r"'mid:0': mid is one block here; write 'mid' without an index"):
        injected("tiny-sdxl", 'lora.blocks=["mid:0"]')


def test_block_learning_rates_and_lora_plus_make_the_optimizer_groups() -> None:
    cfg, family, model, adapted = injected("tiny-flux", 'lora.block_lr={"single" = 0.5, "single:3" = 2.0}')
    multipliers = lora.block_multipliers(model, family, cfg.lora)
    assert multipliers["single_transformer_blocks.0.proj_out"] == 0.5  # a later selector wins where two name a block
    assert multipliers["single_transformer_blocks.3.proj_out"] == 2.0 and "transformer_blocks.0.attn.to_q" not in multipliers
    groups = lora.parameter_groups(model, 1e-3, 4.0, multipliers)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert lr_of[id(named["transformer_blocks.0.attn.to_q.lora_A.default.weight"])] == pytest.approx(1e-3)
    assert lr_of[id(named["transformer_blocks.0.attn.to_q.lora_B.default.weight"])] == pytest.approx(4e-3)
    assert lr_of[id(named["single_transformer_blocks.1.proj_out.lora_A.default.weight"])] == pytest.approx(5e-4)
    assert lr_of[id(named["single_transformer_blocks.3.proj_out.lora_B.default.weight"])] == pytest.approx(8e-3)
    assert sum(len(g["params"]) for g in groups) == sum(1 for p in model.parameters() if p.requires_grad)
    # without either setting: one group, as before
    assert len(lora.parameter_groups(model, 1e-3)) == 1


@pytest.mark.slow  # (the default run keeps under 6 minutes; CI runs it)
def test_a_run_with_block_settings_resumes_exactly(small_run, tmp_path: Path) -> None:
    base = [*small_run(("01_sky", "03_table")), "train.max_steps=4", "train.warmup_steps=0", "train.log_every=1",
            "train.checkpoint_every=2", 'lora.blocks=["double:0-1", "single"]', 'lora.block_ranks={"single:0-1" = 4}',
            'lora.block_lr={"double" = 3.0}']
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", base)
    whole = train(cfg, out=lambda s: None)
    cut = load_config(REPO / "presets" / "tiny-flux.toml", [*base, "train.max_steps=2", "run.name=cut"])
    train(cut, out=lambda s: None)
    resumed = train(load_config(REPO / "presets" / "tiny-flux.toml", [*base, "run.name=cut"]), resume=True,
                    out=lambda s: None)
    a, b = load_file(str(whole.adapter)), load_file(str(resumed.adapter))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = lambda r: [json.loads(x)["loss"] for x in (r.run_dir / "log.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(resumed) == losses(whole)
