"""The folder that describes a single-file model's architecture: configs and tokenizers, no weights.

A single ``.safetensors`` file holds weights only. What turns them into a model is a diffusers-layout
folder of configs (``model_index.json``, ``unet/config.json``, ...) and tokenizers. The configs of the
real models ship with imglora (``families/<name>/configs/``), so nothing is downloaded; the
tokenizers (a few MB, licensed with the models) come from the local Hugging Face cache or from a
ComfyUI install, which ships CLIP's and T5's. ``model.config`` (a diffusers folder or a cached hub
id) replaces both, which is also how tests give tiny shapes.

The assembled folder lives in ``$IMGLORA_HOME/model-configs/<name>-<hash>``, built atomically and
named by its content, so two models never share a stale one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from ....util.atomic import atomic_dir
from ....models.comfyui import tokenizer_dirs
from ....errors import ModelSourceError
from ....models.resolve import hub_snapshot
from ....util.home import imglora_home

MARKER = ".imglora-config-folder"


def override(config: str, marker: str = "model_index.json") -> Path:
    """``model.config``: a local diffusers folder, or a hub id in the local cache."""
    local = Path(config).expanduser()
    folder = local if local.is_dir() else hub_snapshot(config) if "/" in config and not local.exists() else None
    if folder is None or not (folder / marker).is_file():
        raise ModelSourceError(f"model.config = {config!r}: not a diffusers model folder (no {marker}) on this "
                               "machine; give a local folder, or a hub id already in the Hugging Face cache")
    return folder


def find_parts(model: Any, find: Any, parts: dict[str, tuple[str, tuple[str, ...], str, str]],
               expect: Any) -> tuple[dict[str, Path], list[str]]:
    """The files of a model's other parts: ``parts`` maps a part to (its preset key, the ComfyUI
    folders to look in, the kind of file, an example name). Returns {part: file} of those the preset
    names (each checked to be of its kind) and the preset keys still missing, with their examples."""
    files, missing = {}, []
    for part, (key, folders, kind, example) in parts.items():
        name = getattr(model, key)
        if name:
            files[part] = find(name, folders, f"model.{key}")
            expect(files[part], kind)
        else:
            missing.append(f"model.{key} (e.g. {example})")
    return files, missing


COMFYUI_TOKENIZERS = ("clip", "t5", "qwen25")  # the kinds ComfyUI ships as tokenizer folders


def find_tokenizer(kind: str, hub: list[tuple[str, str]], comfyui: str, what: str, note: str = "") -> tuple[Path, bool]:
    """A tokenizer folder of ``kind`` ("clip", "t5", "qwen25" or "mistral"): the first ``(repo, subfolder)``
    of ``hub`` in the local Hugging Face cache, else ComfyUI's (which has no Mistral tokenizer folder: its
    FLUX.2 [dev] text encoder file carries its own). Returns (folder, from ComfyUI). ``note``: said after
    the ways to get it (e.g. that the repository is gated)."""
    markers = {"clip": ("vocab.json",), "t5": ("tokenizer.json", "spiece.model"), "qwen25": ("vocab.json",),
               "mistral": ("tokenizer.json",)}[kind]
    for repo, sub in hub:
        snap = hub_snapshot(repo)
        if snap is not None and any((snap / sub / m).is_file() for m in markers):
            return snap / sub, False
    if comfyui and kind in COMFYUI_TOKENIZERS:
        return tokenizer_dirs(comfyui, (kind,))[kind], True
    repo, sub = hub[0]
    ways = ("set model.comfyui to your ComfyUI folder (it ships them), or model.config" if kind in COMFYUI_TOKENIZERS
            else "set model.config")
    raise ModelSourceError(
        f"{what}'s tokenizer is not on this machine. imglora ships the model's configs but not its tokenizers: "
        f"fetch them once with `hf download {repo} --include '{sub}/*'` (a few MB), or {ways} to a diffusers "
        f"folder of the model{note}")


def assemble(name: str, shipped: Path, tokenizers: dict[str, Path], patches: dict[str, dict[str, Any]],
             overlay: Path | None = None) -> Path:
    """``shipped`` configs plus each tokenizer folder copied to its subfolder, with ``patches`` merged
    into that subfolder's tokenizer_config.json and special_tokens_map.json (e.g. ComfyUI's CLIP says
    model_max_length 8192 where the pipeline's says 77). ``overlay``: a folder of configs that replace
    shipped ones (a model that differs from another only there, e.g. its model_index.json)."""
    h = hashlib.sha256(json.dumps(patches, sort_keys=True).encode())
    extra = [("overlay", overlay)] if overlay is not None else []
    for label, folder in sorted([("configs", shipped), *tokenizers.items(), *extra]):
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            h.update(f"{label}/{f.relative_to(folder)}\n".encode())
            h.update(f.read_bytes())
    dest = imglora_home() / "model-configs" / f"{name}-{h.hexdigest()[:16]}"
    if (dest / MARKER).is_file():
        return dest
    with atomic_dir(dest) as tmp:
        shutil.copytree(shipped, tmp, dirs_exist_ok=True)
        if overlay is not None:
            shutil.copytree(overlay, tmp, dirs_exist_ok=True)
        for sub, folder in tokenizers.items():
            shutil.copytree(folder, tmp / sub, dirs_exist_ok=True)
            for fname in ("tokenizer_config.json", "special_tokens_map.json"):
                path = tmp / sub / fname
                if sub in patches and path.is_file():
                    data = json.loads(path.read_text())
                    data.update({k: v for k, v in patches[sub].items() if fname == "tokenizer_config.json"
                                 or k.endswith("_token")})
                    path.write_text(json.dumps(data, indent=2))
        (tmp / MARKER).write_text(json.dumps({"shipped": str(shipped), "tokenizers": {k: str(v) for k, v in
                                                                                    tokenizers.items()}}))
    return dest
