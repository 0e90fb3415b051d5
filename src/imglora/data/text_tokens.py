"""``lora.text_encoder``: captions as tokens rather than cached encoder outputs.

The adapted text encoders change with every update, so what they give for a caption cannot be
cached: each sample carries the caption's tokens instead, and the family's loss encodes them in
the step. What frozen encoders give (FLUX's T5) stays cached; when no encoder stays frozen (SDXL),
no text entry is cached at all. Kept apart from the cache code: it only replaces each caption's
text entry (``entries``) and says whether text entries are cached (``caches_text``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..family import TextEncoderTraining, supports

if TYPE_CHECKING:
    import torch

    from ..config import Config
    from ..models.source import ModelSource


def trains_text(cfg: "Config", family: Any) -> bool:
    return bool(cfg.lora.text_encoder) and supports(family, TextEncoderTraining)


def caches_text(cfg: "Config", family: Any) -> bool:
    """Whether text entries are cached: always, unless every text output comes from adapted encoders."""
    return not trains_text(cfg, family) or bool(family.frozen_text_outputs)


def entries(cfg: "Config", family: Any, src: "ModelSource", captions: list[str], cached: dict[str, dict],
            max_length: int) -> dict[str, dict[str, "torch.Tensor"]]:
    """Each caption's text entry for the samples: with lora.text_encoder, the cached outputs of the
    frozen encoders and the caption's tokens; else the cached entry as it is."""
    if not trains_text(cfg, family):
        return cached
    tokenizers = family.load_tokenizers(src)
    keep = {*family.frozen_text_outputs, "text_mask"}  # (a frozen output's mask, e.g. apply_t5_attn_mask's)
    return {c: {**{k: v for k, v in cached.get(c, {}).items() if k in keep},
                **family.tokenize(tokenizers, c, max_length)} for c in dict.fromkeys(captions)}


def summary(cfg: "Config", family: Any, n_captions: int) -> str:
    """What the log says about it ('' without lora.text_encoder)."""
    if not trains_text(cfg, family):
        return ""
    kept = f"; {', '.join(family.frozen_text_outputs)} of the frozen encoders still cached" \
        if family.frozen_text_outputs else ""
    return (f"; lora.text_encoder: {' and '.join(family.text_encoder_parts)} trained, so their outputs for the "
            f"{n_captions} caption(s) are computed in each update, not cached{kept}")
