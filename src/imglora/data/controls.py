"""Edit pairs: each training image (the target) with its source image(s) from ``control_dir``, for the
families that train edit models (``imglora.family.EditPairs``).

The rule: a target ``<dir>/<sub>/<stem>.<ext>`` takes the control ``<control_dir>/<sub>/<stem>.<any
image ext>`` (else the same stem at the top of ``control_dir``). Where the family takes several
sources per target (Qwen-Image-Edit-Plus), the next ones are ``<stem>_1``, ``<stem>_2``, ... in that
order, as many as it takes. A target without a control, and a control without a target, are one
error naming every such file: a pair that is off by one name trains the wrong edit.

Each control is fitted to its target's bucket (the same crop and flip), encoded by the same VAE, and
cached beside the target's latents; its bytes are part of the cache key.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .dataset import IMAGE_EXTENSIONS, DatasetItem, _first
from .images import BadImageError, image_size


def attach_controls(items: list[DatasetItem], root: Path, control_dir: Path, key: str, most: int,
                    problems: list[str], warnings: list[str]) -> list[DatasetItem]:
    """Each item with its control images (at most ``most``); a target without one is a problem, a
    source whose shape differs from its target's a warning (it is cropped to the target's bucket)."""
    if not control_dir.is_dir():
        problems.append(f"{control_dir}: {key} is not a folder; it must hold the source image of each training "
                        "image, with the training image's file name")
        return items
    out, missing, shapes = [], [], []
    for item in items:
        found = find_controls(item.path, root, control_dir, most)
        if not found:
            missing.append(str(item.path.relative_to(root)))
            continue
        for control in found:
            try:
                w, h = image_size(control)
            except BadImageError as exc:
                problems.append(str(exc))
                continue
            if abs(w / h - item.size[0] / item.size[1]) > ASPECT_TOLERANCE * item.size[0] / item.size[1]:
                shapes.append(f"{control.name} {w}x{h} for {item.path.name} {item.size[0]}x{item.size[1]}")
        out.append(replace(item, controls=tuple(found)))
    if shapes:
        warnings.append(f"{len(shapes)} source image(s) have another aspect ratio than their training image and are "
                        f"cropped to its bucket, so the pair may no longer line up: {_first(shapes, 3)}; crop the "
                        "source as the target, or pad it")
    if missing:
        problems.append(f"{control_dir}: {len(missing)} training image(s) have no source image in {key}: "
                        f"{_first(missing)}; add <same name>.png there (the image before the edit), or remove "
                        "the training image")
    return out


def unpaired(control_dir: Path, key: str, items: list[DatasetItem], most: int) -> str | None:
    """The images in ``control_dir`` that are no item's control (after every set and the held-out
    folder were scanned, so a held-out image's source is not counted), as a problem, or None."""
    used = {p.resolve() for item in items for p in item.controls}
    orphans = [str(p.relative_to(control_dir)) for p in sorted(control_dir.rglob("*"))
               if p.suffix.lower() in IMAGE_EXTENSIONS and p.resolve() not in used
               and not any(part.startswith(".") for part in p.relative_to(control_dir).parts)]  # ._a.png, .cache/
    if not orphans:
        return None
    return (f"{control_dir}: {len(orphans)} source image(s) in {key} match no training image: {_first(orphans)}; "
            "a source image needs the file stem of its training image"
            + (f" (or <stem>_1 ... <stem>_{most - 1} for more sources)" if most > 1 else ""))


ASPECT_TOLERANCE = 0.02  # relative difference of width/height beyond which a pair is said to differ in shape


def find_controls(image: Path, root: Path, control_dir: Path, most: int) -> list[Path]:
    rel = image.relative_to(root)
    for folder in dict.fromkeys((control_dir / rel.parent, control_dir)):
        first = _one(folder, image.stem)
        if first is None:
            continue
        found = [first]
        for k in range(1, most):
            nxt = _one(folder, f"{image.stem}_{k}")
            if nxt is None:
                break
            found.append(nxt)
        return found
    return []


def _one(folder: Path, stem: str) -> Path | None:
    for ext in IMAGE_EXTENSIONS:
        for candidate in (folder / f"{stem}{ext}", folder / f"{stem}{ext.upper()}"):
            if candidate.is_file():
                return candidate
    return None
