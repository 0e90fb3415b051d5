"""``imglora fetch PRESET``: the files the resolved configuration will read, downloaded before a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..models import fetch as hubfetch
from ..errors import ModelSourceError
from ..models.resolve import WEIGHT_FILE_SUFFIXES, looks_like_hub_id
from .common import family_of, load_config
from ..family import option

FILE_SETTINGS = ("path", "vae", "text_encoder", "text_encoder_2")


def fetch(preset: str, overrides: tuple[str, ...], *, dry_run: bool = False, hub: hubfetch.Hub | None = None,
          out: Callable[[str], None] = print) -> list[hubfetch.Download]:
    """Plan (and unless ``dry_run``, do) the downloads; returns them."""
    cfg = load_config(preset, overrides)
    family = family_of(cfg)
    hub = hub or hubfetch.Hub()
    m = cfg.model
    path = m.path
    if path.startswith("tiny:"):
        out(f"model.path = {path!r}: a tiny model imglora builds on this machine; nothing to fetch")
        return []
    local = Path(path).expanduser()
    if local.is_dir():
        out(f"model.path = {path!r} is a local folder; nothing to fetch")
        return []
    single = local.is_file() or local.suffix.lower() in WEIGHT_FILE_SUFFIXES
    if single:
        downloads = _single_files(hub, cfg, option(family, "published_files"))
    elif looks_like_hub_id(path):
        downloads = [hubfetch.plan_repo(hub, path, family)]
    else:
        raise ModelSourceError(f"model.path = {path!r}: not a hub id (owner/name), a folder or a file")
    for line in hubfetch.describe(downloads):
        out(line)
    if not downloads:
        out("every file the preset names is already here; nothing to fetch")
        return []
    total = sum(d.missing_bytes for d in downloads)
    if dry_run:
        out(f"dry run: {hubfetch.gb(total)} would be downloaded")
        return downloads
    hubfetch.run(hub, downloads, out)
    where = (f"model.path = {path!r} now loads from the Hugging Face cache" if not single
             else "the preset's files are in place")
    out(f"done: {where}; every file's size{' and sha256' if any(f.sha256 for d in downloads for f in d.files) else ''} "
        "checked against the hub")
    return downloads


def _single_files(hub: hubfetch.Hub, cfg: Any, known: dict[str, tuple[str, str, str]]) -> list[hubfetch.Download]:
    m = cfg.model
    names = {}
    for key in FILE_SETTINGS:
        value = getattr(m, key)
        if not value or Path(value).expanduser().is_file():
            continue
        if not m.comfyui or "/" in value or value.startswith("~"):
            raise ModelSourceError(f"model.{key} = {value!r}: no such file. imglora fetch places known single files "
                                   "by their bare names in a ComfyUI folder (model.comfyui); fetch this one "
                                   "yourself, or name a hub id in model.path")
        names[f"model.{key}"] = value
    if not names:
        return []
    return hubfetch.plan_single_files(hub, names, Path(m.comfyui).expanduser(), known)
