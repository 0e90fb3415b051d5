"""What data preparation hands the training loop: samples (cached tensors per variant) and the
data's version, warnings and summary. Shared by every family."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Sample:
    """One training image as the loop sees it: cached tensors for each variant (flip) and its bucket."""

    bucket: tuple[int, int]
    repeats: int
    variants: tuple[dict[str, "torch.Tensor"], ...]


@dataclass
class PreparedData:
    """What the training loop needs from a family's data preparation."""

    samples: list[Sample]
    version: str  # dataset version (a hash over the content)
    warnings: tuple[str, ...]
    summary: str  # one line for the user
    validation: list[Sample] = field(default_factory=list)  # held out; loss only, never trained on
