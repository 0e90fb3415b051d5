"""Resolve bare model file names inside a ComfyUI installation, in ComfyUI's own search order.

A ComfyUI user says "flux1-dev.safetensors", not a path; ComfyUI looks it up in its folder list
(``folder_paths.get_full_path``), which extra_model_paths.yaml extends (e.g. models shared with
A1111 or kept on another disk). Doing the same here means the names in a user's workflow work
unchanged, and that a file is found where ComfyUI finds it, not somewhere else first.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..comfyui import EXTRA_PATHS_FILE, is_comfyui_root
from ..errors import ModelSourceError
from ._io import PathLike

# folder_paths.py: the built-in folders of each name, in search order (current ComfyUI searches
# models/unet before models/diffusion_models, and models/text_encoders before models/clip).
DEFAULT_FOLDERS = {
    "checkpoints": ("checkpoints",),
    "diffusion_models": ("unet", "diffusion_models"),
    "text_encoders": ("text_encoders", "clip"),
    "vae": ("vae",),
    "loras": ("loras",),
}
LEGACY_NAMES = {"unet": "diffusion_models", "clip": "text_encoders"}  # folder_paths.map_legacy


def resolve_root(folder: PathLike) -> Path:
    """The ComfyUI folder itself (the portable build nests it one level down as ComfyUI/)."""
    folder = Path(folder).expanduser()
    for candidate in (folder, folder / "ComfyUI"):
        if is_comfyui_root(candidate):
            return candidate.resolve()
    raise ModelSourceError(f"{folder} is not a ComfyUI folder: expected models/ beside main.py, comfy/ and "
                           "folder_paths.py (or beside custom_nodes/ for ComfyUI Desktop)")


def _kind(kind: str) -> str:
    name = LEGACY_NAMES.get(kind, kind)
    if name not in DEFAULT_FOLDERS:
        valid = ", ".join([*DEFAULT_FOLDERS, *LEGACY_NAMES])
        raise ModelSourceError(f"unknown ComfyUI model folder {kind!r}; valid: {valid}")
    return name


def extra_model_paths(root: Path) -> list[tuple[str, Path, bool]]:
    """``(folder name, folder, is_default)`` for every entry of ``<root>/extra_model_paths.yaml``,
    in file order, legacy names mapped (``clip`` -> text_encoders, ``unet`` -> diffusion_models).

    Read as ComfyUI's ``utils/extra_config.py`` does (and as imglora.comfyui.extra_lora_paths
    does for loras): ``base_path`` expands ``~`` and environment variables and is relative to
    the YAML's folder; each line of a value is one folder, relative to ``base_path`` (or to the
    YAML's folder without one).
    """
    path = root / EXTRA_PATHS_FILE
    if not path.is_file():
        return []
    import yaml

    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ModelSourceError(f"{path} is not valid YAML ({exc}); fix it (ComfyUI cannot read it either)") from None
    if not isinstance(config, dict):
        raise ModelSourceError(f"{path}: expected sections of folder names, found {type(config).__name__}")
    out = []
    for section in config.values():
        if not isinstance(section, dict):
            continue  # ComfyUI skips empty sections too
        base = section.get("base_path")
        if base is not None:
            base = Path(os.path.expandvars(os.path.expanduser(str(base))))
            base = base if base.is_absolute() else root / base
        is_default = bool(section.get("is_default", False))
        for name, value in section.items():
            if name in ("base_path", "is_default") or not isinstance(value, str):
                continue
            for line in value.split("\n"):
                line = line.strip()
                if line:
                    sub = Path(os.path.expandvars(os.path.expanduser(line)))
                    full = sub if sub.is_absolute() else (base if base is not None else root) / sub
                    out.append((LEGACY_NAMES.get(name, name), Path(os.path.normpath(full)), is_default))
    return out


def model_folders(comfy_root: PathLike, kind: str) -> list[Path]:
    """The folders ComfyUI searches for ``kind``, in its order (``folder_paths.add_model_folder_path``):
    ``is_default`` folders from the YAML go to the front, each before the previous one; other new
    folders are appended after the built-in ones; a folder already listed only moves, and only
    to the front for is_default."""
    root = resolve_root(comfy_root)
    name = _kind(kind)
    folders = [root / "models" / sub for sub in DEFAULT_FOLDERS[name]]
    for entry_name, folder, is_default in extra_model_paths(root):
        if entry_name != name:
            continue
        if folder in folders:
            if is_default:
                folders.remove(folder)
                folders.insert(0, folder)
        elif is_default:
            folders.insert(0, folder)
        else:
            folders.append(folder)
    return folders


def find_model_file(comfy_root: PathLike, kind: str, name: str) -> Path:
    """The file ComfyUI would load for ``name`` (e.g. "flux1-dev.safetensors", or a subfolder
    path like "flux/ae.safetensors") from folder ``kind``: checkpoints, diffusion_models (or its
    legacy name unet), text_encoders (or clip), vae, loras. The first folder holding it wins."""
    folders = model_folders(comfy_root, kind)
    # folder_paths.get_full_path: names cannot climb out of the folder ("../x" -> "x")
    relative = os.path.relpath(os.path.join(os.sep, name), os.sep)
    for folder in folders:
        candidate = folder / relative
        if candidate.is_file():  # a broken link is skipped, as ComfyUI does
            return candidate
    seen = sorted({str(p.relative_to(f)) for f in folders if f.is_dir()
                   for p in f.rglob("*") if p.suffix in (".safetensors", ".sft") and p.is_file()})
    found = f" Files there: {', '.join(seen[:10])}{', ...' if len(seen) > 10 else ''}." if seen else ""
    raise ModelSourceError(f"{name!r} is not in ComfyUI's {_kind(kind)} folders; searched, in order: "
                           f"{', '.join(str(f) for f in folders)}.{found} Put the file in one of them "
                           f"(or add its folder to {EXTRA_PATHS_FILE}), or give its full path.")


def tokenizer_dirs(comfy_root: PathLike) -> dict[str, Path]:
    """The tokenizers ComfyUI ships: ``{"clip": comfy/sd1_tokenizer, "t5":
    comfy/text_encoders/t5_tokenizer}``.

    The CLIP one serves CLIP-L and SDXL's CLIP-G alike; its tokenizer_config.json says
    ``model_max_length`` 8192, so load it with ``model_max_length=77`` (and ``pad_token="!"`` for
    SDXL's second tokenizer, as its diffusers copy has). The T5 one has tokenizer.json but no
    spiece.model: load it with ``T5TokenizerFast``.
    """
    root = resolve_root(comfy_root)
    dirs = {"clip": root / "comfy" / "sd1_tokenizer", "t5": root / "comfy" / "text_encoders" / "t5_tokenizer"}
    expected = {"clip": "vocab.json", "t5": "tokenizer.json"}
    missing = [str(d / expected[k]) for k, d in dirs.items() if not (d / expected[k]).is_file()]
    if missing:
        raise ModelSourceError(f"{root} lacks ComfyUI's tokenizer files ({', '.join(missing)}); update or "
                               "reinstall ComfyUI, or give a diffusers model folder for the tokenizers")
    return dirs
