"""What data preparation hands the training loop: samples (cached tensors per variant) and the
data's version, warnings and summary. Shared by every family."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Sample:
    """One training image as the loop sees it: cached tensors for each variant (flip) and its bucket.

    ``texts``, when given, are its caption's cached text variants (``data.captions``): a batch takes
    one variant's tensors and one text's, or ``empty_text`` with probability ``caption_dropout``.
    Without ``texts`` each variant already holds everything (an image trained on one caption, the
    chat family's samples).
    ``regularization`` samples are interleaved by the batcher rather than repeated."""

    bucket: tuple[int, int]
    repeats: int
    variants: tuple[dict[str, "torch.Tensor"], ...]
    texts: tuple[dict[str, "torch.Tensor"], ...] = ()
    caption_dropout: float = 0.0
    empty_text: dict[str, "torch.Tensor"] | None = None
    regularization: bool = False
    sources: int = 0  # edit pairs: the target's source images (images with other counts never share a batch)
    # Output preservation (train.dop_weight, train.blank_preservation_weight): text entries of the image's
    # other captions by name ("dop", "blank"), denoised beside its own (imglora.adapters.preservation).
    preserve: dict[str, dict[str, "torch.Tensor"]] = field(default_factory=dict)

    @property
    def batch_key(self) -> tuple[int, ...]:
        """What a batch's samples share: the bucket, and the number of sources where it is above one
        (their tokens are concatenated, so every sample of a batch needs as many)."""
        return self.bucket if self.sources <= 1 else (*self.bucket, self.sources)

    def entry(self, variant: int = 0, text: int = 0) -> dict[str, "torch.Tensor"]:
        """The tensors of one variant with one of its texts (-1: the empty caption)."""
        if not self.texts:
            return self.variants[variant]
        return {**self.variants[variant], **(self.empty_text if text < 0 else self.texts[text])}


@dataclass
class PreparedData:
    """What the training loop needs from a family's data preparation."""

    samples: list[Sample]
    version: str  # dataset version (a hash over the content)
    warnings: tuple[str, ...]
    summary: str  # one line for the user
    validation: list[Sample] = field(default_factory=list)  # held out; loss only, never trained on
    sets: list[dict[str, Any]] = field(default_factory=list)  # per data set: images, repeats, version (the record)
    encoded: int = 0  # cache entries this preparation encoded (0 when the cache was complete)
