"""Where things run and in which precision: one place for device choice and dtype names."""

from __future__ import annotations

from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def weight_dtype(cfg: Any, device: torch.device) -> torch.dtype:
    """The frozen base weights' dtype: the preset's on a GPU, fp32 on the CPU (whose half-precision
    kernels are slow or missing)."""
    return torch.float32 if device.type == "cpu" else DTYPES[cfg.model.dtype]


def encoder_dtype_name(name: str, device: torch.device | str) -> str:
    """cache.encoder_dtype: "auto" is bf16 on CUDA and fp32 elsewhere."""
    if name != "auto":
        return name
    return "bf16" if str(device).startswith("cuda") else "fp32"


def mixed_precision(cfg: Any, device: torch.device) -> str:
    """accelerate's mixed_precision for train.mixed_precision: "auto" is bf16 on CUDA, none on the CPU."""
    mp = cfg.train.mixed_precision
    if mp == "auto":
        return "bf16" if device.type == "cuda" else "no"
    return mp


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (timing needs it; nothing else should)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device | str) -> None:
    """Return freed device memory to the driver (after dropping encoders or a model)."""
    import gc

    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
