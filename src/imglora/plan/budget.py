"""The plan at work: the prediction ``imglora train`` prints at its start, the ``memory.vram_budget``
refusal with the smallest change that fits, and the measurement the plan is checked against
(see :mod:`imglora.plan` for the prediction itself)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable


from ..errors import ImgloraError
from .predict import GiB, Profile, Setting, fmt, needed_vram, one_line, own_setting, precision_of, predict

if TYPE_CHECKING:
    from ..config import Config
    from ..memory.swap import SwapLayout
    from ..models.source import ModelSource


def valid_swap(family: Any, lengths: list[int], cfg: "Config", n: int) -> bool:
    from ..memory.wrap import resolve_swap

    try:
        resolve_swap(family, family.with_blocks_to_swap(cfg, n), lengths=lengths)
        return True
    except ImgloraError:
        return False


def check_at_start(cfg: "Config", family: Any, src: "ModelSource", swap: "SwapLayout", device_kind: str,
                   out: Callable[[str], None]) -> dict[str, Any] | None:
    """Print the preset's predicted peak (``swap``: the layout the run resolved); with
    ``memory.vram_budget``, refuse a setting predicted not to fit, naming the smallest change that
    does. Returns the prediction for the run record."""
    from ..family import Benchable, Plannable, supports

    budget = cfg.memory.vram_budget
    if not (supports(family, Plannable) and supports(family, Benchable)):
        return None
    if device_kind != "cuda" and not budget:
        return None  # a CPU run: tensors are small and the plan would cost more than it tells
    own = own_setting(cfg, family, swap)
    profiles: dict[Any, Profile] = {}
    p = predict(cfg, family, [own], device_kind="cuda", src=src, profiles=profiles).settings[0]
    out(one_line(p, "cuda"))
    facts = {"device_peak_bytes": p.device_peak, "host_peak_bytes": p.host_peak,
             "terms": {t.key: t.bytes for t in p.terms}}
    if budget and needed_vram(p.device_peak) > budget * GiB:
        change = smallest_change(cfg, family, src, own, budget * GiB, profiles)
        raise ImgloraError(
            f"memory.vram_budget = {budget:g} GiB, but this setting is predicted to need "
            f"{fmt(needed_vram(p.device_peak))} GiB (peak allocated {fmt(p.device_peak)} GiB + "
            f"allocator margin + CUDA context; `imglora plan {cfg.source or 'PRESET'}` shows the terms). "
            + (f"The smallest change that fits: {change}." if change else
               "No single change tried (more swapped blocks, fp8, adamw8bit, a smaller rank or resolution) fits; "
               "raise the budget or combine them."))
    return facts


def smallest_change(cfg: "Config", family: Any, src: "ModelSource", own: Setting, budget: int,
                    profiles: dict[Any, Profile]) -> str | None:
    """The first change, least intrusive first, whose prediction fits ``budget`` bytes of card."""
    from ..family import Swappable, supports

    def fits(c: "Config", s: Setting) -> int | None:
        peak = predict(c, family, [s], device_kind="cuda", src=src, profiles=profiles).settings[0].device_peak
        return peak if needed_vram(peak) <= budget else None

    precision = precision_of(cfg)
    tries: list[tuple[str, "Config", Setting]] = []
    if supports(family, Swappable):
        lengths = family.block_counts(src)
        # (a preset that sets its blocks per list itself is told that the count replaces them)
        instead = " in place of the preset's own blocks per list" if own.counts is not None else ""
        for n in range(cfg.memory.blocks_to_swap + 1, 2 * sum(lengths) + 2):
            if valid_swap(family, lengths, cfg, n):
                tries.append((f"memory.blocks_to_swap = {n}{instead}", family.with_blocks_to_swap(cfg, n),
                              Setting(precision, n)))
    if not cfg.memory.fp8:
        tries.append(("memory.fp8 = true", cfg.replace(memory={"fp8": True}), Setting("fp8", own.blocks, own.counts)))
    if cfg.train.optimizer == "adamw":
        tries.append(('train.optimizer = "adamw8bit"', cfg.replace(train={"optimizer": "adamw8bit"}), own))
    rank = cfg.lora.rank
    while rank > 4:
        rank //= 2
        tries.append((f"lora.rank = {rank}", cfg.replace(lora={"rank": rank}), own))
    res = cfg.data.max_resolution
    for r in (768, 640, 512):
        if r < res:  # with several sets: each at most r
            smaller = [dataclasses.replace(s, resolution=min(s.resolution, r)) for s in cfg.data.sets]
            text = f"data.resolution = {r}" + (" (every set at most)" if smaller else "")
            tries.append((text, cfg.replace(data={"resolution": r, "sets": smaller}), own))
    for text, c, s in tries:
        peak = fits(c, s)
        if peak is not None:
            return f"{text} (predicted peak allocated {fmt(peak)} GiB)"
    return None
