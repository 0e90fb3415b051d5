"""Apply the memory features a preset asks for to a model with LoRA already injected.

Order matters: LoRA first (peft then wraps plain Linear layers), then FP8 (quantizes the frozen
``base_layer`` weights inside the LoRA wrappers), then block swapping (moves whatever the blocks
hold, quantized or not), then the optimizer is built on the LoRA parameters, which stay on the
device the whole time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..errors import ImgloraError
from .fp8 import to_device

if TYPE_CHECKING:
    from ..config import MemoryConfig
    from ..families import Family
    from .swap import BlockSwapper


@dataclass
class MemorySetup:
    swapper: "BlockSwapper | None" = None
    facts: dict[str, Any] = field(default_factory=dict)  # for the run record

    def before_forward(self) -> None:
        if self.swapper is not None:
            self.swapper.prepare_forward()


def swap_counts(family: "Family", lengths: list[int], m: "MemoryConfig") -> list[int]:
    """How many blocks of each of the family's block lists (of ``lengths`` blocks) to swap."""
    if not lengths:
        return []
    if m.double_blocks_to_swap >= 0 or m.single_blocks_to_swap >= 0:
        counts = [max(0, m.double_blocks_to_swap), max(0, m.single_blocks_to_swap)][:len(lengths)]
        for name, n, size in zip(("memory.double_blocks_to_swap", "memory.single_blocks_to_swap"), counts, lengths):
            if n > size:
                raise ImgloraError(f"{name} = {n}, but the model has only {size} such blocks")
        return counts
    if m.blocks_to_swap == 0:
        return [0] * len(lengths)
    from .swap import kohya_split

    try:
        return list(kohya_split(m.blocks_to_swap, lengths[0], lengths[1]))
    except ValueError as exc:
        raise ImgloraError(f"memory.blocks_to_swap = {m.blocks_to_swap}: {exc}") from None


def check_swap_counts(family: "Family", model_dir: Any, m: "MemoryConfig") -> None:
    """Refuse a swap setting the model cannot take before the model is loaded (from its config)."""
    if family.swappable_blocks and (m.blocks_to_swap or m.double_blocks_to_swap > 0 or m.single_blocks_to_swap > 0):
        swap_counts(family, family.block_counts(model_dir), m)


def apply_memory(model: nn.Module, family: "Family", m: "MemoryConfig", device: torch.device,
                 out: Callable[[str], None] = print) -> MemorySetup:
    setup = MemorySetup()
    if m.fp8:
        from .fp8 import quantize_fp8

        report = quantize_fp8(model, family.quantize_exclude)
        out(report.summary())
        setup.facts["fp8"] = {"bytes_before": report.bytes_before, "bytes_after": report.bytes_after,
                              "quantized_layers": report.n_quantized, "kept_layers": list(report.kept)}
    if m.quantization != "none":
        from .quant4 import quantize_4bit

        q4 = quantize_4bit(model, family.quantize_exclude, m.quantization, device=device)
        out(q4.summary())
        setup.facts[m.quantization] = {"bytes_before": q4.bytes_before, "bytes_after": q4.bytes_after,
                                       "quantized_layers": q4.n_quantized, "kept_layers": list(q4.kept)}
    counts = swap_counts(family, [len(getattr(model, n)) for n in family.swappable_blocks], m)
    if not any(counts):
        to_device(model, device)
        return setup

    from .swap import BlockSwapper, swap_mask

    blocks, mask = [], []
    for name, n in zip(family.swappable_blocks, counts):
        block_list = list(getattr(model, name))
        blocks += block_list
        mask += swap_mask(len(block_list), n)
    setup.swapper = BlockSwapper(blocks, mask, device)
    setup.swapper.install(root=model)  # also moves everything outside the block lists to the device
    stats = setup.swapper.stats
    setup.facts["swap"] = {"blocks_per_list": dict(zip(family.swappable_blocks, counts)),
                           "swapped_blocks": stats.n_swapped, "device_buffer_bytes": stats.device_buffer_bytes}
    out(f"block swap: {' + '.join(f'{n} of {len(getattr(model, b))} {b}' for b, n in zip(family.swappable_blocks, counts))}"
        f" kept in host memory; {stats.device_buffer_bytes / 2**20:.1f} MiB of device buffers")
    return setup
