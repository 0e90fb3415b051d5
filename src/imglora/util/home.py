"""Where imglora keeps what it generates outside run folders: tiny models, assembled model configs,
the checksum memo."""

from __future__ import annotations

import os
from pathlib import Path


def imglora_home() -> Path:
    """Where imglora keeps generated files: ``$IMGLORA_HOME``, else ``~/.cache/imglora``."""
    env = os.environ.get("IMGLORA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "imglora"
