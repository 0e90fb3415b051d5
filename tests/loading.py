"""A tiny model loaded as a command loads it: the swap layout resolved once from the model's config
(memory.wrap.resolve_swap), then the model, then (``session``) LoRA, the memory features with that
same layout and the optimizer. For the tests that drive a step themselves."""

from __future__ import annotations

from typing import Any

import torch

from imglora.memory.wrap import resolve_swap
from imglora.training import step as loop

CPU = torch.device("cpu")


def load_tiny(family: Any, src: Any, cfg: Any, device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> Any:
    """``family.load_trainable`` with the layout ``cfg`` gives."""
    return family.load_trainable(src, cfg, device, dtype, resolve_swap(family, cfg, src))


def tiny_session(family: Any, src: Any, cfg: Any, *, total: int | None, accelerator: Any = None,
            wrap: Any = None) -> tuple[loop.Session, Any]:
    """The session (and the trainable) a training run would build; ``wrap`` (e.g. preservation.wrap)
    is applied to the loaded trainable first, as the trainer does."""
    swap = resolve_swap(family, cfg, src)
    trainable = family.load_trainable(src, cfg, CPU, torch.float32, swap)
    if wrap is not None:
        trainable = wrap(trainable)
    built = loop.build_session(cfg, family, trainable, accelerator or loop.accelerator_for(cfg), swap=swap,
                               total=total, out=lambda s: None)
    return built, trainable
