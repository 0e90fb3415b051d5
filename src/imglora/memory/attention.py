"""``memory.attention_kernel``: which of PyTorch's scaled-dot-product-attention kernels a run uses.

``auto`` leaves the choice to PyTorch (on a GPU: flash, then memory-efficient, then math, then cuDNN in
torch 2.11; on a CPU: its flash kernel, else math). Naming one kernel runs every attention of the
step with it alone: the forward, the backward, and the forward that gradient checkpointing recomputes
inside backward (a kernel chosen by the forward must match its recomputation). Peers offer the same
choice (kohya's ``--sdpa``/``--xformers``, diffusers' attention backends): a kernel broken or slow
on one GPU and driver stack can be set aside without changing anything else. ``math`` is PyTorch's
reference (slowest, most memory: the full attention matrix per head), used to tell whether a wrong
result comes from a fused kernel.

A kernel that cannot run here (memory-efficient or cuDNN on a CPU; flash on an fp32 GPU run) is
refused when the run is set up, with the reason PyTorch gives, not in the first update.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from ..errors import ImgloraError

def backend(kernel: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[kernel]


def context(kernel: str) -> ContextManager[None]:
    """Attention within runs with ``kernel`` only (``auto``: PyTorch's choice, nothing changed)."""
    if kernel == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([backend(kernel)])


def check(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> None:
    """Refuse a kernel that cannot run on ``device`` for ``dtype`` inputs: one small attention call,
    forward and backward, with it alone."""
    if kernel == "auto":
        return
    q = torch.zeros(1, 2, 16, head_dim, device=device, dtype=dtype, requires_grad=True)
    try:
        with context(kernel):
            torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    except RuntimeError as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"{device.type}, {str(dtype).removeprefix('torch.')} inputs"
        raise ImgloraError(f"memory.attention_kernel = \"{kernel}\": PyTorch has no such kernel for this run "
                           f"({where}): {why}; use \"auto\" (PyTorch's choice)"
                           + (" or \"math\"" if kernel != "math" else "")
                           + (", or \"flash\"" if device.type == "cpu" and kernel != "flash" else "")) from None


def compute_dtype(model_dtype: torch.dtype, mixed_precision: str) -> torch.dtype:
    """The dtype attention sees: autocast's when the run has mixed precision, else the model's."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, model_dtype)
