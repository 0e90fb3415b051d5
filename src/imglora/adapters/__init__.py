"""The adapters: one file per adapter type (``lora``, ``dora``, ``loha``, ``lokr``, ``oft``: its peft
config, checks, merge, ComfyUI form and metadata, behind ``kind.Kind``), injection through peft
(``inject``), per-block ranks (``blocks``), the type-free entry points of the ComfyUI form
(``forms``), and output preservation (a prediction with the adapter off).

A new adapter type is a file defining a ``Kind`` and one entry below (its name also goes into the
config schema's ``AdapterType``, the torch-free list the config checks values against)."""

import dataclasses
from typing import TYPE_CHECKING, Any

from .dora import DORA
from .kind import Kind
from .loha import LOHA
from .lokr import LOKR
from .lora import LORA
from .oft import OFT

if TYPE_CHECKING:
    from ..config import LoraConfig

KINDS: dict[str, Kind] = {k.name: k for k in (LORA, DORA, LOHA, LOKR, OFT)}


def meaningless_keys(lo: "LoraConfig") -> dict[str, tuple[Any, str]]:
    """The [lora] keys set to a value that means nothing for ``lo.type``: each with the value that
    unsets it and why. Keys only some types read (each type's ``keys``) are unset at the schema's
    default; keys a type refuses are its ``refused``. The checks refuse such a key set in the preset
    itself or by ``--set``; the loader drops one inherited from a parent preset, with a note."""
    kind, out = KINDS[lo.type], {}
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(lo)}
    owners: dict[str, list[Kind]] = {}
    for k in KINDS.values():
        for key in k.keys:
            owners.setdefault(key, []).append(k)
    for key, kinds in owners.items():
        if kind not in kinds and getattr(lo, key) != defaults[key]:
            out[key] = (defaults[key], f"applies to lora.type = {' or '.join(repr(k.name) for k in kinds)} only, "
                                       f"and lora.type = {lo.type!r}{_counterparts(key, kinds, owners)}")
    refused, why = kind.refused(lo)
    out |= {key: (unset, why) for key, unset in refused.items()}
    return out


def _counterparts(key: str, kinds: list[Kind], owners: dict[str, list[Kind]]) -> str:
    """' (LoHa/LoKr: lora.rank_dropout, lora.module_dropout)': the other types' keys of the same role."""
    role = kinds[0].keys[key]
    others = [other for other, ks in owners.items() if role and ks[0].keys[other] == role and ks != kinds]
    if not others:
        return ""
    labels = list(dict.fromkeys(k.label for other in others for k in owners[other]))
    return f" ({'/'.join(labels)}: {', '.join(f'lora.{o}' for o in others)})"


def config_problems(lo: "LoraConfig", where: Any) -> list[str]:
    """Every [lora] error of the adapter types: keys meaningless for ``lo.type``, and its own rules."""
    out = [f"{where(f'lora.{key}')}: {why}; remove it" for key, (_, why) in meaningless_keys(lo).items()]
    return out + KINDS[lo.type].problems(lo, where)
