"""Caption variants: tag shuffling and tag dropout drawn once into a fixed set, so they can be cached.

kohya sd-scripts shuffles and drops tags anew at every step, which needs the text encoders at every
step (and refuses caption or tag dropout together with cached text-encoder outputs). imglora draws
``shuffle_variants`` (K) variants per caption once, from a generator seeded by the caption and the
settings, caches each as a text entry, and a step picks one of them (``batches.Batcher``): no step
runs a text encoder, and the same K variants come back in every run, so they are encoded once.

A variant is formed as kohya forms one: the comma-separated tags, the first ``keep_tokens`` kept in
place, the rest shuffled (``shuffle_tags``), then each left out with probability ``tag_dropout``,
joined with ", ". Caption dropout (the empty caption) is drawn per step, not per variant: the empty
caption is one more cache entry, shared by every image.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from ..config import Config, DataSetConfig
    from .dataset import DatasetItem

EMPTY = ""  # the caption of caption dropout


@dataclass(frozen=True)
class TextChoice:
    """What a step may train an image's caption as: one of ``variants`` (uniformly), or the empty
    caption with probability ``dropout``."""

    variants: tuple[str, ...]
    dropout: float = 0.0

    def texts(self) -> list[str]:
        """Every text that needs a cache entry."""
        return list(dict.fromkeys(self.variants + ((EMPTY,) if self.dropout else ())))


def tags(caption: str) -> list[str]:
    return [t.strip() for t in caption.split(",") if t.strip()]


def variants(caption: str, keep_tokens: int, shuffle: bool, tag_dropout: float, k: int) -> tuple[str, ...]:
    """``k`` variants of ``caption`` (repeats possible), the same ones on every run; the caption itself
    when neither shuffling nor tag dropout is on. The ``i``-th variant depends only on the caption,
    the settings and ``i``, so raising ``k`` keeps the variants (and cache entries) there were."""
    if not (shuffle or tag_dropout):
        return (caption,)
    all_tags = tags(caption)
    fixed, flex = all_tags[:keep_tokens], all_tags[keep_tokens:]
    out = []
    for i in range(k):
        seed = hashlib.sha256(f"{caption}\0{keep_tokens}\0{shuffle}\0{tag_dropout!r}\0{i}".encode()).digest()
        rng = random.Random(seed)
        drawn = list(flex)
        if shuffle:
            rng.shuffle(drawn)
        if tag_dropout:
            drawn = [t for t in drawn if rng.random() >= tag_dropout]
        out.append(", ".join(fixed + drawn))
    return tuple(out)


def choice_for(item: "DatasetItem", s: "DataSetConfig", held_out: bool = False) -> TextChoice:
    """How ``item``'s caption is trained under its set's settings; a held-out image is scored on its
    caption as written (its loss is comparable across updates and runs)."""
    if held_out:
        return TextChoice((item.caption,))
    if s.caption_dropout >= 1.0:  # every step trains on the empty caption: the caption is never encoded
        return TextChoice((EMPTY,))
    return TextChoice(variants(item.caption, s.keep_tokens, s.shuffle_tags, s.tag_dropout, s.shuffle_variants),
                      s.caption_dropout)


def keep_tokens_warning(items: Iterable["DatasetItem"], s: "DataSetConfig") -> str | None:
    """Captions with no more tags than ``keep_tokens``: shuffling and tag dropout leave them as written."""
    if not (s.keep_tokens and (s.shuffle_tags or s.tag_dropout)):
        return None
    short = [f"{i.path.name} ({len(tags(i.caption))})" for i in items if len(tags(i.caption)) <= s.keep_tokens]
    if not short:
        return None
    shown = ", ".join(short[:5]) + (", ..." if len(short) > 5 else "")
    return (f"{len(short)} caption(s) have no more comma-separated tags than keep_tokens = {s.keep_tokens}, so "
            f"shuffle_tags and tag_dropout leave them unchanged: {shown}; lower keep_tokens or separate the tags "
            "with commas")


def preservation_captions(cfg: "Config", items: list[DatasetItem]) -> dict[DatasetItem, dict[str, str]]:
    """Each training image's output-preservation captions: "dop", its caption with its set's trigger
    word replaced by train.dop_class (train.dop_weight), "blank", the empty caption
    (train.blank_preservation_weight). Empty when neither is on."""
    import re

    t, sets = cfg.train, cfg.data.all_sets
    out: dict[DatasetItem, dict[str, str]] = {}
    for item in items:
        own: dict[str, str] = {}
        trigger = sets[item.set_index].trigger_word
        if t.dop_weight:
            own["dop"] = (re.sub(rf"(?<!\w){re.escape(trigger)}(?!\w)", t.dop_class.strip(), item.caption)
                          if trigger else item.caption)
        if t.blank_preservation_weight:
            own["blank"] = EMPTY
        if own:
            out[item] = own
    return out

