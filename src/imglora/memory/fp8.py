"""FP8 storage for frozen Linear weights, with optimum-quanto.

Each frozen ``nn.Linear`` weight becomes a quanto ``qfloat8`` (e4m3fn) tensor with one scale per
output channel (axis 0, absmax), the layout quanto uses for weights. ``freeze`` then drops the
high-precision copy, so the module holds ~1 byte per weight plus one scale per row. Matmuls still
run in the activation dtype (quanto dequantizes on the fly): FP8 here saves memory, not time.

Order with peft (chosen: **inject LoRA first, then quantize**). peft 0.21 has no quanto code path
(``peft/tuners/lora/`` dispatches on ``isinstance(base, nn.Linear)``; quanto's ``QLinear`` passes
only because it subclasses ``nn.Linear``). Both orders give the same forward/backward for plain
LoRA (tests check it), but everything peft does to a base weight *as a dense tensor* -- PiSSA/OLoRA/
LoftQ/CorDA/EVA initialisation (which rewrite the base weight), DoRA's weight norm at init,
``_move_adapter_to_device_of_base_layer`` -- would otherwise run on a quanto tensor. Injecting first
keeps peft on its tested float path and quantizes the (possibly rewritten) ``base_layer`` Linear
inside each LoRA wrapper. LoRA's own modules are skipped by name and because they are trainable.

Merging LoRA into a quantized base (``merge_and_unload``) is not supported in either order; the
trainer saves adapters only.

Quanto's "Marlin" fp8 layout is avoided on purpose. On CUDA (sm80+) with bf16/fp16 scales, quanto
picks it when a weight is quantized *or moved* there (``WeightQBytesTensor.create``). Packing into
it JIT-compiles quanto's CUDA extension (needs nvcc; minutes), and in optimum-quanto 0.2.7 its
forward ignores the Linear bias (``MarlinF8QBytesLinearFunction.forward`` never adds ``bias``) --
every FLUX Linear has one. So :func:`quantize_fp8` quantizes with ``optimized=False`` and
:func:`to_device` moves a quantized model by moving the inner tensors and re-wrapping them in the
same class. **Move a quantized model with** :func:`to_device`, **not** ``module.to(...)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatch

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["Fp8Report", "LORA_MODULE_NAMES", "quantize_fp8", "tensor_bytes", "to_device", "weight_bytes"]

# Submodule names peft's LoRA layers add next to ``base_layer``; nothing below them is a base weight.
LORA_MODULE_NAMES = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "lora_dropout"}
)


@dataclass(frozen=True)
class QuantReport:
    """What quantizing a model's frozen Linear weights did (fp8 here, 4-bit in quant4.py)."""

    bytes_before: int
    """Bytes of every parameter and buffer of the model before quantization."""
    bytes_after: int
    """The same after quantization, counting the packed data and its scales."""
    n_quantized: int
    """Frozen ``nn.Linear`` layers now stored in low precision."""
    n_kept: int
    """Frozen ``nn.Linear`` layers kept in high precision because ``exclude`` matched them."""
    kept: tuple[str, ...] = ()
    """Names of those kept layers (as in ``model.named_modules()``)."""
    kind: str = "fp8"
    """fp8, qint4 or nf4."""

    def summary(self) -> str:
        def size(n: int) -> str:
            return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"

        bits = "" if self.kind == "fp8" else " to 4 bits"
        return (f"{self.kind}: {self.n_quantized} Linear layers quantized{bits}, {self.n_kept} kept in high "
                f"precision; weights {size(self.bytes_before)} -> {size(self.bytes_after)}")


Fp8Report = QuantReport


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of ``t``; a tensor subclass (quanto) counts its inner tensors (data + scales)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(module: nn.Module) -> int:
    """Bytes of all parameters and buffers of ``module`` (shared tensors counted once).

    ``numel() * element_size()`` of a quanto tensor reports the *dequantized* size (its dtype is the
    scale dtype), so subclasses are measured through their inner tensors instead.
    """
    seen: set[int] = set()
    total = 0
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += tensor_bytes(t)
    return total


