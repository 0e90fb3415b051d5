"""The cache's warnings about what an image or caption will train on: captions cut off by their text
encoder's token limit, masks that keep nothing of an image's crop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .store import Cache

if TYPE_CHECKING:
    from ..config import Config
    from .dataset import DatasetItem
    from .samples import Sample


def overflow_warning(cfg: "Config", the_plan: Any) -> str | None:
    """One warning naming the captions of ``the_plan`` (a cache.CachePlan) longer than their text
    encoder's token limit: they were cut off when encoded, so their tail is never trained on. Read
    from the entries' headers (the encoder counted the tokens), so it is said on every run."""
    cache = Cache(cfg.cache.dir)
    images: dict[str, list[str]] = {}
    for item, choice in the_plan.choices.items():
        for text in choice.variants:
            images.setdefault(text, []).append(item.path.name)
    long: list[str] = []
    for spec in {s.key: s for s in the_plan.texts.values()}.values():
        tokens = cache.info("text", spec.key).get("tokens", {})
        over = [f"{name} {n} of {limit}" for name, (n, limit) in sorted(tokens.items()) if n > limit]
        if over:
            named = [spec.item.path.name] if spec.item is not None else images.get(spec.caption, ["?"])[:2]
            long.append(f"{', '.join(dict.fromkeys(named))} ({'; '.join(over)} tokens)")
    if not long:
        return None
    return (f"{len(long)} caption(s) are longer than the text encoder reads and are cut off (the rest is not "
            f"trained on): {', '.join(long[:5])}{', ...' if len(long) > 5 else ''}; shorten them, or raise "
            "cache.text_max_length where the encoder allows it")


def mask_warning(cfg: "Config", samples: list[Sample], items: list[DatasetItem]) -> str | None:
    """Masks that keep nothing inside the image's crop: that image then trains on nothing."""
    empty = [item.path.name for item, s in zip(items, samples)
             if any("loss_mask" in v and not bool(v["loss_mask"].any()) for v in s.variants)]
    if not empty:
        return None
    return (f"{len(empty)} image(s) have a mask that is black wherever their bucket's crop keeps the image, so they "
            f"train on nothing: {', '.join(empty[:5])}{', ...' if len(empty) > 5 else ''}; move the white part "
            "into the middle of the image or crop the image yourself")
