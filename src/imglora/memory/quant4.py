"""4-bit storage for frozen Linear weights (QLoRA): optimum-quanto qint4, or bitsandbytes nf4.

Same contract as :mod:`.fp8`, and it reuses that module's helpers: LoRA is injected first, then
the frozen ``base_layer`` Linear inside each LoRA wrapper (and every other frozen ``nn.Linear``
not excluded) is replaced, one layer at a time, by a 4-bit one. LoRA modules are never touched:
they are skipped by name and because they are trainable.

* ``qint4`` (default, any device): quanto ``qint4`` weights, group-wise affine (groups of 128
  input features where the width allows, per output row otherwise), ~0.5 byte per weight plus a
  scale and a shift per group. As in :func:`.fp8.quantize_fp8`, quantized with
  ``optimized=False``: quanto would otherwise pick its AWQ (fp16) or TinyGemm (bf16) layouts, which
  need its compiled CUDA extension; the portable layout dequantizes in the forward, so it saves
  memory, not time. Move the model with :func:`.fp8.to_device`, not ``module.to``.
* ``nf4`` (CUDA only, needs bitsandbytes): ``bnb.nn.Linear4bit`` with NormalFloat4 and double
  quantization (the QLoRA paper's setting, ``compress_statistics=True``), compute in the layer's
  dtype. bitsandbytes quantizes when a ``Params4bit`` moves to the GPU, so the layers are moved
  there here; :func:`.fp8.to_device` then leaves them alone.

Neither layout can be merged into (``merge_and_unload``): the trainer saves adapters only, and
``imglora merge`` merges into the full-precision base.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from ..errors import ImgloraError
from .fp8 import QuantReport, _linear_targets, _set_submodule, weight_bytes

__all__ = ["quantize_4bit"]

NF4_NEEDS_BNB = ("memory.quantization = \"nf4\" needs bitsandbytes (CUDA): pip install bitsandbytes, "
                 "or use qint4")


def resolve(kind: str, device: torch.device | str) -> tuple[str, str]:
    """(the 4-bit kind that runs, why) for memory.quantization ``kind``: ``auto`` is nf4 (the QLoRA
    recipe) on a CUDA GPU with bitsandbytes installed, else qint4; the others are themselves."""
    from importlib.util import find_spec

    from ..util.devices import is_cuda

    if kind != "auto":
        return kind, "as set"
    if not is_cuda(device):
        return "qint4", "auto: not a CUDA device (bitsandbytes' NF4 runs on CUDA)"
    if find_spec("bitsandbytes") is None:
        return "qint4", "auto: bitsandbytes is not installed (pip install \"imglora[bnb]\" for NF4)"
    return "nf4", "auto: a CUDA GPU with bitsandbytes"


def quantize_4bit(model: nn.Module, exclude: Sequence[str] = (), kind: Literal["qint4", "nf4"] = "qint4", *,
                  device: torch.device | str | None = None) -> QuantReport:
    """Store the frozen ``nn.Linear`` weights of ``model`` in 4 bits, in place.

    ``exclude``: fnmatch patterns on module names (``"lm_head"``), as for fp8. ``device`` matters
    for nf4 only (bitsandbytes quantizes on the GPU): default the current CUDA device.
    """
    if isinstance(exclude, str):
        raise TypeError("exclude must be a sequence of patterns, not a single string")
    if kind not in ("qint4", "nf4"):
        raise ValueError(f"unknown 4-bit kind {kind!r}; qint4 or nf4")
    bytes_before = weight_bytes(model)
    names, kept = _linear_targets(model, list(exclude))
    with torch.no_grad():
        if kind == "qint4":
            _quantize_qint4(model, names)
        else:
            _quantize_nf4(model, names, device)
    return QuantReport(bytes_before, weight_bytes(model), len(names), len(kept), tuple(kept), kind)


def _quantize_qint4(model: nn.Module, names: list[str]) -> None:
    from optimum.quanto import qint4
    from optimum.quanto.nn import quantize_module
    from optimum.quanto.tensor import quantize_weight

    for name in names:
        lin = model.get_submodule(name)  # by name, so the float layer is freed layer by layer
        qlin = quantize_module(lin, weights=qint4)  # chooses the group size from in_features
        # What QLinear.freeze() does (MaxOptimizer: affine scale + shift per group), except
        # ``optimized=False`` (see the module docstring).
        scale, shift = qlin.optimizer(qlin.weight, qtype=qlin.weight_qtype, axis=0,
                                      group_size=qlin.weight_group_size)
        weight = quantize_weight(qlin.weight, qtype=qlin.weight_qtype, axis=0, scale=scale, shift=shift,
                                 group_size=qlin.weight_group_size, activation_qtype=None, optimized=False)
        # freeze() would make it a Parameter that requires grad; the base must stay frozen.
        qlin.weight = nn.Parameter(weight.detach(), requires_grad=False)
        if qlin.bias is not None:
            qlin.bias.requires_grad_(False)
        _set_submodule(model, name, qlin)
        lin.weight = None
        lin.bias = None
        del lin, qlin


def _quantize_nf4(model: nn.Module, names: list[str], device: torch.device | str | None) -> None:
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ImgloraError(NF4_NEEDS_BNB) from None
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if device.type != "cuda":
        raise ImgloraError("memory.quantization = \"nf4\" needs a CUDA device (bitsandbytes quantizes on the GPU); "
                           "use qint4 on this machine")
    for name in names:
        lin = model.get_submodule(name)
        qlin = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                 compute_dtype=lin.weight.dtype, compress_statistics=True, quant_type="nf4",
                                 device="meta")
        # module=qlin: bitsandbytes records the quantization state on the layer when it quantizes.
        qlin.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=True,
                                        quant_type="nf4", module=qlin)
        if lin.bias is not None:
            qlin.bias = nn.Parameter(lin.bias.data, requires_grad=False)
        qlin = qlin.to(device)  # bitsandbytes quantizes here
        _set_submodule(model, name, qlin)
        lin.weight = None
        lin.bias = None
        del lin, qlin
