"""``memory.attention_kernel``: which of PyTorch's scaled-dot-product-attention kernels a run uses.

``auto`` on CUDA is flash, then memory-efficient, then math, and never cuDNN unless it is named. The
reason: in CUDA 13 builds of torch (2.11 on), ``check_prefer_cudnn_attention()`` in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` moves cuDNN to the front of PyTorch's own
order on compute capability 9.0 and 10.0 (H100, H200, B200) with cuDNN 9.15 or newer, from the first
CUDA attention call on. A CPU build never runs that switch, so its order (flash, efficient, math,
cuDNN) is not what a Hopper GPU runs. NaN gradients from cuDNN attention's backward on H100/H200 are
reported upstream: pytorch/pytorch #196678 (NaN ``grad_q`` for some sequence lengths with a mask,
"regression since 2.11, default backend"), huggingface/trl #7181 (training NaN with the default
backend on torch 2.13, clean with ``enable_cudnn_sdp(False)``), huggingface/diffusers #9768
(CogVideoX LoRA NaN at the first step with cuDNN, clean with flash or efficient), NVIDIA/cudnn-frontend
#160 and #1072. imglora's one H200 run trained NaN from the second update in every setting (a
suspect, not a finding: ``benchmarks/bare_bisect.py`` times and checks every kernel, bare, so the
default can change on evidence). On a CPU ``auto`` is PyTorch's choice (its flash kernel, else math;
there is no cuDNN kernel there).

Naming one kernel runs every attention of the step with it alone: the forward, the backward, and the
forward that gradient checkpointing recomputes inside backward (a kernel chosen by the forward must
match its recomputation). Peers offer the same choice (kohya's ``--sdpa``/``--xformers``, diffusers'
attention backends): a kernel broken or slow on one GPU and driver stack can be set aside without
changing anything else. ``math`` is PyTorch's reference (slowest, most memory: the full attention
matrix per head), used to tell whether a wrong result comes from a fused kernel; ``cudnn`` stays
selectable by name.

A kernel that cannot run here (memory-efficient or cuDNN on a CPU; flash on an fp32 GPU run) is
refused when the run is set up, with the reason PyTorch gives, not in the first update.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from ..errors import ImgloraError

# ``auto`` on CUDA, in this order of priority: cuDNN attention is left out (see the module's docstring).
AUTO_CUDA = ("flash", "efficient", "math")


def backend(kernel: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[kernel]


def kernels(kernel: str, device_type: str) -> tuple[str, ...] | None:
    """The kernels attention may use, in priority order, for ``memory.attention_kernel = kernel`` on a
    ``device_type`` device; ``None``: PyTorch's own choice, nothing changed (``auto`` off CUDA)."""
    if kernel != "auto":
        return (kernel,)
    return AUTO_CUDA if device_type == "cuda" else None


def context(kernel: str, device_type: str = "cpu") -> ContextManager[Any]:
    """Attention within runs with the kernels :func:`kernels` names, in that priority order."""
    names = kernels(kernel, device_type)
    if names is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([backend(k) for k in names], set_priority=True)


def check(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> None:
    """Refuse a kernel that cannot run on ``device`` for ``dtype`` inputs: one small attention call,
    forward and backward, with it alone."""
    if kernels(kernel, device.type) is None:
        return
    q = torch.zeros(1, 2, 16, head_dim, device=device, dtype=dtype, requires_grad=True)
    try:
        with context(kernel, device.type):
            torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    except RuntimeError as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"{device.type}, {str(dtype).removeprefix('torch.')} inputs"
        raise ImgloraError(f"memory.attention_kernel = \"{kernel}\": PyTorch has no such kernel for this run "
                           f"({where}): {why}; use \"auto\""
                           + (" or \"math\"" if kernel != "math" else "")
                           + (", or \"flash\"" if device.type == "cpu" and kernel != "flash" else "")) from None


def compute_dtype(model_dtype: torch.dtype, mixed_precision: str) -> torch.dtype:
    """The dtype attention sees: autocast's when the run has mixed precision, else the model's."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, model_dtype)
