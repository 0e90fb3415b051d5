"""A folder ComfyUI's own checks take for a ComfyUI checkout (main.py, comfy/, folder_paths.py,
models/, custom_nodes/), for the tests of everything that writes into or reads from one."""

from __future__ import annotations

from pathlib import Path


def fake_comfyui(root: Path, *model_folders: str) -> Path:
    """``root`` made into a ComfyUI folder, with ``models/<name>`` for each name given (loras and
    checkpoints by default)."""
    for d in ("comfy", "custom_nodes", *(f"models/{m}" for m in model_folders or ("loras", "checkpoints"))):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "main.py").write_text("")
    (root / "folder_paths.py").write_text("")
    return root
