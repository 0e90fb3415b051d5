"""Where things run and in which precision: one place for device choice and dtype names."""

from __future__ import annotations

from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# The CUDA rehearsal (tests/cuda_standin.py) runs the CUDA code paths on a CPU-only build: it sets
# this, and the host's CPU tensors stand for device memory while torch.cuda's streams, events, host
# registration and memory statistics are the stand-in's. Nothing in the product sets it.
REHEARSING_CUDA_ON_CPU = False


def is_cuda(device: torch.device | str) -> bool:
    """Whether ``device`` takes the CUDA code paths (streams, events, page-locked copies, memory
    statistics). Every such branch asks here, so the rehearsal can take them all."""
    kind = torch.device(device).type
    return kind == "cuda" or (REHEARSING_CUDA_ON_CPU and kind == "cpu")


def cuda_available() -> bool:
    """A CUDA device is there (or rehearsed)."""
    return REHEARSING_CUDA_ON_CPU or torch.cuda.is_available()


def default_device() -> torch.device:
    if REHEARSING_CUDA_ON_CPU:
        return torch.device("cpu")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def weight_dtype(cfg: Any, device: torch.device) -> torch.dtype:
    """The frozen base weights' dtype: the preset's on a GPU, fp32 on the CPU (whose half-precision
    kernels are slow or missing)."""
    return DTYPES[cfg.model.dtype] if is_cuda(device) else torch.float32


def encoder_dtype_name(name: str, device: torch.device | str) -> str:
    """cache.encoder_dtype: "auto" is bf16 on CUDA and fp32 elsewhere."""
    if name != "auto":
        return name
    return "bf16" if is_cuda(device) else "fp32"


def mixed_precision(cfg: Any, device: torch.device) -> str:
    """accelerate's mixed_precision for train.mixed_precision: "auto" is bf16 on CUDA, none on the CPU."""
    mp = cfg.train.mixed_precision
    if mp == "auto":
        return "bf16" if is_cuda(device) else "no"
    return mp


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (timing needs it; nothing else should)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def free(device: torch.device | str) -> None:
    """Return freed device memory to the driver (after dropping encoders or a model)."""
    import gc

    gc.collect()
    if is_cuda(device):
        torch.cuda.empty_cache()
