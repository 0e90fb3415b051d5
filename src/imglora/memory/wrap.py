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

from ..util.devices import is_cuda
from ..family import Swappable, supports
from .fp8 import to_device
from .swap import NO_SWAP, BlockSwapper, SwapLayout

if TYPE_CHECKING:
    from ..models.source import ModelSource


@dataclass
class MemorySetup:
    swapper: BlockSwapper | None = None
    offload: Any = None  # offload.OffloadingCheckpoint, with memory.offload_checkpoints
    facts: dict[str, Any] = field(default_factory=dict)  # for the run record
    attention_kernel: str = "auto"  # memory.attention_kernel
    device_type: str = "cpu"  # where the model runs (``auto`` means another kernel list on CUDA)

    def before_forward(self) -> None:
        if self.swapper is not None:
            self.swapper.prepare_forward()

    def kernel(self) -> Any:
        """A context in which attention runs with memory.attention_kernel (a step's forward and backward,
        the evaluation's sampling)."""
        from .attention import context

        return context(self.attention_kernel, self.device_type)


def resolve_swap(family: Any, cfg: Any, src: "ModelSource | None" = None, *, model: nn.Module | None = None,
                 lengths: list[int] | None = None) -> SwapLayout:
    """The blocks ``cfg`` keeps in host memory: the family's rule (``swap_counts``, called nowhere
    else) applied once, where a command starts, and passed down as data (to the loader and to
    :func:`apply_memory`). The block counts come from the model's config (``src``, before anything
    is loaded, so a count the model cannot take is refused then), from a built model (``model``, e.g.
    on the meta device) or are given (``lengths``). A family without swappable blocks gets
    :data:`NO_SWAP`."""
    lists = tuple(family.swappable_blocks) if supports(family, Swappable) else ()
    if not lists:
        return NO_SWAP
    if lengths is None and model is not None:
        lengths = [len(model.get_submodule(name)) for name in lists]
    elif lengths is None and src is not None:
        lengths = list(family.block_counts(src))
    elif lengths is None:
        raise TypeError("resolve_swap needs the model source, a built model or the block counts")
    return SwapLayout(lists, tuple(lengths), tuple(family.swap_counts(list(lengths), cfg)))


def preset_swap(family: Any, cfg: Any, src: "ModelSource | None") -> SwapLayout:
    """The layout ``cfg`` swaps on ``src``'s model, else (``src`` None: planning before a download,
    ``bench-swap --arch full``) on the full-size architecture imglora ships (``full_block_counts``)."""
    if not supports(family, Swappable):
        return NO_SWAP
    return resolve_swap(family, cfg, src) if src is not None else \
        resolve_swap(family, cfg, lengths=family.full_block_counts(cfg))


def apply_memory(model: nn.Module, family: Any, cfg: Any, device: torch.device, swap: SwapLayout,
                 out: Callable[[str], None] = print) -> MemorySetup:
    """FP8 or 4-bit base weights, block swapping (the blocks ``swap`` names: the layout the model
    was loaded with, :func:`resolve_swap`) and compiled blocks as ``cfg.memory`` asks; the model ends
    on ``device``."""
    setup = _placed(model, family, cfg, device, swap, out)
    setup.attention_kernel, setup.device_type = cfg.memory.attention_kernel, device.type
    from .attention import kernels

    chosen = kernels(setup.attention_kernel, device.type)
    if setup.attention_kernel != "auto":
        setup.facts["attention_kernel"] = setup.attention_kernel
        out(f"attention: PyTorch's {setup.attention_kernel} kernel only (memory.attention_kernel)")
    elif chosen is not None:  # auto on CUDA: the run record says which kernels it allowed
        setup.facts["attention_kernels"] = list(chosen)
    if cfg.memory.compile == "blocks":  # last: the swap engine's and offload's hooks stay outside the graphs
        from .compile import install

        setup.facts["compile"] = install(model, family, cfg.memory.compile_mode, device, out)
    return setup


