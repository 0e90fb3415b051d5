"""ComfyUI: find its LoRA folder, and write a ready-to-run workflow for an exported LoRA.

A family describes its workflow once, as a table of nodes (``Node``, built with the helpers
below), and this module writes it in both formats ComfyUI reads:
the API format (what ``POST /prompt`` takes) and the UI graph (what the browser loads when the
file is dropped onto it). Both come from the same table, so they cannot drift apart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ImgloraError

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


def find_root(folder: str | os.PathLike) -> Path:
    """The ComfyUI folder the user meant, or an ImgloraError that says what was expected."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        what = "not a folder" if folder.exists() else "no such folder"
        raise ImgloraError(f"--comfyui {folder}: {what}. Give the ComfyUI folder (the one with main.py and "
                           "models/), or use --out FILE to write the LoRA elsewhere.")
    for candidate in (folder, folder / "ComfyUI"):  # the portable build nests ComfyUI/ one level down
        if is_comfyui_root(candidate):
            return candidate.resolve()
    hint = ""
    for parent in list(folder.resolve().parents)[:3]:  # e.g. ComfyUI/models/loras was given
        if is_comfyui_root(parent):
            hint = f" It lies inside the ComfyUI folder {parent}; pass that folder instead."
            break
    raise ImgloraError(
        f"--comfyui {folder} is not a ComfyUI folder: expected models/ beside main.py, comfy/ and "
        "folder_paths.py (a ComfyUI checkout, or ComfyUI/ inside the portable build), or models/ beside "
        f"custom_nodes/ (ComfyUI Desktop's base folder).{hint} Use --out FILE to write the LoRA anywhere else.")


def extra_lora_paths(root: Path) -> list[tuple[Path, bool]]:
    """``(folder, is_default)`` for each LoRA folder named in ``<root>/extra_model_paths.yaml``.

    Resolved as ComfyUI's ``utils/extra_config.py`` does: ``base_path`` expands ``~`` and
    environment variables and is relative to the YAML file's folder; each line of a section's
    ``loras`` value is a folder relative to ``base_path`` (or to the YAML's folder without one).
    """
    path = root / EXTRA_PATHS_FILE
    if not path.is_file():
        return []
    try:
        import yaml
    except ImportError as exc:  # PyYAML comes with transformers/accelerate; say so if it is gone
        raise ImgloraError(f"{path} exists but PyYAML is not installed to read it: pip install pyyaml") from exc
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ImgloraError(f"{path} is not valid YAML ({exc}); fix it, or pass --out FILE") from None
    if not isinstance(config, dict):
        raise ImgloraError(f"{path}: expected sections of folder names, found {type(config).__name__}")
    out = []
    for section in config.values():
        if not isinstance(section, dict) or not isinstance(section.get("loras"), str):
            continue
        base = section.get("base_path")
        if base is not None:
            base = Path(os.path.expandvars(os.path.expanduser(str(base))))
            base = base if base.is_absolute() else root / base
        for line in section["loras"].split("\n"):
            line = line.strip()
            if line:
                sub = Path(os.path.expandvars(os.path.expanduser(line)))
                full = sub if sub.is_absolute() else (base if base is not None else root) / sub
                out.append((Path(os.path.normpath(full)), bool(section.get("is_default", False))))
    return out


def lora_folders(root: Path) -> list[Path]:
    """ComfyUI's LoRA search path in its own order (``folder_paths.add_model_folder_path``):
    ``is_default`` folders go to the front, each before the previous one; new other folders are
    appended after ``models/loras``; a folder already listed only moves, to the front, if default.
    """
    folders = [root / "models" / "loras"]
    for folder, is_default in extra_lora_paths(root):
        if folder in folders and is_default:
            folders.remove(folder)
        if folder not in folders:
            folders.insert(0, folder) if is_default else folders.append(folder)
    return folders


def export_folder(root: Path) -> Path:
    """Where ComfyUI itself would save a new LoRA: the first folder of its search path."""
    folder = lora_folders(root)[0]
    if folder != root / "models" / "loras" and not folder.is_dir():
        raise ImgloraError(f"{root / EXTRA_PATHS_FILE} makes {folder} the default LoRA folder (is_default), but "
                           "it does not exist; create it or fix the file, or pass --out FILE")
    return folder


