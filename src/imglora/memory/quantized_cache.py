"""A quantized base model kept on disk, so the next run skips reading the full-precision weights and
quantizing them again.

An entry is a folder named by a key over the source files' checksums, the model config and the
quantization settings. It holds one safetensors file per part of the model (each transformer block,
and ``rest`` for everything outside the blocks) in quanto's own state-dict form (a quantized Linear
as ``<module>.weight._data`` in float8 plus ``<module>.weight._scale``), and ``entry.json`` naming
the quantized layers. Parts are written as the model is streamed and quantized, one at a time, and
read back the same way, so host memory stays at one block beyond what training keeps there. The
folder is built under a temporary name and renamed when complete: a run killed half-way leaves no
entry that a later run could take for a good one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..util import atomic

FORMAT = 1
REST = "rest"


class DamagedEntry(ValueError):
    """The entry does not hold what its ``entry.json`` says (cut short, edited, or another model's)."""


def key(sources: Mapping[str, str], settings: Mapping[str, Any]) -> str:
    """The entry's name: the source files' checksums, the settings, the format and library versions."""
    from importlib import metadata

    from ..util.version import __version__

    # imglora's own version too: an entry written by an older loader is never trusted by a newer one.
    blob = {"format": FORMAT, "sources": dict(sources), "settings": dict(settings), "imglora": __version__,
            "quanto": metadata.version("optimum-quanto"), "torch": torch.__version__.split("+")[0]}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:32]


def quantized_layers(module: nn.Module, prefix: str = "") -> dict[str, str]:
    """``{full module name: qtype name}`` of the quanto layers in ``module``."""
    return {prefix + name: m.weight_qtype.name for name, m in module.named_modules()
            if getattr(m, "weight_qtype", None) is not None}


def _state(module: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()
            if not (skip and k.startswith(skip))}


class Writer:
    """Builds an entry part by part: ``add`` each block as it is ready, then ``finish`` with the
    whole model (writes ``rest`` and renames the folder into place). ``abandon`` removes the
    unfinished folder."""

    def __init__(self, folder: Path, settings: Mapping[str, Any]) -> None:
        self.folder = folder
        self.partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
        shutil.rmtree(self.partial, ignore_errors=True)
        self.partial.mkdir(parents=True)
        self.settings = dict(settings)
        self.layers: dict[str, str] = {}
        self.parts: list[str] = []
        self.bytes = 0

    def add(self, prefix: str, module: nn.Module) -> None:
        path = self.partial / f"{prefix.rstrip('.')}.safetensors"
        atomic.save_safetensors(path, _state(module))
        self.bytes += path.stat().st_size
        self.layers.update(quantized_layers(module, prefix))
        self.parts.append(prefix)

    def finish(self, model: nn.Module) -> Path:
        path = self.partial / f"{REST}.safetensors"
        atomic.save_safetensors(path, _state(model, tuple(self.parts)))
        self.bytes += path.stat().st_size
        self.layers.update({n: q for n, q in quantized_layers(model).items() if not n.startswith(tuple(self.parts))})
        atomic.write_json(self.partial / "entry.json", {"format": FORMAT, "settings": self.settings,
                                                        "parts": self.parts, "layers": self.layers,
                                                        "bytes": self.bytes})
        if self.folder.exists():  # a damaged entry found at the start of this run, or a parallel writer
            shutil.rmtree(self.folder, ignore_errors=True)
        os.replace(self.partial, self.folder)
        return self.folder

    def abandon(self) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)


def load(folder: Path, model: nn.Module, parts: Sequence[tuple[str, nn.Module]], dtype: torch.dtype,
         on_part: Callable[[str, nn.Module], None] | None = None) -> nn.Module:
    """Fill ``model`` -- built on the meta device with plain Linear layers -- from the entry in
    ``folder``: first ``rest`` (everything outside ``parts``), then each part (``(prefix, module)``
    pairs, e.g. the transformer blocks) in order, handing it to ``on_part(prefix, module)`` before
    the next is read. Raises :class:`DamagedEntry` when the files do not match the model."""
    from optimum.quanto import qtypes
    from optimum.quanto.nn import QLinear

    from .fp8 import _set_submodule

    try:
        entry = json.loads((folder / "entry.json").read_text())
        layers, saved_parts = entry["layers"], entry["parts"]
    except (OSError, ValueError, KeyError) as e:
        raise DamagedEntry(f"{folder}: no readable entry.json ({e})") from e
    if saved_parts != [p for p, _ in parts]:
        raise DamagedEntry(f"{folder}: holds parts {saved_parts[:2]}..., the model has {[p for p, _ in parts][:2]}...")
    for name, qtype in layers.items():  # the quantized layers, rebuilt empty in place of the Linear ones
        try:
            lin = model.get_submodule(name)
        except AttributeError as e:
            raise DamagedEntry(f"{folder}: names a layer {name!r} the model does not have") from e
        q = QLinear(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta", dtype=dtype,
                    weights=qtypes[qtype])
        _set_submodule(model, name, q)
    prefixes = tuple(p for p, _ in parts)
    _fill(folder / f"{REST}.safetensors", model, prefixes)
    for prefix, module in parts:
        _fill(folder / f"{prefix.rstrip('.')}.safetensors", module, ())
        if on_part is not None:
            on_part(prefix, module)
    saved = set(model.state_dict())  # a non-persistent buffer is never saved: the model makes it itself
    left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta and n in saved]
    if left:
        raise DamagedEntry(f"{folder}: {len(left)} tensors missing (e.g. {left[0]})")
    return model


def _fill(path: Path, target: nn.Module, skip: tuple[str, ...]) -> None:
    """Load the file into ``target`` through quanto's own deserialization (which rebuilds a quantized
    weight from its ``weight._data``/``weight._scale``); names under ``skip`` are filled later."""
    from ..util.owned import load_file, own_module

    try:
        state = load_file(path)
    except Exception as e:  # noqa: BLE001 - safetensors' errors for a cut-short file vary by version
        raise DamagedEntry(f"{path}: not a readable safetensors file ({e})") from e
    try:
        missing, unexpected = target.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # a shape mismatch: another model's entry
        raise DamagedEntry(f"{path}: {str(e).splitlines()[0]}") from e
    missing = [k for k in missing if not (skip and k.startswith(skip))]
    if missing or unexpected:
        raise DamagedEntry(f"{path}: does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    for p in target.parameters():  # quanto's loader makes every weight it rebuilds trainable
        p.requires_grad_(False)
    own_module(target)
