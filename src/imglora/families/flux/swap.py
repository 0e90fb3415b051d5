"""Which FLUX blocks are swapped, and how kohya sd-scripts' single swap count maps onto them.

kohya counts "swap n blocks" as n//2 double blocks plus (n - n//2)*2 single blocks, the last ones of
each list (a single block has about half a double block's parameters): 18 = 9 of 19 double + 18 of
38 single, about 5.6B of FLUX's 11.9B parameters. Users migrating from kohya read the number that
way, so ``memory.blocks_to_swap`` uses it; ``[flux] double_blocks_to_swap`` /
``single_blocks_to_swap`` set the two counts directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import ImgloraError

BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")


def block_counts(root: Path) -> list[int]:
    """Blocks in each list (double, single), from the transformer's config (in ``root``) alone."""
    c = json.loads((root / "transformer" / "config.json").read_text())
    return [int(c.get("num_layers", 19)), int(c.get("num_single_layers", 38))]


def with_blocks_to_swap(cfg: Any, n: int) -> Any:
    """``cfg`` with kohya's count ``n`` as its swap setting, the explicit double/single counts unset."""
    return cfg.replace(memory={"blocks_to_swap": n}, family={"double_blocks_to_swap": -1, "single_blocks_to_swap": -1})


def swap_counts(lengths: list[int], cfg: Any) -> list[int]:
    """Double and single blocks to swap: the preset's explicit counts, else its memory.blocks_to_swap
    (kohya's count)."""
    settings = cfg.family
    if settings.double_blocks_to_swap >= 0 or settings.single_blocks_to_swap >= 0:
        counts = [max(0, settings.double_blocks_to_swap), max(0, settings.single_blocks_to_swap)]
        section = cfg.model.family  # flux, or a family on its transformer (flux_kontext) with the same keys
        for name, n, size in zip((f"{section}.double_blocks_to_swap", f"{section}.single_blocks_to_swap"), counts,
                                 lengths):
            if n > size:
                raise ImgloraError(f"{name} = {n}, but the model has only {size} such blocks")
        return counts
    n = cfg.memory.blocks_to_swap
    try:
        return list(kohya_split(n, lengths[0], lengths[1]))
    except ValueError as exc:
        raise ImgloraError(f"memory.blocks_to_swap = {n}: {exc}") from None


def kohya_split(n: int, n_double: int, n_single: int) -> tuple[int, int]:
    """kohya sd-scripts' meaning of "swap ``n`` FLUX blocks": ``(n // 2, (n - n // 2) * 2)``
    double and single blocks (a single block has about half a double block's parameters)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"number of blocks to swap must be an int, got {n!r}")
    if n < 0:
        raise ValueError(f"number of blocks to swap must be >= 0, got {n}")
    n_d, n_s = n // 2, (n - n // 2) * 2
    if n_d > n_double or n_s > n_single:
        # floor(k/2) <= n_double and 2*ceil(k/2) <= n_single
        largest = min(2 * n_double + 1, 2 * (n_single // 2))
        raise ValueError(
            f"swapping {n} blocks means {n_d} double and {n_s} single blocks (kohya's convention: "
            f"n//2 double + (n - n//2)*2 single), but the model has {n_double} double and {n_single} "
            f"single blocks; the largest valid number is {largest}"
        )
    return n_d, n_s
