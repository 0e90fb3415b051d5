"""The optimizer a run trains with, made from ``train.optimizer`` and ``train.optimizer_args`` as
``imglora.config.optimizer_names`` resolves and checks them (its docstring: which names, which
arguments, which modules may be imported)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..config.optimizer_names import (ALLOW_ANY, KNOWN, TRUSTED, Known, Resolved, check,  # noqa: F401 (re-exported)
                                      is_schedule_free, keyword_arguments, resolve, trusted)
from ..errors import ImgloraError

if TYPE_CHECKING:
    from ..config.schema import Config


def missing_package(cfg: "Config") -> str | None:
    """``pip install X`` for the optimizer's package when it is not installed, else None."""
    r = resolve(cfg.train.optimizer)
    if isinstance(r, Resolved) and not r.installed():
        return r.pip or r.module.split(".")[0]
    return None


def make(cfg: "Config", params: list[Any]) -> torch.optim.Optimizer:
    """The optimizer over ``params`` (parameters, or parameter groups with their own ``lr``)."""
    r = resolve(cfg.train.optimizer)
    if isinstance(r, str):
        raise ImgloraError(f"train.optimizer: {r}")
    cls = r.load(cfg.train.optimizer_allow_any)  # an Optimizer subclass, checked before it is called
    kwargs = keyword_arguments(cfg, r, cls)
    try:
        optimizer = cls(params, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ImgloraError(f"train.optimizer = \"{cfg.train.optimizer}\" ({r.path}) refused its arguments "
                           f"{sorted(kwargs)}: {exc}") from None
    if has_modes(optimizer):
        optimizer.train()  # schedule-free: steps only in train mode
    return optimizer


def has_modes(optimizer: Any) -> bool:
    """Whether the optimizer has a train and an eval mode (schedule-free optimizers)."""
    return callable(getattr(optimizer, "train", None)) and callable(getattr(optimizer, "eval", None))


def note(cfg: "Config") -> str | None:
    """What to tell the user about their optimizer setting, if anything."""
    r = resolve(cfg.train.optimizer)
    if isinstance(r, Resolved) and r.name == "prodigy" and cfg.train.learning_rate < 0.1:
        return (f"train.optimizer = \"prodigy\" with train.learning_rate = {cfg.train.learning_rate:g}: Prodigy "
                "scales its own estimate of the step size by the learning rate, so use 1.0 (a commented preset: "
                "presets/*prodigy*.toml)")
    return None
