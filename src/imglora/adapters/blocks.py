"""Which blocks get the adapter, and at what rank and learning rate (``lora.blocks``,
``lora.block_ranks``, ``lora.block_alphas``, ``lora.block_lr``): kohya's block selection
(``train_double_block_indices`` / ``train_single_block_indices`` for FLUX), its per-block dims and
alphas (``block_dims`` / ``block_alphas``) and learning-rate weights (``down_lr_weight`` /
``mid_lr_weight`` / ``up_lr_weight`` for SDXL).

A selector names blocks by the family's kinds (``family.lora_blocks``: kind -> the module path of its
block list, or of one block): ``"double"`` (every block of that kind), ``"double:3"`` (one),
``"double:0-9"`` (a range, both ends included). A kind whose path is a single module (SDXL's
``mid``) takes no index. The selectors resolve to module-path prefixes on the model itself, so a
range past the model's blocks is an error naming how many it has.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..errors import ConfigError
from ..family import option

SELECTOR = re.compile(r"^(?P<kind>[a-z_]+)(:(?P<first>\d+)(-(?P<last>\d+))?)?$")


def parse(selector: str, kinds: tuple[str, ...]) -> tuple[str, int | None, int | None] | str:
    """(kind, first, last) of a selector, or the problem with it (for the config's all-at-once report)."""
    m = SELECTOR.match(selector.strip())
    if not m:
        return (f"{selector!r} is not a block selector: write <kind>, <kind>:<index> or <kind>:<first>-<last> with "
                f"a kind of {', '.join(kinds)}")
    kind = m["kind"]
    if kind not in kinds:
        return f"{selector!r}: no block kind {kind!r} in this model; its kinds are {', '.join(kinds)}"
    first = int(m["first"]) if m["first"] is not None else None
    last = int(m["last"]) if m["last"] is not None else first
    if first is not None and last < first:
        return f"{selector!r}: the range ends before it starts"
    return kind, first, last


def check(cfg: Any, family: Any, where: Any, problems: list[str]) -> None:
    """The selectors of lora.blocks / block_ranks / block_alphas / block_lr, against the family's kinds
    (their index ranges are checked against the model when the adapter is made)."""
    lo = cfg.lora
    keys = {"lora.blocks": list(lo.blocks), "lora.block_ranks": list(lo.block_ranks),
            "lora.block_alphas": list(lo.block_alphas), "lora.block_lr": list(lo.block_lr)}
    if not any(keys.values()):
        return
    kinds = tuple(option(family, "lora_blocks"))
    if not kinds:
        first = next(k for k, v in keys.items() if v)
        problems.append(f"{where(first)}: block selection is for the image families; the {family.name} "
                        "family adapts the modules lora.targets names")
        return
    for key, selectors in keys.items():
        for s in selectors:
            got = parse(s, kinds)
            if isinstance(got, str):
                problems.append(f"{where(key)}: {got}")
    for key, values in (("lora.block_ranks", lo.block_ranks), ("lora.block_alphas", lo.block_alphas),
                        ("lora.block_lr", lo.block_lr)):
        for s, v in values.items():
            low, high = {"lora.block_ranks": (1, 1024), "lora.block_alphas": (0, 65536),
                         "lora.block_lr": (0, 1000)}[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high or \
                    (key == "lora.block_lr" and v == 0) or (key == "lora.block_ranks" and v != int(v)):
                what = {"lora.block_ranks": "a whole number from 1 to 1024",
                        "lora.block_alphas": "a number from 0 to 65536",
                        "lora.block_lr": "a multiplier above 0 and up to 1000 (leave a block out with lora.blocks)"}
                problems.append(f"{where(key)}: {s!r} = {v!r}; expected {what[key]}")


def prefixes(model: nn.Module, family: Any, selector: str) -> list[str]:
    """The module paths (``transformer_blocks.3``) a selector names on ``model``."""
    kinds = option(family, "lora_blocks")
    got = parse(selector, tuple(kinds))
    if isinstance(got, str):
        raise ConfigError([f"lora: {got}"])
    kind, first, last = got
    path = kinds[kind]
    module = model.get_submodule(path)
    if not isinstance(module, nn.ModuleList):
        if first is not None:
            raise ConfigError([f"lora: {selector!r}: {kind} is one block here; write {kind!r} without an index"])
        return [path]
    n = len(module)
    if first is None:
        return [f"{path}.{i}" for i in range(n)]
    if last >= n:
        raise ConfigError([f"lora: {selector!r}: the model has {n} {kind} blocks (0-{n - 1})"])
    return [f"{path}.{i}" for i in range(first, last + 1)]


def under(name: str, paths: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in paths)


def selected(model: nn.Module, family: Any, names: list[str], selectors: list[str]) -> list[str]:
    """The module ``names`` inside the blocks ``selectors`` name (all of them without selectors)."""
    if not selectors:
        return names
    paths = [p for s in selectors for p in prefixes(model, family, s)]
    return [n for n in names if under(n, paths)]


def per_module(model: nn.Module, family: Any, names: list[str], values: dict[str, Any]) -> dict[str, Any]:
    """{module name: value} from {selector: value}; a later selector wins where two name a block."""
    out: dict[str, Any] = {}
    for selector, value in values.items():
        paths = prefixes(model, family, selector)
        out.update({n: value for n in names if under(n, paths)})
    return out
