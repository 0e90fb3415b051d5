"""apply_memory on its own: the order LoRA → fp8 → swap, the facts it records, and swap checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imglora.adapters import inject as lora
from imglora.commands.common import load_config
from imglora.errors import ImgloraError
from imglora.families import registry
from imglora.memory.swap import NO_SWAP, SwapLayout
from imglora.memory.wrap import apply_memory, resolve_swap
from imglora.models.resolve import resolve_model

REPO = Path(__file__).resolve().parents[2]


def flux_model(*overrides: str):
    family = registry.get("flux")
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", list(overrides))
    model_dir = resolve_model(cfg.model.path, family)
    # Loaded unswapped: a swap count the model cannot take is refused at load too (tested below).
    unswapped = cfg.replace(memory={"blocks_to_swap": 0})
    trainable = family.load_trainable(model_dir, unswapped, torch.device("cpu"), torch.float32,
                                      resolve_swap(family, unswapped, model_dir))
    lora.inject(trainable.model, family, cfg.lora, seed=0)
    return family, cfg, model_dir, trainable.model


def test_fp8_then_swap_with_facts_for_the_record() -> None:
    family, cfg, _, model = flux_model("memory.fp8=true", "memory.blocks_to_swap=4")
    lines: list[str] = []
    setup = apply_memory(model, family, cfg, torch.device("cpu"), resolve_swap(family, cfg, model=model), lines.append)
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
    zero = family.with_blocks_to_swap(cfg, 0)
    assert apply_memory(model, family, zero, torch.device("cpu"), resolve_swap(family, zero, model=model),
                        lambda s: None).swapper is None


def test_swap_settings_the_model_cannot_take_are_refused_from_its_config() -> None:
    family, cfg, model_dir, _ = flux_model("memory.blocks_to_swap=11")
    with pytest.raises(ImgloraError, match="memory.blocks_to_swap = 11: swapping 11 blocks means 5 double"):
        resolve_swap(family, cfg, model_dir)  # where a command starts, before any model is read
    four = resolve_swap(family, family.with_blocks_to_swap(cfg, 4), model_dir)  # a count that fits is fine
    assert (four.lists, four.lengths, four.counts) == (("transformer_blocks", "single_transformer_blocks"), (4, 8),
                                                       (2, 4))


def test_the_layout_is_data_computed_once_and_apply_memory_swaps_exactly_it() -> None:
    """The family's rule runs in resolve_swap alone; the loader and apply_memory take its result, so the
    blocks a streamed load leaves on the host are the blocks the swapper swaps, whatever the config
    says afterwards."""
    family, cfg, model_dir, model = flux_model("memory.fp8=false", "memory.blocks_to_swap=0")
    layout = resolve_swap(family, family.with_blocks_to_swap(cfg, 3), model_dir)  # 1 double + 4 single
    assert layout.counts == (1, 4) and layout.swapped == 5
    assert layout.masks() == [("transformer_blocks", [False] * 3 + [True]),
                              ("single_transformer_blocks", [False] * 4 + [True] * 4)]
    assert layout.modules() == {"transformer_blocks.3", *(f"single_transformer_blocks.{i}" for i in range(4, 8))}
    assert layout.swaps("transformer_blocks", 3) and not layout.swaps("transformer_blocks", 2)
    assert not layout.swaps("context_embedder", 0)
    assert resolve_swap(family, cfg, model=model) == resolve_swap(family, cfg, model_dir)  # the same from either
    setup = apply_memory(model, family, cfg, torch.device("cpu"), layout, lambda s: None)  # cfg says 0: ignored
    assert setup.swapper is not None and setup.swapper.stats.n_swapped == 5
    assert setup.facts["swap"]["blocks_per_list"] == {"transformer_blocks": 1, "single_transformer_blocks": 4}
    names = {id(m): n for n, m in model.named_modules()}
    assert {names[id(b.module)] for b in setup.swapper._blocks if b.swapped} == layout.modules()


def test_a_layout_for_other_block_lists_is_refused() -> None:
    family, cfg, _, model = flux_model("memory.fp8=false", "memory.blocks_to_swap=0")
    wrong = SwapLayout(("transformer_blocks", "single_transformer_blocks"), (19, 38), (9, 18))
    with pytest.raises(RuntimeError, match=r"computed for block lists \{'transformer_blocks': 19, "
                                           r"'single_transformer_blocks': 38\}, but the model has "
                                           r"\{'transformer_blocks': 4, 'single_transformer_blocks': 8\}"):
        apply_memory(model, family, cfg, torch.device("cpu"), wrong, lambda s: None)
    with pytest.raises(ValueError, match="cannot swap 5 of 4 blocks of single_transformer_blocks"):
        SwapLayout(("single_transformer_blocks",), (4,), (5,))
    assert NO_SWAP.masks() == [] and NO_SWAP.swapped == 0 and NO_SWAP.modules() == set()


@pytest.mark.parametrize("prefetch, depth, slots", [(0, 1, 2), (2, 2, 3)])
def test_the_prefetch_setting_in_the_record(prefetch, depth, slots) -> None:
    """0 is auto; on the CPU nothing is tuned (host copies are synchronous) and the record says why."""
    family, cfg, _, model = flux_model("memory.fp8=false", "memory.blocks_to_swap=8",
                                       f"memory.swap_prefetch={prefetch}")
    lines: list[str] = []
    setup = apply_memory(model, family, cfg, torch.device("cpu"), resolve_swap(family, cfg, model=model), lines.append)
    facts = setup.facts["swap"]["prefetch"]
    assert facts["auto"] == (prefetch == 0) and facts["depth"] == depth
    assert ("no CUDA" in facts.get("reason", "")) == (prefetch == 0)
    assert setup.swapper.tuner is None and setup.swapper.lookahead == depth
    assert {p.n_slots for p in setup.swapper.stats.pools} == {slots}
    assert any(f"prefetch {depth} block(s) ahead" in line for line in lines)
