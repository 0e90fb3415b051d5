"""The ``[qwen_image_edit]`` and ``[qwen_image_edit_plus]`` preset sections: Qwen-Image's keys, for
the same transformer and objective."""

from __future__ import annotations

from dataclasses import dataclass

from ..qwen_image.config import QwenImageConfig


@dataclass(frozen=True)
class QwenImageEditConfig(QwenImageConfig):
    """Qwen-Image-Edit is Qwen-Image's transformer trained further on edit pairs: timestep sampling
    (the scheduler's dynamic shift for the target's size) and loss weighting are read as for
    Qwen-Image."""


@dataclass(frozen=True)
class QwenImageEditPlusConfig(QwenImageConfig):
    """Qwen-Image-Edit-2509 / -2511: as Qwen-Image-Edit."""
