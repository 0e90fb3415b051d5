"""ComfyUI's folders: the LoRA folder to export into, and model files by their bare names, as
ComfyUI itself resolves them (its workflows are written by ``imglora.export.workflows``)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ImgloraError, ModelSourceError

# ---------------------------------------------------------------------------------------------
# Folder detection
# ---------------------------------------------------------------------------------------------

# A git checkout, and the ComfyUI/ folder inside the Windows portable build, hold ComfyUI's
# sources; ComfyUI Desktop's base folder holds no sources but models/ beside custom_nodes/.
_SOURCE_MARKERS = ("main.py", "comfy", "folder_paths.py")
_DESKTOP_MARKERS = ("custom_nodes",)
EXTRA_PATHS_FILE = "extra_model_paths.yaml"


def is_comfyui_root(folder: Path) -> bool:
    if not (folder / "models").is_dir():
        return False
    return (all((folder / m).exists() for m in _SOURCE_MARKERS)
            or all((folder / m).is_dir() for m in _DESKTOP_MARKERS))


def find_root(folder: str | os.PathLike, setting: str = "--comfyui") -> Path:
    """The ComfyUI folder the user meant (``setting`` names where they said it), or an error that
    says what was expected."""
    folder = Path(folder).expanduser()
    elsewhere = (" Use --out FILE to write the LoRA anywhere else." if setting == "--comfyui"
                 else " Or give the files' full paths instead.")
    if not folder.is_dir():
        what = "not a folder" if folder.exists() else "no such folder"
        raise ModelSourceError(f"{setting} {folder}: {what}. Give the ComfyUI folder (the one with main.py and "
                               f"models/).{elsewhere}")
    for candidate in (folder, folder / "ComfyUI"):  # the portable build nests ComfyUI/ one level down
        if is_comfyui_root(candidate):
            return candidate.resolve()
    hint = ""
    for parent in list(folder.resolve().parents)[:3]:  # e.g. ComfyUI/models/loras was given
        if is_comfyui_root(parent):
            hint = f" It lies inside the ComfyUI folder {parent}; pass that folder instead."
            break
    raise ModelSourceError(
        f"{setting} {folder} is not a ComfyUI folder: expected models/ beside main.py, comfy/ and "
        "folder_paths.py (a ComfyUI checkout, or ComfyUI/ inside the portable build), or models/ beside "
        f"custom_nodes/ (ComfyUI Desktop's base folder).{hint}{elsewhere}")


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


def _kind(kind: str) -> str:
    name = LEGACY_NAMES.get(kind, kind)
    if name not in DEFAULT_FOLDERS:
        valid = ", ".join([*DEFAULT_FOLDERS, *LEGACY_NAMES])
        raise ModelSourceError(f"unknown ComfyUI model folder {kind!r}; valid: {valid}")
    return name


def extra_model_paths(root: Path) -> list[tuple[str, Path, bool]]:
    """``(folder name, folder, is_default)`` for every entry of ``<root>/extra_model_paths.yaml``,
    in file order, legacy names mapped (``clip`` -> text_encoders, ``unet`` -> diffusion_models).

    Read as ComfyUI's ``utils/extra_config.py`` does: ``base_path`` expands ``~`` and environment variables and is relative to
    the YAML's folder; each line of a value is one folder, relative to ``base_path`` (or to the
    YAML's folder without one).
    """
    path = root / EXTRA_PATHS_FILE
    if not path.is_file():
        return []
    import yaml

    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:  # its text spans lines (a caret under the line quoted): said in one
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        detail = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ModelSourceError(f"{path} is not valid YAML ({detail}{where}); fix it (ComfyUI cannot read it "
                               "either)") from None
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


def model_folders(comfy_root: str | os.PathLike, kind: str) -> list[Path]:
    """The folders ComfyUI searches for ``kind``, in its order (``folder_paths.add_model_folder_path``):
    ``is_default`` folders from the YAML go to the front, each before the previous one; other new
    folders are appended after the built-in ones; a folder already listed only moves, and only
    to the front for is_default."""
    root = find_root(comfy_root, "model.comfyui")
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


def find_model_file(comfy_root: str | os.PathLike, kind: str, name: str) -> Path:
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


def tokenizer_dirs(comfy_root: str | os.PathLike, kinds: tuple[str, ...] = ("clip", "t5")) -> dict[str, Path]:
    """The tokenizers ComfyUI ships, of ``kinds``: ``{"clip": comfy/sd1_tokenizer, "t5":
    comfy/text_encoders/t5_tokenizer, "qwen25": comfy/text_encoders/qwen25_tokenizer}`` (Qwen2.5's,
    which Qwen-Image's text encoder reads: vocab.json + merges.txt).

    The CLIP one serves CLIP-L and SDXL's CLIP-G alike; its tokenizer_config.json says
    ``model_max_length`` 8192, so load it with ``model_max_length=77`` (and ``pad_token="!"`` for
    SDXL's second tokenizer, as its diffusers copy has). The T5 one has tokenizer.json but no
    spiece.model: load it with ``T5TokenizerFast``.
    """
    root = find_root(comfy_root, "model.comfyui")
    text = root / "comfy" / "text_encoders"
    every = {"clip": root / "comfy" / "sd1_tokenizer", "t5": text / "t5_tokenizer", "qwen25": text / "qwen25_tokenizer"}
    dirs = {k: every[k] for k in kinds}
    expected = {"clip": "vocab.json", "t5": "tokenizer.json", "qwen25": "vocab.json"}
    missing = [str(d / expected[k]) for k, d in dirs.items() if not (d / expected[k]).is_file()]
    if missing:
        raise ModelSourceError(f"{root} lacks ComfyUI's tokenizer files ({', '.join(missing)}); update or "
                               "reinstall ComfyUI, or give a diffusers model folder for the tokenizers")
    return dirs


def export_folder(root: Path) -> Path:
    """Where ComfyUI itself would save a new LoRA: the first folder of its search path."""
    folder = model_folders(root, "loras")[0]
    if folder != root / "models" / "loras" and not folder.is_dir():
        raise ImgloraError(f"{root / EXTRA_PATHS_FILE} makes {folder} the default LoRA folder (is_default), but "
                           "it does not exist; create it or fix the file, or pass --out FILE")
    return folder
