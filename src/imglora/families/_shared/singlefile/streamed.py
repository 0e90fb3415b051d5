"""A diffusers transformer read block by block from a single file in its original layout, through a
name map: each diffusers tensor is one file tensor, or some of its rows (a third of a fused q/k/v,
the two halves of an adaLN weight swapped), or its values reshaped (a flat modulation table).

The families whose files are in an original layout (FLUX.2, Krea 2) give the map; this module checks
it against the model (every key and shape, naming the file and the keys, before anything is read),
reads what is outside the block lists first, then each block, handed to ``on_block(kind, index,
block)`` as soon as it is read (``_shared.stream``), so the host never holds the model whole in its
load dtype. Rows are read as rows (``Reader.get(rows=...)``), so a fused fp8 tensor is never upcast
whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ....errors import ModelSourceError
from ....memory.host import release_free_memory
from ....models.safefiles import Reader, check_shapes, diffusers_config, open_file
from ....util.owned import own_module


@dataclass(frozen=True)
class Part:
    """Where a diffusers tensor is in the file: ``key`` (the file's, prefix included), the row ranges
    to take of it in order (None: all of it), and whether its values are reshaped to the model's
    shape (a flat table)."""

    key: str
    rows: tuple[tuple[int, int], ...] | None = None
    reshape: bool = False


Names = dict[str, Part]  # diffusers key -> its part of the file


def part_shape(r: Reader, part: Part, want: tuple[int, ...] | None) -> tuple[int, ...]:
    shape = r.shape(part.key)
    if part.rows is not None:
        shape = (sum(b - a for a, b in part.rows), *shape[1:])
    if part.reshape and want is not None and _numel(shape) == _numel(want):
        return tuple(want)
    return tuple(shape)


def read_part(r: Reader, part: Part, dtype: torch.dtype, want: tuple[int, ...] | None = None) -> torch.Tensor:
    if part.rows is None:
        t = r.get(part.key, dtype)
    elif len(part.rows) == 1:
        t = r.get(part.key, dtype, rows=part.rows[0])
    else:
        t = torch.cat([r.get(part.key, dtype, rows=rows) for rows in part.rows])
    return t.reshape(want) if part.reshape and want is not None else t


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def thirds(key: str, rows: int) -> list[Part]:
    """The q, k and v rows of a fused ``key`` of ``rows`` rows."""
    h = rows // 3
    return [Part(key, ((i * h, (i + 1) * h),)) for i in range(3)]


def load_transformer(path: Path, model_class: str, root: Path, name_map: Callable[[Reader], Names],
                     blocks: Mapping[str, str], dtype: torch.dtype, on_block: Any, what: str, hint: str) -> Any:
    """``model_class`` (the config of ``root``) from ``path``'s tensors as ``name_map(reader)`` maps
    them; ``blocks``: its block lists ({kind: attribute}); ``what`` and ``hint`` name the model and
    its config in the message of a file that does not fit."""
    import diffusers

    cls = getattr(diffusers, model_class)
    config = diffusers_config(cls, root, "transformer")
    with torch.device("meta"):
        model = cls.from_config(config)
    model.requires_grad_(False)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with open_file(path) as r:
        names = name_map(r)
        shapes = {n: part_shape(r, p, want.get(n)) for n, p in names.items()}
        check_shapes(path, what, shapes, want, hint)

        def get(n: str) -> torch.Tensor:
            return read_part(r, names[n], dtype, want[n])

        inside = tuple(f"{name}." for name in blocks.values())
        model.load_state_dict({n: get(n) for n in want if not n.startswith(inside)}, strict=False, assign=True)
        own_module(model)
        for kind, name in blocks.items():
            for index, block in enumerate(getattr(model, name)):
                pre = f"{name}.{index}."
                block.load_state_dict({n[len(pre):]: get(n) for n in want if n.startswith(pre)}, strict=True,
                                      assign=True)
                own_module(block)
                if on_block is not None:
                    on_block(kind, index, block)
                release_free_memory()
    return model.eval()


def base_weights(path: Path, name_map: Callable[[Reader], Names], paths: list[str], what: str) -> dict[str, torch.Tensor]:
    """fp32 weights (``<path>.weight``) of the modules ``paths``, from the file (DoRA's export)."""
    out = {}
    with open_file(path) as r:
        names = name_map(r)
        for p in paths:
            if f"{p}.weight" not in names:
                raise ModelSourceError(f"{path}: no weight in this {what} for the adapted module {p}")
            out[p] = read_part(r, names[f"{p}.weight"], torch.float32)
    return out