def move_tensor(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``. Tensor subclasses are rebuilt from their moved inner tensors with the same
    class, so quanto never swaps in a device-specific kernel layout (see the module docstring)."""
    device = torch.device(device)
    if is_traceable_wrapper_subclass(t):
        names, meta = t.__tensor_flatten__()
        inner = {n: move_tensor(getattr(t, n), device) for n in names}
        return type(t).__tensor_unflatten__(inner, meta, t.size(), t.stride())
    return t.to(device)


def to_device(module: nn.Module, device: torch.device | str, *, recurse: bool = True) -> nn.Module:
    """Move ``module``'s parameters and buffers to ``device`` in place, quanto-safe.

    Plain parameters keep their identity (``param.data`` is replaced), so an optimizer built before
    the move still holds the right objects. Quantized weights are new ``Parameter`` objects.
    ``recurse=False`` moves only the module's own tensors, not its children's.
    """
    device = torch.device(device)
    for mod in module.modules() if recurse else (module,):
        for name, p in list(mod._parameters.items()):
            if p is None or _on(p, device):
                continue
            if not is_traceable_wrapper_subclass(p):
                try:
                    p.data = p.data.to(device)
                    if p.grad is not None:
                        p.grad.data = p.grad.data.to(device)
                    continue
                except RuntimeError:  # .data cannot change backend kind (e.g. to "meta")
                    pass
            mod._parameters[name] = nn.Parameter(move_tensor(p.detach(), device), requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None and not _on(b, device):
                mod._buffers[name] = move_tensor(b, device)
    return module


def _on(t: torch.Tensor, device: torch.device) -> bool:
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return all(_on(getattr(t, n), device) for n in names)
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _canonical(name: str) -> str:
    # peft nests the original layer as ``<name>.base_layer``; patterns are written against the
    # original model's names, so "proj_out" must still exclude "proj_out.base_layer".
    return ".".join(part for part in name.split(".") if part != "base_layer")


def _excluded(name: str, patterns: Sequence[str]) -> bool:
    """True if ``name`` or one of its ancestors matches a pattern: excluding a module keeps its subtree."""
    if not patterns:
        return False
    parts = _canonical(name).split(".")
    prefixes = (".".join(parts[: i + 1]) for i in range(len(parts)))
    return any(fnmatch(prefix, pat) for prefix in prefixes for pat in patterns)


def _in_lora(name: str) -> bool:
    return any(part in LORA_MODULE_NAMES for part in name.split("."))


def _linear_targets(model: nn.Module, exclude: Sequence[str], prefix: str = "",
                    allow_meta: bool = False) -> tuple[list[str], list[str]]:
    quantize, kept = [], []
    for name, mod in model.named_modules():
        # Exactly nn.Linear: subclasses (e.g. MultiheadAttention's out_proj, read as a raw weight by
        # F.multi_head_attention_forward) may touch ``.weight`` as a dense tensor.
        if type(mod) is not nn.Linear or _in_lora(name) or mod.weight.requires_grad:
            continue
        if mod.weight.is_meta and not allow_meta:
            raise ValueError(f"cannot quantize {name!r}: its weight is on the meta device (load the model first)")
        (kept if _excluded(prefix + name, exclude) else quantize).append(name)
    return quantize, kept


def would_quantize(model: nn.Module, exclude: Sequence[str] = ()) -> list[str]:
    """Names of the Linear layers :func:`quantize_fp8` would quantize (the model may be on the meta
    device: this only looks at the structure)."""
    return _linear_targets(model, list(exclude), allow_meta=True)[0]


def dense_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers as if none were quantized (a quanto tensor
    counted at its dequantized dtype): the size quantization started from."""
    seen: set[int] = set()
    total = 0
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _already_fp8(model: nn.Module) -> int:
    """Linear layers quantized to fp8 before (e.g. block by block while a model was read)."""
    from optimum.quanto import qfloat8
    from optimum.quanto.nn import QLinear

    return sum(1 for m in model.modules() if isinstance(m, QLinear) and getattr(m, "weight_qtype", None) == qfloat8)


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def quantize_fp8(model: nn.Module, exclude: Sequence[str] = (), prefix: str = "") -> Fp8Report:
    """Store the frozen ``nn.Linear`` weights of ``model`` in fp8 (quanto ``qfloat8``), in place.

    ``exclude``: fnmatch patterns on module names (``"x_embedder"``, ``"time_text_embed*"``). A
    match keeps that module and everything under it in high precision; peft's ``.base_layer`` is
    ignored when matching. Trainable Linear layers and peft LoRA modules are never quantized.
    ``prefix``: ``model``'s own name in the whole model, when it is a part (a block quantized as it
    is read), so the patterns match as they would on the whole model. Layers quantized before are
    counted in the report, which then describes the model as a whole.

    Layers are quantized one at a time, so peak memory is the model plus one layer. Works on CPU
    and CUDA; the quantized weights stay on the device they were on (quantizing on the GPU is much
    faster for a 12B model; use :func:`to_device` to move the result).
    """
    if isinstance(exclude, str):
        raise TypeError("exclude must be a sequence of patterns, not a single string")
    from optimum.quanto import qfloat8
    from optimum.quanto.nn import quantize_module
    from optimum.quanto.tensor import quantize_weight

    bytes_before = dense_bytes(model)
    before = _already_fp8(model)
    names, kept = _linear_targets(model, list(exclude), prefix)
    with torch.no_grad():
        for name in names:
            # Look the module up by name (not from a list of modules) so that no reference to the
            # float layer survives its replacement and its memory is released layer by layer.
            lin = model.get_submodule(name)
            qlin = quantize_module(lin, weights=qfloat8)  # a QLinear still holding the float weight
            # What QLinear.freeze() does (absmax scale per output row, then quantize), except
            # ``optimized=False``: on CUDA with bf16/fp16 scales quanto would otherwise build its
            # Marlin layout, which compiles quanto's CUDA extension on the spot and drops the bias
            # (see the module docstring). The portable layout works everywhere.
            scale = qlin.optimizer(qlin.weight, qtype=qlin.weight_qtype, axis=0)
            weight = quantize_weight(
                qlin.weight, qtype=qlin.weight_qtype, axis=0, scale=scale, activation_qtype=None, optimized=False
            )
            # freeze() would wrap it in a Parameter that requires grad; base weights must stay
            # frozen or autograd would compute (and the optimizer could see) their grads.
            qlin.weight = nn.Parameter(weight.detach(), requires_grad=False)
            if qlin.bias is not None:
                qlin.bias.requires_grad_(False)
            _set_submodule(model, name, qlin)
            lin.weight = None  # same as quanto: drop the float tensors with the old module
            lin.bias = None
            del lin, qlin
    return Fp8Report(
        bytes_before=bytes_before,
        bytes_after=weight_bytes(model),
        n_quantized=len(names) + before,
        n_kept=len(kept),
        kept=tuple(kept),
    )

