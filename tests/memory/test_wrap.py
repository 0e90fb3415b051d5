"""apply_memory on its own: the order LoRA → fp8 → swap, the facts it records, and swap checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imglora.adapters import inject as lora
from imglora.commands.common import load_config
from imglora.errors import ImgloraError
from imglora.families import registry
from imglora.memory.wrap import apply_memory, check_swap_counts
from imglora.models.resolve import resolve_model

REPO = Path(__file__).resolve().parents[2]


def flux_model(*overrides: str):
    family = registry.get("flux")
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", list(overrides))
    model_dir = resolve_model(cfg.model.path, family)
    # Loaded unswapped: a swap count the model cannot take is refused at load too (tested below).
    trainable = family.load_trainable(model_dir, cfg.replace(memory={"blocks_to_swap": 0}), torch.device("cpu"),
                                      torch.float32)
    lora.inject(trainable.model, family, cfg.lora, seed=0)
    return family, cfg, model_dir, trainable.model


def test_fp8_then_swap_with_facts_for_the_record() -> None:
    family, cfg, _, model = flux_model("memory.fp8=true", "memory.blocks_to_swap=4")
    lines: list[str] = []
    setup = apply_memory(model, family, cfg, torch.device("cpu"), lines.append)
    facts = setup.facts
    assert facts["fp8"]["quantized_layers"] > 0 and facts["fp8"]["bytes_after"] < facts["fp8"]["bytes_before"]
    assert facts["swap"]["blocks_per_list"] == {"transformer_blocks": 2, "single_transformer_blocks": 4}
    assert setup.swapper is not None and setup.swapper.stats.n_swapped == 6
    assert any(line.startswith("fp8:") for line in lines) and any(line.startswith("block swap:") for line in lines)
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())


def test_a_swap_count_replaces_the_presets_through_the_config_and_zero_swaps_nothing() -> None:
    """The one route a count takes (evaluation, bench-swap, the plan): family.with_blocks_to_swap,
    which also unsets the preset's own double/single counts."""
    family, cfg, _, model = flux_model("memory.fp8=false", "memory.blocks_to_swap=0", "flux.double_blocks_to_swap=2",
                                       "flux.single_blocks_to_swap=3")
    assert family.swap_counts([2, 4], cfg) == [2, 3]
    four = family.with_blocks_to_swap(cfg, 4)
    assert (four.memory.blocks_to_swap, four.family.double_blocks_to_swap, four.family.single_blocks_to_swap) == (4, -1, -1)
    assert family.swap_counts([2, 4], four) == [2, 4]  # kohya's 4: 4//2 double, (4 - 2) * 2 single
    assert apply_memory(model, family, family.with_blocks_to_swap(cfg, 0), torch.device("cpu"),
                        lambda s: None).swapper is None


def test_swap_settings_the_model_cannot_take_are_refused_from_its_config() -> None:
    family, cfg, model_dir, _ = flux_model("memory.blocks_to_swap=11")
    with pytest.raises(ImgloraError, match="memory.blocks_to_swap = 11: swapping 11 blocks means 5 double"):
        check_swap_counts(family, model_dir, cfg)
    check_swap_counts(family, model_dir, family.with_blocks_to_swap(cfg, 4))  # a count that fits is fine
    with pytest.raises(ImgloraError, match="memory.blocks_to_swap = 11"):  # and loading refuses before reading
        family.load_trainable(model_dir, cfg, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("prefetch, depth, slots", [(0, 1, 2), (2, 2, 3)])
def test_the_prefetch_setting_in_the_record(prefetch, depth, slots) -> None:
    """0 is auto; on the CPU nothing is tuned (host copies are synchronous) and the record says why."""
    family, cfg, _, model = flux_model("memory.fp8=false", "memory.blocks_to_swap=8",
                                       f"memory.swap_prefetch={prefetch}")
    lines: list[str] = []
    setup = apply_memory(model, family, cfg, torch.device("cpu"), lines.append)
    facts = setup.facts["swap"]["prefetch"]
    assert facts["auto"] == (prefetch == 0) and facts["depth"] == depth
    assert ("no CUDA" in facts.get("reason", "")) == (prefetch == 0)
    assert setup.swapper.tuner is None and setup.swapper.lookahead == depth
    assert {p.n_slots for p in setup.swapper.stats.pools} == {slots}
    assert any(f"prefetch {depth} block(s) ahead" in line for line in lines)
