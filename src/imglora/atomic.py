"""Atomic file writes: write to a temporary name in the same folder, fsync, then rename.

A crash at any point leaves either the old file or the new one, never a half-written file that a
later run would trust.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_path(dest: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; on success it is renamed onto ``dest``."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=suffix + ".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, dest)
        _fsync_dir(dest.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_bytes(dest: str | os.PathLike, data: bytes) -> None:
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)


def write_text(dest: str | os.PathLike, text: str) -> None:
    write_bytes(dest, text.encode("utf-8"))


def write_json(dest: str | os.PathLike, obj: Any) -> None:
    write_text(dest, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def save_safetensors(dest: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    with atomic_path(dest, suffix=".safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


@contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside ``dest``; on success it replaces ``dest`` in one rename.

    If ``dest`` exists it is moved aside first and removed only after the new folder is in place.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        yield tmp
        _fsync_tree(tmp)  # the files' contents reach the disk before the rename makes them visible
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
        os.replace(tmp, dest)
        _fsync_dir(dest.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    for d in sorted({p for p in folder.rglob("*") if p.is_dir()} | {folder}):
        _fsync_dir(d)


def _fsync_dir(folder: Path) -> None:
    """Make a rename or a new file in ``folder`` durable (POSIX: fsync the directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # e.g. a platform without directory file descriptors
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename is then as durable as they allow
    finally:
        os.close(fd)
