"""The content-addressed store: one safetensors file per entry, named by the entry's key.

An entry carries its own key and a checksum of its tensors in its header, so a file that is
corrupt, or that is a valid entry of another key copied into its place, is detected on read. Writes
go to a temporary name and are renamed into place (``atomic.save_safetensors``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..util import atomic
from ..errors import ImgloraError

if TYPE_CHECKING:
    import torch


class CorruptEntry(ImgloraError):
    pass


class Cache:
    """Entries under ``root/<kind>/<key[:2]>/<key>.safetensors``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / f"{key}.safetensors"

    def has(self, kind: str, key: str) -> bool:
        return self.path(kind, key).is_file()

    def put(self, kind: str, key: str, tensors: dict[str, "torch.Tensor"], info: dict[str, Any] | None = None) -> None:
        # The key inside the entry: a valid entry of another key in this file's place is caught on read.
        meta = {"checksum": _checksum(tensors), "key": key, "kind": kind}
        if info:
            meta["info"] = json.dumps(info, sort_keys=True)
        atomic.save_safetensors(self.path(kind, key), tensors, metadata=meta)

    def drop(self, kind: str, key: str) -> None:
        self.path(kind, key).unlink(missing_ok=True)

    def get(self, kind: str, key: str) -> dict[str, "torch.Tensor"]:
        from safetensors import SafetensorError

        from ..util.owned import read_file

        path = self.path(kind, key)
        try:
            tensors, meta = read_file(path)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptEntry(f"cache entry {path} cannot be read ({exc}); it will be re-encoded") from None
        if meta.get("key") != key:
            raise CorruptEntry(f"cache entry {path} holds another entry (key {str(meta.get('key'))[:12]}..., copied or "
                               "renamed into this place); it will be re-encoded")
        if meta.get("checksum") != _checksum(tensors):
            raise CorruptEntry(f"cache entry {path} does not match its checksum; it will be re-encoded")
        return tensors

    def info(self, kind: str, key: str) -> dict[str, Any]:
        """What the encoder noted beside an entry's tensors (e.g. token counts), from its header only."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path(kind, key)), framework="pt") as fh:
                return json.loads((fh.metadata() or {}).get("info", "{}"))
        except (SafetensorError, OSError, ValueError):
            return {}


def _checksum(tensors: dict[str, "torch.Tensor"]) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
