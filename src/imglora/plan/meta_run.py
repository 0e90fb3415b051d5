"""A training micro-step run on the meta device: the real model code, the real shapes, no memory.

``imglora plan`` predicts activation memory by running the family's own loss, forward and backward
on a model built on the meta device, with :class:`~imglora.plan.meter.LiveBytes` counting every
tensor the step creates. Two things differ on the meta device from the machine the plan is for,
and are put right here:

* **Attention.** On the meta device ``scaled_dot_product_attention`` takes its math path, which
  materialises the (tokens x tokens) score matrix; CUDA (flash / memory-efficient) and the CPU
  (its flash kernel) never do. :func:`flash_attention` runs the CPU flash kernel's meta
  implementation instead, which allocates and saves what the fused kernels do (the output and one
  fp32 log-sum-exp per query).
* **Mixed precision.** autocast acts on CUDA or CPU tensors, not meta ones. :class:`Autocast`
  reproduces it at the function level: matrix products (linear, matmul, bmm, conv, attention) run in
  the low-precision dtype, casting their floating inputs first (a leaf parameter's cast is cached
  until the forward pass ends, as autocast caches it); normalisations, softmax, pow/exp/log and the
  MSE loss run in fp32, as in CUDA autocast's fp32 list. The casts are real ``.to`` calls, so
  autograd saves the cast copies exactly as it does under autocast.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Imported here, never first while ``Autocast`` has torch's checkpoint replaced: offload.py binds
# torch.utils.checkpoint.checkpoint when it is imported, and must bind the real one.
from ..memory.norms import autocast_suspended
from ..memory.offload import MIN_BYTES


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float | None, bias: torch.Tensor | None = None) -> torch.Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, *(() if bias is None else (bias,)))
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        q, k, v, out, lse = ctx.saved_tensors[:5]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), q, k, v, out, lse, 0.0, ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` with a fused kernel's memory on the meta device."""
    if enable_gqa or query.dim() != 4:
        # The fused kernels take these too; the math path stands in for them, over-counting by one
        # score matrix.
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    # A mask (Chroma's text mask): CUDA's memory-efficient kernel takes it, saves what the flash kernel
    # does (the output, one log-sum-exp per query) and also the mask as an additive bias in the
    # queries' dtype (a boolean mask is converted to one), kept for backward. On the meta device there
    # are no values to mask, only the shapes and the work.
    bias = None
    if attn_mask is not None:
        bias = attn_mask if attn_mask.dtype == query.dtype else torch.empty(attn_mask.shape, dtype=query.dtype,
                                                                            device=query.device)
    return _Flash.apply(query, key, value, is_causal, scale, bias)


_ORIGINAL_SDPA = F.scaled_dot_product_attention

def _on_meta(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A mask a model computed on the host from its token layout (Qwen-Image 2.1 reads the layout
    from the mask's values, so it stays on the host there), put beside meta tensors: as on a GPU,
    where the mask is on the device."""
    if not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
        return args
    return tuple(a.to("meta") if isinstance(a, torch.Tensor) and not a.is_meta and a.dim() else a for a in args)


_LOW = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
        torch.mm, torch.Tensor.mm, torch.addmm, torch.baddbmm, F.conv1d, F.conv2d, F.conv3d, torch.conv2d,
        F.conv_transpose2d}
_FP32 = {F.layer_norm, torch.layer_norm, F.group_norm, torch.group_norm, F.softmax, torch.softmax,
         torch.Tensor.softmax, F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax, F.mse_loss,
         torch.pow, torch.Tensor.pow, torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.rsqrt,
         torch.Tensor.rsqrt}
if hasattr(F, "rms_norm"):
    _FP32.add(F.rms_norm)


class Autocast(TorchFunctionMode):
    """CUDA autocast's dtype rules, applied to meta tensors (see the module docstring). With
    ``dtype=None`` only attention is replaced (a full-precision run, as on the CPU).

    Function modes are not active while the autograd engine runs backward, so a gradient
    checkpoint's recompute would escape the mode (and take the math attention path). While the mode
    is on, ``torch.utils.checkpoint.checkpoint`` (which diffusers calls at run time) is wrapped so
    that the recomputed function enters the mode again."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.dtype = dtype
        self._cache: dict[int, torch.Tensor] = {}
        self._checkpoint: Any = None
        self.checkpoint_inputs: list[int] = []  # per checkpointed call in forward: bytes of its large inputs

    def __enter__(self) -> "Autocast":
        import torch.utils.checkpoint as ckpt

        original = self._checkpoint = ckpt.checkpoint
        mode = self

        def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
            if torch._C._len_torch_function_stack() > 0:  # a forward call: note what it keeps
                large = [a.numel() * a.element_size() for a in args
                         if isinstance(a, torch.Tensor) and a.numel() * a.element_size() >= MIN_BYTES]
                mode.checkpoint_inputs.append(sum(large))

            def run(*a: Any, **k: Any) -> Any:
                if torch._C._len_torch_function_stack() == 0:  # a recompute, inside backward
                    with mode._reentered():
                        return function(*a, **k)
                return function(*a, **k)

            return original(run, *args, **kwargs)

        ckpt.checkpoint = checkpoint
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.utils.checkpoint as ckpt

        super().__exit__(*exc)
        ckpt.checkpoint = self._checkpoint

    def _reentered(self) -> Any:
        mode = self

        class _Again(TorchFunctionMode):
            def __torch_function__(self, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                return mode.__torch_function__(func, types, args, kwargs)

        return _Again()

    def end_forward(self) -> None:
        """autocast frees its cached weight casts when the forward's autocast region ends."""
        self._cache.clear()

    def _cast(self, x: Any, dtype: torch.dtype) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()) or x.dtype == dtype:
            return x
        if x.is_leaf and x.requires_grad:
            cached = self._cache.get(id(x))
            if cached is None:
                cached = self._cache[id(x)] = x.to(dtype)
            return cached
        return x.to(dtype)

    def __torch_function__(self, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.where and len(args) == 3:
            args = _on_meta(args)
        if func is _ORIGINAL_SDPA:
            if self.dtype is not None:  # (diffusers passes query, key and value by name)
                args = tuple(self._cast(a, self.dtype) for a in args)
                kwargs = {k: self._cast(v, self.dtype) if k in ("query", "key", "value") else v
                          for k, v in kwargs.items()}
            return flash_attention(*args, **kwargs)
        if self.dtype is not None and not autocast_suspended():  # (memory/norms.py suspends it)
            if func in _LOW:
                args = tuple(self._cast(a, self.dtype) for a in args)
                kwargs = {k: self._cast(v, self.dtype) for k, v in kwargs.items()}
            elif func in _FP32:
                args = tuple(self._cast(a, torch.float32) for a in args)
                kwargs = {k: self._cast(v, torch.float32) for k, v in kwargs.items()}
        return func(*args, **kwargs)
