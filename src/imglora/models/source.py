"""``ModelSource``: where a family finds its model on this machine (see ``imglora.models.resolve`` for how
``model.path`` becomes one)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runs import record


@dataclass(frozen=True)
class ModelSource:
    """A model folder in the family's own layout (``root``, ``files`` empty), or single files: then
    ``files`` maps each part ("checkpoint", "transformer", "vae", "text_encoder", ...) to its file
    and ``root`` is a folder of the architecture's configs and tokenizers, without weights."""

    root: Path
    files: Mapping[str, Path] = field(default_factory=dict)

    def file(self, part: str) -> Path | None:
        return self.files.get(part)

    def __str__(self) -> str:
        if not self.files:
            return str(self.root)
        return ", ".join(f"{part} {path}" for part, path in self.files.items())

    def checksums(self) -> dict[str, str]:
        """sha256 of every weights file (hashed once per file and remembered: record.cached_sha256)."""
        if not self.files:
            return record.folder_checksums(self.root)
        return {f"{part}:{path.name}": record.cached_sha256(path) for part, path in self.files.items()}

    def to_record(self) -> dict[str, Any]:
        return {"root": str(self.root), "files": {part: str(path) for part, path in self.files.items()}}