def _placed(model: nn.Module, family: Any, cfg: Any, device: torch.device, swap: SwapLayout,
            out: Callable[[str], None]) -> MemorySetup:
    setup = MemorySetup()
    m = cfg.memory
    if m.fp8:
        from .fp8 import quantize_fp8

        report = quantize_fp8(model, family.quantize_exclude)
        out(report.summary())
        setup.facts["fp8"] = {"bytes_before": report.bytes_before, "bytes_after": report.bytes_after,
                              "quantized_layers": report.n_quantized, "kept_layers": list(report.kept),
                              "fused": m.fp8_fused or m.fp8_compute}
        if m.fp8_fused or m.fp8_compute:  # fp8 compute's fallback for the shapes it cannot take is the fused one
            from .fp8_fused import enable as fuse

            n = fuse(model)
            if m.fp8_fused:
                out(f"fp8: {n} Linear layers dequantize once per use, scales and bias fused (memory.fp8_fused)")
        if m.fp8_compute:
            setup.facts["fp8_compute"] = fp8_compute(model, device, out)
    if m.offload_checkpoints and m.gradient_checkpointing:
        from .offload import install

        setup.offload = install(model, device)
        if setup.offload is None:
            out("memory.offload_checkpoints: this model takes no checkpoint function; boundaries stay on the device")
        setup.facts["offload_checkpoints"] = setup.offload.facts if setup.offload is not None else False
    if m.quantization != "none":
        from .quant4 import quantize_4bit, resolve

        kind, why = resolve(m.quantization, device)
        if m.quantization == "auto":
            out(f"memory.quantization = \"auto\": {kind} ({why.removeprefix('auto: ')})")
        q4 = quantize_4bit(model, family.quantize_exclude, kind, device=device)
        out(q4.summary())
        setup.facts[kind] = {"bytes_before": q4.bytes_before, "bytes_after": q4.bytes_after,
                             "quantized_layers": q4.n_quantized, "kept_layers": list(q4.kept)}
        setup.facts["quantization"] = {"setting": m.quantization, "ran": kind, "why": why}
    swap.check(model)
    plan = swap.masks()
    lists, counts = swap.lists, swap.counts
    if not swap.swapped:
        to_device(model, device)
        return setup

    blocks, mask = [], []
    for name, block_mask in plan:
        blocks += list(model.get_submodule(name))
        mask += block_mask
    depth = cfg.memory.swap_prefetch
    tuner = prefetch_tuner(cfg, device, setup, out)
    setup.swapper = BlockSwapper(blocks, mask, device, slots_per_shape=max(depth, 1) + 1, tuner=tuner)
    setup.swapper.install(root=model)  # also moves everything outside the block lists to the device
    stats = setup.swapper.stats
    prefetch = {"auto": depth == 0, "depth": max(depth, 1)}
    if depth == 0 and tuner is None:
        prefetch["reason"] = "no CUDA: host copies are synchronous, a deeper prefetch hides nothing"
    setup.facts["swap"] = {"blocks_per_list": dict(zip(lists, counts)), "swapped_blocks": stats.n_swapped,
                           "device_buffer_bytes": stats.device_buffer_bytes, "prefetch": prefetch,
                           "host_memory": dict(stats.host_memory)}
    out(f"block swap: {' + '.join(f'{n} of {len(getattr(model, b))} {b}' for b, n in zip(lists, counts))}"
        f" kept in host memory; {stats.device_buffer_bytes / 2**20:.1f} MiB of device buffers; prefetch "
        + ("1 block ahead until update 2 measures copies and compute (memory.swap_prefetch = 0: auto)"
           if tuner is not None and tuner.grow else f"{max(depth, 1)} block(s) ahead"))
    return setup


def fp8_compute(model: nn.Module, device: torch.device, out: Callable[[str], None]) -> dict[str, Any]:
    """memory.fp8_compute: the fp8 layers' matmuls through torch._scaled_mm where the device has fp8
    tensor cores; elsewhere the run says why and keeps dequantizing."""
    from .fp8_compute import enable, supported

    ok, why = supported(device)
    if not ok:
        out(f"memory.fp8_compute: {why}; the fp8 weights are dequantized for bf16 matmuls instead")
        return {"enabled": False, "reason": why}
    state = enable(model)
    out(f"fp8 compute: {state.layers} Linear layers multiply in fp8 (torch._scaled_mm)")
    return {"enabled": True, "layers": state.layers}


def prefetch_tuner(cfg: Any, device: torch.device, setup: MemorySetup, out: Callable[[str], None]) -> Any:
    """On a GPU, the second update's copies and block compute are measured (swap_tune). With
    memory.swap_prefetch = 0 ("auto") they choose the depth, within what the card (and
    memory.vram_budget) leaves after that update's peak; with an explicit depth the log and record
    only say what auto would choose. Without CUDA nothing is measured: the copies are synchronous
    there, so a deeper prefetch hides nothing."""
    if not is_cuda(device):
        return None
    from .swap_tune import PrefetchTuner

    def allowance() -> int:
        margin = 2**30  # kept free on the card: fragmentation, the CUDA context's growth
        room = torch.cuda.get_device_properties(device).total_memory - torch.cuda.max_memory_reserved(device) - margin
        if cfg.memory.vram_budget > 0:  # as plan_budget checks it: peak x 1.05 + 0.5 GiB of CUDA context
            room = min(room, int(cfg.memory.vram_budget * 2**30) - 2**29
                       - int(torch.cuda.max_memory_allocated(device) * 1.05))
        return max(0, room)

    def report(message: str, facts: dict[str, Any]) -> None:
        out(message)
        setup.facts["swap"]["prefetch"] = facts
        setup.facts["swap"]["device_buffer_bytes"] = setup.swapper.stats.device_buffer_bytes

    return PrefetchTuner(allowance, report, grow=cfg.memory.swap_prefetch == 0)
