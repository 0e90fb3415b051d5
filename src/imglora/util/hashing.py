"""sha256 of files, read in chunks so multi-GB weights use little memory."""

from __future__ import annotations

import hashlib
import os


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_size):
            h.update(block)
    return h.hexdigest()
