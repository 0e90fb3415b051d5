"""FP8 compute for the frozen fp8 Linear layers: ``torch._scaled_mm`` instead of dequantizing.

With ``memory.fp8`` the frozen weights are stored in fp8 (quanto ``qfloat8``, e4m3fn, one scale per
output channel), but quanto's matmul dequantizes each weight to the compute dtype on every call
and multiplies in bf16: fp8 saves memory and costs time. ``memory.fp8_compute = true`` runs the
matmuls themselves in fp8 on the tensor cores that have it (compute capability 8.9 and newer), as
OneTrainer's W8A8 layers and SimpleTuner's ``fp8-native`` do:

* **Forward.** The input is quantized to e4m3fn with one scale per token (row absmax / 448), and
  ``torch._scaled_mm(x_fp8, W_fp8.t(), scale_x, scale_w, bias)`` gives the output in the compute
  dtype with the bias added in the same kernel. The weight is used as stored: no copy of it in any
  other precision is made or kept.
* **Input gradient.** ``dL/dx = (dL/dy * scale_w) @ W_fp8``: the gradient, with the weight's
  per-channel scales folded in, is quantized per row the same way and multiplied by the fp8 weight
  (laid out column-major for the kernel: a transient fp8 copy of one weight, freed at once). The
  weight is frozen, so no weight gradient is computed.
* **What stays as it was.** The LoRA branch (peft's ``lora_A``/``lora_B``) runs beside the base
  layer in the compute dtype, untouched. A call the kernel cannot take -- a dimension not a
  multiple of 16 (``_scaled_mm``'s rule on CUDA; FLUX's modulation layers see one row per
  sample) -- takes the fused dequantizing path (``memory/fp8_fused.py``), counted in
  :attr:`Fp8Compute.fallback_calls`.

``torch._scaled_mm`` also runs on the CPU (torch >= 2.13), which is how the numerics are tested
here; whether it is faster than the dequantizing path is a GPU measurement (``imglora bench-swap``).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn

from .fp8_fused import fp8_parts, fused_linear

E4M3_MAX = 448.0


def supported(device: torch.device) -> tuple[bool, str]:
    """Whether fp8 compute can run on ``device``, and if not why."""
    from ..util.devices import is_cuda

    if not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_mm"
    if device.type == "cpu" and not is_cuda(device) and not _cpu_rowwise():
        return False, (f"torch {torch.__version__}'s CPU torch._scaled_mm takes one scale per tensor only "
                       "(row-wise scales on the CPU need torch 2.13 or newer)")
    if is_cuda(device):  # (the CUDA rehearsal on the CPU stands for a Hopper card)
        major, minor = torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)
        if (major, minor) < (8, 9):
            return False, (f"this GPU (compute capability {major}.{minor}) has no fp8 tensor cores "
                           "(8.9 and newer: Ada, Hopper, Blackwell)")
    return True, ""


@functools.lru_cache(maxsize=None)
def _cpu_rowwise() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (torch 2.11's asserts that it
    does not: "Now _scaled_mm only supports per-tensor scaling for CPU backend")."""
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D) in e4m3fn with one float32 scale per row: ``x ~= q * scale``.

    The scale is a power of two (the smallest with ``|x| / scale <= 448``, as MX formats and
    DeepSeek-V3's fp8 recipe choose), so dividing by it is exact in ``x``'s own dtype: after the
    row absmax, the scaling (in ``x``'s dtype, not fp32) and the cast to fp8 (eager: two passes;
    fused into one when compiled), with no fp32 copy of ``x`` and no clamp; the only rounding is
    e4m3's. A row's largest value lands in [224, 448]: one binade of the range is given up.
    """
    amax = torch.linalg.vector_norm(x.detach(), float("inf"), dim=1, keepdim=True, dtype=torch.float32)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax, min=1e-30) / E4M3_MAX)))
    if x.dtype not in (torch.bfloat16, torch.float32):  # fp16's range cannot hold every power of two
        x = x.float()
    q = (x * scale.reciprocal().to(x.dtype)).to(torch.float8_e4m3fn)
    return q, scale


def _kernel_dtype(wanted: torch.dtype, device: torch.device) -> torch.dtype:
    """The kernel's output dtype: on CUDA row-wise scaled fp8 matmuls give bf16 only (cast after)."""
    return torch.bfloat16 if device.type == "cuda" else wanted


def _fits(rows: int, cols_in: int, cols_out: int) -> bool:
    return rows % 16 == 0 and cols_in % 16 == 0 and cols_out % 16 == 0


class _ScaledMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = _quantize_rows(x2)
        ws = scale.reshape(1, -1).float()  # [1, out]: per output channel
        kernel = _kernel_dtype(out_dtype, x.device)
        b = bias.to(kernel) if bias is not None else None
        y = torch._scaled_mm(xq, data.t(), scale_a=xs, scale_b=ws, bias=b, out_dtype=kernel)
        ctx.save_for_backward(data, scale)
        ctx.x_dtype, ctx.x_shape = x.dtype, shape
        return y.to(out_dtype).reshape(*shape[:-1], data.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        data, scale = ctx.saved_tensors
        g = grad.reshape(-1, data.shape[0])
        if g.dtype == torch.float16:  # fp16 cannot hold small scales (absmax / 448) nor their products
            g = g.float()
        # the weight's per-channel scales folded into the gradient in its own dtype (no fp32 copy;
        # rounding the scales to bf16, 2**-9 at most, is far below the e4m3 rounding that follows)
        g2 = g * scale.reshape(1, -1).to(g.dtype)
        gq, gs = _quantize_rows(g2)
        w_col = data.t().contiguous().t()  # [out, in], column-major: the kernel's layout for mat2
        ones = torch.ones(1, data.shape[1], dtype=torch.float32, device=data.device)
        gx = torch._scaled_mm(gq, w_col, scale_a=gs, scale_b=ones, out_dtype=_kernel_dtype(
            torch.bfloat16 if ctx.x_dtype == torch.bfloat16 else torch.float32, data.device))
        return gx.to(ctx.x_dtype).reshape(ctx.x_shape), None, None, None, None


def _forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    parts = fp8_parts(self.weight)
    rows = input.numel() // input.shape[-1] if input.shape[-1] else 0
    if parts is None or not _fits(rows, parts[0].shape[1], parts[0].shape[0]):
        self._fp8_compute.fallback_calls += 1
        return fused_linear(self, input)
    data, scale = parts
    self._fp8_compute.fp8_calls += 1
    device_type = input.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else input.dtype
    with torch.autocast(device_type, enabled=False):
        return _ScaledMatmul.apply(input, data, scale, self.bias, out_dtype)


class Fp8Compute:
    """What :func:`enable` did: the layers switched, and how their calls went (for the record)."""

    def __init__(self) -> None:
        self.layers = 0
        self.fp8_calls = 0
        self.fallback_calls = 0

    def facts(self) -> dict[str, int]:
        return {"layers": self.layers, "fp8_calls": self.fp8_calls, "fallback_calls": self.fallback_calls}


def enable(model: nn.Module) -> Fp8Compute:
    """Run every fp8 (qfloat8) QLinear of ``model`` through ``torch._scaled_mm`` (module docstring)."""
    from optimum.quanto import qfloat8
    from optimum.quanto.nn import QLinear

    state = Fp8Compute()
    for mod in model.modules():
        if isinstance(mod, QLinear) and getattr(mod, "weight_qtype", None) == qfloat8:
            mod._fp8_compute = state
            mod.forward = types.MethodType(_forward, mod)
            state.layers += 1
    return state