# ---------------------------------------------------------------------------------------------
# Workflows
# ---------------------------------------------------------------------------------------------

UI_ONLY = None  # widget with no API input, e.g. KSampler's control_after_generate


@dataclass
class Node:
    id: int
    type: str
    pos: tuple[int, int]
    links: list[tuple[str, str, tuple[int, int]]] = field(default_factory=list)  # (input, TYPE, (node, slot))
    widgets: list[tuple[str | None, Any]] = field(default_factory=list)  # (input name or UI_ONLY, value)
    outputs: list[str] = field(default_factory=list)  # output TYPE per slot (names equal types here)
    size: tuple[int, int] = (315, 110)


@dataclass(frozen=True)
class Sampling:
    """The family's usual settings, as in ComfyUI's example workflows."""
    width: int
    height: int
    steps: int
    cfg: float
    sampler: str
    scheduler: str
    guidance: float | None = None  # FLUX distilled guidance (FluxGuidance); None = no such node




def ksampler(id_: int, pos, model, positive, negative, latent, seed: int, s: Sampling) -> Node:
    return Node(id_, "KSampler", pos, links=[("model", "MODEL", model), ("positive", "CONDITIONING", positive),
                                             ("negative", "CONDITIONING", negative),
                                             ("latent_image", "LATENT", latent)],
                widgets=[("seed", seed), (UI_ONLY, "fixed"), ("steps", s.steps), ("cfg", s.cfg),
                         ("sampler_name", s.sampler), ("scheduler", s.scheduler), ("denoise", 1.0)],
                outputs=["LATENT"], size=(315, 262))


def text_node(id_: int, pos, clip, text: str) -> Node:
    return Node(id_, "CLIPTextEncode", pos, links=[("clip", "CLIP", clip)], widgets=[("text", text)],
                outputs=["CONDITIONING"], size=(400, 160))


def to_api(nodes: list[Node]) -> dict[str, Any]:
    """API format: ``{"<id>": {"class_type", "inputs": {name: value or [source id, slot]}}}``."""
    out = {}
    for n in nodes:
        inputs: dict[str, Any] = {name: [str(src), slot] for name, _, (src, slot) in n.links}
        inputs.update({name: value for name, value in n.widgets if name is not UI_ONLY})
        out[str(n.id)] = {"class_type": n.type, "inputs": inputs, "_meta": {"title": n.type}}
    return out


def to_ui(nodes: list[Node]) -> dict[str, Any]:
    """UI graph (workflow schema 0.4): nodes with widgets_values, and links
    ``[id, source node, source slot, target node, target slot, TYPE]`` that both ends name."""
    links: list[list[Any]] = []
    out_links: dict[tuple[int, int], list[int]] = {}
    ui_nodes = []
    for order, n in enumerate(nodes):  # the table is in execution order
        inputs = []
        for slot, (name, type_, (src, src_slot)) in enumerate(n.links):
            link_id = len(links) + 1
            links.append([link_id, src, src_slot, n.id, slot, type_])
            out_links.setdefault((src, src_slot), []).append(link_id)
            inputs.append({"name": name, "type": type_, "link": link_id})
        node: dict[str, Any] = {"id": n.id, "type": n.type, "pos": list(n.pos), "size": list(n.size), "flags": {},
                                "order": order, "mode": 0, "properties": {"Node name for S&R": n.type}}
        if inputs:
            node["inputs"] = inputs
        if n.widgets:
            node["widgets_values"] = [value for _, value in n.widgets]
        ui_nodes.append(node)
    for n, node in zip(nodes, ui_nodes):
        if n.outputs:
            node["outputs"] = [{"name": t, "type": t, "links": out_links.get((n.id, slot), []), "slot_index": slot}
                               for slot, t in enumerate(n.outputs)]
    return {"last_node_id": max(n.id for n in nodes), "last_link_id": len(links), "nodes": ui_nodes,
            "links": links, "groups": [], "config": {}, "extra": {"ds": {"scale": 1, "offset": [0, 0]}},
            "version": 0.4}
