"""The dequantizing fp8 matmul without the work done twice (``memory.fp8_fused``).

optimum-quanto's matmul for a ``qfloat8`` weight (``WeightQBytesLinearFunction`` over
``quanto::qbytes_mm``) makes, on every call: the weight in the scale's dtype (one weight-sized
copy), that copy times the per-channel scales (a second), the product, then the bias in a kernel of
its own; it saves the *input* for a weight gradient that a frozen weight never gets; its backward
dequantizes the weight again, in two passes once more. And ``qbytes_mm`` is an op of its own, which
autocast does not cast: with fp32 scales (a model loaded in fp32) the product runs in fp32 under
bf16 autocast.

Here, per call:

* **Forward.** One cast of the fp8 weight to the compute dtype (exact: every e4m3 value is a bf16,
  fp16 and fp32 value), then the per-output-channel scales where they cost least: on that one copy
  of the weight, in place, with the bias added by the product's own kernel (``F.linear``), or, where
  the output is smaller than the weight (fewer tokens than input features), on the output, with the
  bias in the same elementwise kernel (``addcmul``: ``y = (x @ q.T) * s + b``). Nothing is saved for
  backward but the fp8 weight and its scales, which the module holds anyway.
* **Input gradient.** ``dL/dx = g @ (q * s)`` or ``(g * s) @ q`` by the same rule: one cast of the
  weight, one scaling pass, the product. No weight gradient (the weight is frozen); a bias gradient
  only where the bias is trainable.
* **Compute dtype.** The autocast dtype where autocast is on, else the scales' dtype (quanto's
  rule, which is the dtype the model was loaded in): what autocast asks of a Linear, no more.
* **fp16.** ``q`` holds values up to 448, so ``x @ q.T`` can pass fp16's 65504 where the scaled
  product does not: in fp16 the scales always go on the weight.

Numerics: the same fp8 weights; scaled on the weight, the rounding is quanto's; scaled on the
output, the rounding moves from the weight to the output, each within the compute dtype's half ulp,
so the paths agree to a few bf16 ulps (tests state the bound). The fp8 compute path
(``memory.fp8_compute``) falls back to this one for the shapes ``torch._scaled_mm`` cannot take.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


def compute_dtype(x: torch.Tensor, scale: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return scale.dtype


def scales_on_weight(rows: int, inp: int, dtype: torch.dtype) -> bool:
    """Whether the per-channel scales go on the weight's one copy (``out x in`` elements) rather
    than on the output or gradient (``rows x out``): whichever pass is smaller; always in fp16."""
    return dtype == torch.float16 or inp <= rows


class DequantMatmul(torch.autograd.Function):
    """``x @ (q * s).T + b`` for an fp8 weight ``q`` [out, in] with per-channel scales ``s`` [out, 1]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        xc, b = x.to(dtype), bias.to(dtype) if bias is not None else None
        if scales_on_weight(rows, data.shape[1], dtype):
            # the weight's copy scaled in place; the bias added by the product's own kernel
            y = F.linear(xc, data.to(dtype).mul_(scale), b)  # (mul_ in the scales' dtype: one rounding)
        else:
            s = scale.reshape(-1).to(dtype)
            y = xc @ data.to(dtype).t()
            y = torch.addcmul(b, y, s) if b is not None else y.mul_(s)
        ctx.save_for_backward(data, scale)
        ctx.x_dtype, ctx.dtype = x.dtype, dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        data, scale = ctx.saved_tensors
        gx = gb = None
        if ctx.needs_input_grad[0]:
            g = grad.to(ctx.dtype)
            rows = g.numel() // g.shape[-1] if g.shape[-1] else 0
            if scales_on_weight(rows, data.shape[1], ctx.dtype):
                gx = g @ data.to(ctx.dtype).mul_(scale)
            else:
                gx = (g * scale.reshape(-1).to(ctx.dtype)) @ data.to(ctx.dtype)
            gx = gx.to(ctx.x_dtype)
        if ctx.needs_input_grad[3]:
            gb = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return gx, None, None, gb, None


def fp8_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A quanto qfloat8 weight's fp8 data [out, in] and scales [out, 1]; None for anything else."""
    data, scale = getattr(weight, "_data", None), getattr(weight, "_scale", None)
    if data is None or scale is None or data.dtype != torch.float8_e4m3fn or data.dim() != 2:
        return None
    return data, scale


def fused_linear(module: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """The layer's output through :class:`DequantMatmul` (quanto's own forward where the weight is
    not an fp8 weight it knows)."""
    parts = fp8_parts(module.weight)
    if parts is None:
        return type(module).forward(module, input)
    data, scale = parts
    dtype = compute_dtype(input, scale)
    with torch.autocast(input.device.type, enabled=False):
        return DequantMatmul.apply(input, data, scale, module.bias, dtype)


def _forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    return fused_linear(self, input)


def enable(model: nn.Module) -> int:
    """Run every fp8 (qfloat8) QLinear of ``model`` through :class:`DequantMatmul`; the count."""
    from optimum.quanto import qfloat8
    from optimum.quanto.nn import QLinear

    n = 0
    for mod in model.modules():
        if isinstance(mod, QLinear) and getattr(mod, "weight_qtype", None) == qfloat8:
            mod.forward = types.MethodType(_forward, mod)
            n += 1
    return n
