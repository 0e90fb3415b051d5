"""Scanning a dataset folder into captioned, bucketed items, with every problem reported at once.

Layout (kohya sd-scripts style)::

    root/
      a.png  a.txt              # repeated data.default_repeats times
      10_sks toy/
        b.jpg  b.txt            # repeated 10 times

Sizes and buckets are ``(width, height)``, as in PIL.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from imglora.data.buckets import assign_bucket, make_buckets
from imglora.data.images import BadImageError, image_size
from imglora.util.hashing import sha256_file
from imglora.errors import DataError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
# Image formats people do drop into datasets; named in a warning so they are not silently lost.
_OTHER_IMAGE_EXTENSIONS = {".gif", ".bmp", ".tif", ".tiff", ".heic", ".heif", ".avif", ".jxl"}
_REPEATS_FOLDER = re.compile(r"^(\d+)_(.+)$")
MISSING_CAPTION_MODES = ("error", "default")
_MISSING_CAPTION_FIX = 'write one, or set data.missing_caption = "default" and data.default_caption'


@dataclass(frozen=True)
class DatasetItem:
    path: Path
    caption: str  # final text: stripped, defaulted, trigger word prepended
    repeats: int
    size: tuple[int, int]  # (width, height), after EXIF orientation
    bucket: tuple[int, int]  # (width, height)
    set_index: int = 0  # which of data.all_sets it belongs to
    mask: Path | None = None  # its loss mask image (data.sets[].mask_dir), if any
    controls: tuple[Path, ...] = ()  # its source images (data.sets[].control_dir), edit-model families


@dataclass(frozen=True)
class ScanResult:
    items: tuple[DatasetItem, ...]  # sorted by path relative to the root
    warnings: tuple[str, ...]
    bucket_counts: dict[tuple[int, int], int]  # (width, height) -> number of images (not repeats)


def scan_dataset(
    root: str | os.PathLike,
    *,
    resolution: int,
    step: int,
    min_side: int = 256,
    max_side: int = 2048,
    use_buckets: bool = True,
    caption_ext: str = ".txt",
    missing_caption: str = "error",
    default_caption: str = "",
    trigger_word: str = "",
    default_repeats: int = 1,
    skip_bad_images: bool = False,
    verify_images: bool = True,
    warn_uncaptioned: bool = True,
    dir_key: str = "data.dir",
) -> ScanResult:
    """Find, check and caption every image under ``root``; raise one ``DataError`` listing all
    problems, so a user fixes the dataset in one pass rather than one error per run.

    ``verify_images`` decodes each image once to catch truncated files, which have intact
    headers: finding them here costs seconds, finding them in the cache step costs a loaded
    model. ``use_buckets=False`` puts every image in the square ``(resolution, resolution)``.
    """
    if missing_caption not in MISSING_CAPTION_MODES:
        raise ValueError(f"missing_caption must be one of {MISSING_CAPTION_MODES}")
    if default_repeats < 1:
        raise ValueError(f"default_repeats must be >= 1, got {default_repeats}")
    if not caption_ext.startswith("."):
        caption_ext = "." + caption_ext
    root = Path(root)
    trigger_word = trigger_word.strip()
    warnings: list[str] = []
    images = _find_images(root, default_repeats, warnings, dir_key)
    buckets = (
        make_buckets(resolution, step, min_side, max_side)
        if use_buckets
        else [(resolution, resolution)]
    )

    problems: list[str] = []
    items: list[DatasetItem] = []
    uncaptioned: list[Path] = []
    for path, repeats in images:
        try:
            size = image_size(path, verify=verify_images)
        except BadImageError as exc:
            if skip_bad_images:
                warnings.append(f"{exc.path}: {exc.reason}; skipped (data.skip_bad_images)")
                continue
            problems.append(str(exc))
            size = None  # still check its caption: report everything in one pass
        caption = _caption_for(path, caption_ext, missing_caption, default_caption, problems)
        if caption == "":
            uncaptioned.append(path)
        if size is not None and caption is not None:
            bucket = assign_bucket(*size, buckets)
            text = _with_trigger(caption, trigger_word)
            items.append(DatasetItem(path, text, repeats, size, bucket))

    if problems:
        raise DataError(problems)
    if not items:
        # Only reachable with skip_bad_images: the skip warnings say why each image went.
        raise DataError([*warnings, f"{root}: no usable images left after skipping bad ones"])
    if uncaptioned and warn_uncaptioned:
        warnings.append(_uncaptioned_warning(uncaptioned, trigger_word))
    warnings += geometry_warnings(items) + shared_caption_warnings(items, caption_ext)
    counts = Counter(item.bucket for item in items)
    return ScanResult(tuple(items), tuple(warnings), dict(sorted(counts.items())))


UPSCALE_WARN = 2.0  # an image enlarged more than this to cover its bucket trains blurry
CROP_WARN = 0.3  # more than this share of an image's area cropped away to fit its bucket


def _first(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def geometry_warnings(items: Iterable[DatasetItem]) -> list[str]:
    """One summary warning per kind: images enlarged far beyond their size, images mostly cropped."""
    upscaled, cropped = [], []
    for item in items:
        (w, h), (bw, bh) = item.size, item.bucket
        scale = max(bw / w, bh / h)  # resized to cover the bucket, then cropped
        if scale > UPSCALE_WARN:
            upscaled.append(f"{item.path.name} ({w}x{h} -> {bw}x{bh}, {scale:.1f}x)")
        lost = 1 - (bw * bh) / (w * h * scale * scale)
        if lost > CROP_WARN:
            cropped.append(f"{item.path.name} ({w}x{h} in {bw}x{bh}, {100 * lost:.0f} % cut)")
    out = []
    if upscaled:
        out.append(f"{len(upscaled)} image(s) are enlarged more than {UPSCALE_WARN:g}x to fill their bucket and will "
                   f"train soft: {_first(upscaled)}; use larger images or a lower data.resolution")
    if cropped:
        out.append(f"{len(cropped)} image(s) lose more than {100 * CROP_WARN:.0f} % of their area to cropping "
                   f"(aspect ratio beyond the buckets): {_first(cropped)}; crop them yourself or widen "
                   "data.min_bucket_side / data.max_bucket_side")
    return out


def shared_caption_warnings(items: Iterable[DatasetItem], caption_ext: str) -> list[str]:
    """Images with the same name in one folder (a.png and a.jpg) read the same caption file: usually
    one image exported twice, which then trains twice as often."""
    by_stem: dict[Path, list[Path]] = {}
    for item in items:
        by_stem.setdefault(item.path.with_suffix(""), []).append(item.path)
    groups = [paths for paths in by_stem.values() if len(paths) > 1]
    if not groups:
        return []
    shown = [f"{' + '.join(p.name for p in g)} share {g[0].with_suffix(caption_ext).name}" for g in groups]
    return [f"{len(groups)} group(s) of images share one caption file and are all trained: {_first(shown)}; "
            "remove the duplicates or rename them apart"]


def dataset_version(items: Iterable[DatasetItem]) -> str:
    """Hex SHA-256 identifying the dataset's content: any image byte, caption, repeat count or loss
    mask changing changes it.

    Paths are taken relative to the items' common folder, so moving the whole dataset (to
    another disk, another machine) keeps the version and any cache keyed on it.
    """
    items = list(items)
    if not items:
        raise ValueError("dataset_version needs at least one item")
    base = Path(os.path.commonpath([item.path.parent for item in items]))
    records, problems = [], []
    for item in items:
        try:
            digest = sha256_file(item.path)
        except OSError as exc:
            problems.append(f"{item.path}: cannot read it any more ({exc.strerror}); scan again")
            continue
        record = [item.path.relative_to(base).as_posix(), digest, item.caption, item.repeats]
        if item.mask is not None:  # only then: the version of a dataset without masks stays as it was
            try:
                record.append(sha256_file(item.mask))
            except OSError as exc:
                problems.append(f"{item.mask}: cannot read it any more ({exc.strerror}); scan again")
        for control in item.controls:  # an edit pair's source images (only then, as masks)
            try:
                record.append(sha256_file(control))
            except OSError as exc:
                problems.append(f"{control}: cannot read it any more ({exc.strerror}); scan again")
        records.append(record)
    if problems:
        raise DataError(problems)
    canonical = json.dumps(sorted(records), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _find_images(root: Path, default_repeats: int, warnings: list[str],
                 dir_key: str = "data.dir") -> list[tuple[Path, int]]:
    """``(path, repeats)`` for every image in ``root`` and its ``N_name`` folders, sorted."""
    if not root.exists():
        raise DataError([f"{root}: the dataset folder does not exist; check {dir_key}"])
    if not root.is_dir():
        raise DataError([f"{root}: not a folder; {dir_key} must name a folder of images"])
    root_images, folders = _list_folder(root, warnings)
    found = [(path, default_repeats) for path in root_images]
    for folder in folders:
        match = _REPEATS_FOLDER.match(folder.name)
        if match is None or int(match[1]) == 0:
            warnings.append(
                f"{folder}: folder ignored; only images in the dataset folder and in subfolders "
                "named '<repeats>_<name>' (e.g. '10_sks toy', repeats >= 1) are used"
            )
            continue
        images, nested = _list_folder(folder, warnings)
        found += [(path, int(match[1])) for path in images]
        warnings += [f"{sub}: folder ignored; repeat folders are not searched recursively"
                     for sub in nested]
    if not found:
        raise DataError([
            f"{root}: no images found; put .png, .jpg, .jpeg or .webp files (each with a "
            "caption .txt beside it) in this folder or in '<repeats>_<name>' subfolders"
        ])
    return sorted(found, key=lambda entry: entry[0].relative_to(root).as_posix())


def _list_folder(folder: Path, warnings: list[str]) -> tuple[list[Path], list[Path]]:
    """The images and subfolders directly in ``folder``; hidden entries are skipped silently."""
    try:
        entries = sorted(entry for entry in folder.iterdir() if not entry.name.startswith("."))
    except OSError as exc:
        raise DataError([f"{folder}: cannot list the folder ({exc.strerror})"]) from exc
    images, folders = [], []
    for entry in entries:
        suffix = entry.suffix.lower()
        if entry.is_dir():
            folders.append(entry)
        elif suffix in IMAGE_EXTENSIONS:
            images.append(entry)
        elif suffix in _OTHER_IMAGE_EXTENSIONS:
            warnings.append(f"{entry}: {suffix} images are not read; convert it to PNG or JPEG")
    return images, folders


def _caption_for(
    image: Path, caption_ext: str, missing_caption: str, default_caption: str, problems: list[str]
) -> str | None:
    """The image's stripped caption (before the trigger word), or None after adding a problem."""
    caption_path = image.with_suffix(caption_ext)
    try:
        text = caption_path.read_text(encoding="utf-8-sig").strip()  # -sig: Notepad writes a BOM
    except FileNotFoundError:
        text, why = "", f"no caption file {caption_path}"
    except UnicodeDecodeError:
        problems.append(f"{caption_path}: not UTF-8 text; re-save it with UTF-8 encoding")
        return None
    except OSError as exc:
        problems.append(f"{caption_path}: cannot read the caption ({exc.strerror})")
        return None
    else:
        why = f"caption file {caption_path} is empty"
    if text:
        return text
    if missing_caption == "default":
        return default_caption.strip()
    problems.append(f"{image}: {why}; {_MISSING_CAPTION_FIX}")
    return None


def _with_trigger(caption: str, trigger: str) -> str:
    """Prepend ``"<trigger>, "`` unless the caption already contains the trigger as words."""
    if not trigger:
        return caption
    # Word boundaries, so trigger "art" is not considered present in "party".
    if re.search(rf"(?<!\w){re.escape(trigger)}(?!\w)", caption):
        return caption
    return f"{trigger}, {caption}" if caption else trigger


def _uncaptioned_warning(paths: list[Path], trigger: str) -> str:
    shown = ", ".join(str(path) for path in paths[:5]) + (", ..." if len(paths) > 5 else "")
    trains_on = f"the trigger word {trigger!r} alone" if trigger else "an empty caption"
    return (
        f"{len(paths)} image(s) have no caption and data.default_caption is empty, so they train "
        f"on {trains_on}: {shown}"
    )
