"""What the families whose transformer has one list of blocks and reads captions of their own length
share (Qwen-Image, Z-Image's main blocks, Krea 2, Qwen-Image 2.1): the block count from the model's
config, the swap count checked against the list, a batch of captions of other lengths padded with a
mask, the dynamic shift read from the model's scheduler config, and the export of the transformer's
modules under diffusers' own names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from ...errors import ImgloraError


def block_count(root: Path, default: int) -> int:
    """``num_layers`` of the model's transformer config."""
    c = json.loads((root / "transformer" / "config.json").read_text())
    return int(c.get("num_layers", default))


def checked_count(n: int, length: int, model: str, how: str = "") -> int:
    """``memory.blocks_to_swap`` = ``n`` checked against the list's ``length`` blocks of ``model``."""
    if n > length:
        raise ImgloraError(f"memory.blocks_to_swap = {n}, but {model} has only {length} {how or 'blocks'}; the "
                           f"largest valid number is {length}")
    return n


def collate_captions(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a bucket's entries; captions of other lengths are right-padded with zeros (as the
    pipelines pad a batch of prompts) and a ``prompt_mask`` marks their tokens. Made on the host, so
    the step needs no data-dependent decision on the device."""
    from ...data.batches import stack

    lengths = [e["prompt_embeds"].shape[0] for e in entries]
    longest = max(lengths)
    if min(lengths) == longest:
        return stack(entries)
    padded = []
    for e, k in zip(entries, lengths):
        embeds = e["prompt_embeds"]
        padded.append({**e, "prompt_embeds": torch.cat([embeds, embeds.new_zeros(longest - k, *embeds.shape[1:])]),
                       "prompt_mask": torch.arange(longest) < k})
    return stack(padded)


def scheduler_shift(root: Path | None, shipped: Path, default_max: tuple[int, float] = (4096, 1.15)
                    ) -> Callable[[int], float]:
    """The scheduler's dynamic shift as the pipelines compute it (``calculate_shift``): mu linear in
    the image's token count from (base_image_seq_len, base_shift) to (max_image_seq_len, max_shift),
    read from the model's scheduler config (``shipped``'s if the model has none); ``default_max``:
    the pipeline's fallback for a config without the two maxima."""
    path = next(p for p in ((root / "scheduler" / "scheduler_config.json") if root else None,
                            shipped / "scheduler" / "scheduler_config.json") if p is not None and p.is_file())
    c = json.loads(path.read_text())
    x0, x1 = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", default_max[0])
    y0, y1 = c.get("base_shift", 0.5), c.get("max_shift", default_max[1])

    def mu(image_seq_len: int) -> float:
        return y0 + (y1 - y0) * (image_seq_len - x0) / (x1 - x0)

    return mu


def transformer_tensors(modules: dict[str, Any], base: dict[str, torch.Tensor], model: str,
                        prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    """Every adapted module of the transformer in ComfyUI's form under ``prefix`` + diffusers' name
    (the form ComfyUI maps for FLUX.2, Krea 2 and Qwen-Image 2.1, and diffusers' loaders read)."""
    from ...adapters.forms import comfy_tensors
    from ...export.writer import add_unique

    out: dict[str, torch.Tensor] = {}
    for module, m in modules.items():
        component, path = module.split(".", 1)
        if component != "transformer":
            raise ImgloraError(f"{module}: {model} adapters export the transformer's modules only")
        add_unique(out, {f"{prefix}{path}.{k}": v for k, v in comfy_tensors(m, base.get(module)).items()})
    return out
