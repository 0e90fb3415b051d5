"""Resolve ``model.path`` to a model folder on this machine, without ever touching the network.

Accepted forms:
- ``tiny:<family>``: a tiny random model imglora builds on first use;
- a local folder in diffusers format (``model_index.json``) or transformers format (``config.json``);
- a hub id such as ``black-forest-labs/FLUX.1-dev``, looked up only in the local Hugging Face cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import tiny
from .errors import ModelSourceError

if TYPE_CHECKING:
    from .family import Family


def resolve_model(path: str, family: "Family") -> Path:
    if path.startswith("tiny:"):
        kind = path.removeprefix("tiny:")
        if kind != family.name:
            raise ModelSourceError(f"model.path = {path!r} is a tiny {kind} model, but model.family = "
                                   f"{family.name!r}; use tiny:{family.name}")
        return tiny.ensure_tiny(family)
    local = Path(path).expanduser()
    if local.is_dir():
        return _check_folder(local, family, path)
    if local.exists():
        raise ModelSourceError(f"model.path = {path!r} is a file; give the model's folder "
                               f"(with {family.model_marker}) or a hub id")
    if looks_like_hub_id(path):
        return _check_folder(_from_hf_cache(path), family, path)
    raise ModelSourceError(f"model.path = {path!r}: no such folder, and it is not a hub id "
                           "(owner/name) either; check the path")


def looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~"))


def _from_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        # local_files_only: never a request, so never a hang on a machine without network.
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        cache = constants.HF_HUB_CACHE
        raise ModelSourceError(
            f"model.path = {repo_id!r} is not in the local Hugging Face cache ({cache}). imglora never "
            f"downloads during a run; fetch it first with `hf download {repo_id}` (gated models "
            "also need `hf auth login` and the license accepted on the model page), "
            "or set model.path to a local folder.") from None
    except HFValidationError as exc:
        raise ModelSourceError(f"model.path = {repo_id!r} is not a valid hub id: {exc}") from None


def _check_folder(folder: Path, family: "Family", shown: str) -> Path:
    marker = family.model_marker
    if not (folder / marker).is_file():
        fmt = "diffusers" if marker == "model_index.json" else "transformers"
        raise ModelSourceError(f"model.path = {shown!r} ({folder}) has no {marker}; the {family.name} family "
                               f"needs a {fmt}-format folder")
    return folder
