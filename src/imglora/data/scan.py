"""Which images a run uses: each data set's scan (``data.all_sets``) plus ``eval.holdout_dir``, split
into the images trained on and the held-out ones (a pure function of the file names), and the
data's content version."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.checks import bucket_checks, holdout_checks
from ..errors import ConfigError, DataError
from .batches import reg_per_epoch
from .captions import keep_tokens_warning
from .dataset import DatasetItem, ScanResult, _first, dataset_version, scan_dataset
from .controls import attach_controls, unpaired
from .masks import attach_masks, check_alpha

if TYPE_CHECKING:
    from ..config import Config, DataSetConfig
    from ..family import CacheEncoder as Family


def scan(cfg: "Config", family: "Family") -> ScanResult:
    """Every image the run uses: each set's, then eval.holdout_dir's (held out; see split_holdout).
    Every problem of every set is reported at once, each naming its set when there are several."""
    d = cfg.data
    _check_geometry(cfg, family)
    sets, names = d.all_sets, set_names(d)
    items: list[DatasetItem] = []
    warnings: list[str] = []
    problems: list[str] = []
    for index, s in enumerate(sets):
        label = f"set {names[index]!r}: " if len(sets) > 1 else ""
        try:
            found = _scan_set(cfg, family, s, index)
        except DataError as exc:
            problems += [label + p for p in exc.problems]
            continue
        items += found.items
        warnings += [label + w for w in found.warnings]
    if problems:
        raise DataError(problems)
    held: tuple[DatasetItem, ...] = ()
    if cfg.eval.holdout_dir:
        first = next(i for i, s in enumerate(sets) if not s.regularization)  # scored as this set's images
        extra = _scan(cfg, family, replace(sets[first], dir=cfg.eval.holdout_dir, repeats=1, mask_dir="",
                                           alpha_mask=False))
        held = tuple(replace(i, set_index=first) for i in extra.items)
        warnings += extra.warnings
        if sets[first].control_dir:  # a held-out target's source is looked up as a training image's
            key = f"data.sets[{first}].control_dir" if d.sets else "data.control_dir"
            held = tuple(attach_controls(list(held), Path(cfg.eval.holdout_dir), Path(sets[first].control_dir), key,
                                         _controls(family), problems, warnings))
            taken = {c.resolve() for i in items for c in i.controls}
            shared = [i.path.name for i in held if any(c.resolve() in taken for c in i.controls)]
            if shared:
                problems.append(f"{cfg.eval.holdout_dir}: {len(shared)} held-out image(s) have the file name of a "
                                f"training image, so they would take its source image from {key}: "
                                f"{', '.join(shared[:5])}; rename them and their sources")
    folders: dict[str, int] = {}
    for i, s in enumerate(sets):
        if s.control_dir:
            folders.setdefault(s.control_dir, i)
    for folder, index in folders.items():  # each folder once, checked against every set's pairs
        key = f"data.sets[{index}].control_dir" if d.sets else "data.control_dir"
        problem = unpaired(Path(folder), key, [*items, *held], _controls(family))
        if problem:
            problems.append(problem)
    if problems:
        raise DataError(problems)
    return scan_result(tuple(items) + held, tuple(warnings))


def _controls(family: "Family") -> int:
    """How many source images per target the family takes (0: not an edit family)."""
    return getattr(family, "control_images", 0)


def _scan(cfg: "Config", family: "Family", s: "DataSetConfig", **kw: Any) -> ScanResult:
    d = cfg.data
    return scan_dataset(
        Path(s.dir), resolution=s.resolution, step=d.bucket_step or family.bucket_step,
        min_side=d.min_bucket_side, max_side=d.max_bucket_side, use_buckets=d.buckets,
        caption_ext=s.caption_ext, missing_caption=s.missing_caption, default_caption=s.default_caption,
        trigger_word=s.trigger_word, default_repeats=s.repeats, skip_bad_images=d.skip_bad_images, **kw)


def _scan_set(cfg: "Config", family: "Family", s: "DataSetConfig", index: int) -> ScanResult:
    """One set: its images and captions, then its masks; a regularization set's images take its
    class caption where they have none, and never the trigger word (they show the class without
    the subject)."""
    key = (lambda k: f"data.sets[{index}].{k}") if cfg.data.sets else (lambda k: f"data.{k}")
    if s.regularization:
        s = replace(s, missing_caption="default", default_caption=s.class_caption, trigger_word="")
    found = _scan(cfg, family, s, warn_uncaptioned=not s.regularization, dir_key=key("dir"))
    items = [replace(i, set_index=index) for i in found.items]
    problems: list[str] = []
    warnings = list(found.warnings)
    if s.regularization and not s.class_caption:
        bare = [i.path.name for i in items if not i.caption]
        if bare:
            problems.append(f"{s.dir}: {len(bare)} regularization image(s) have no caption and the set has no class "
                            f"caption: {_first(bare)}; set {key('class_caption')} (kohya's class_tokens: the class "
                            "prompt these images answer, e.g. \"a photo of a toy\"), or write their captions")
    if s.mask_dir:
        items = attach_masks(items, Path(s.dir), Path(s.mask_dir), key("mask_dir"), problems, warnings)
    if s.alpha_mask:
        check_alpha(items, problems, warnings)
    if s.control_dir:
        items = attach_controls(items, Path(s.dir), Path(s.control_dir), key("control_dir"), _controls(family),
                                problems, warnings)
    if problems:
        raise DataError(problems)
    note = keep_tokens_warning(items, s)
    return ScanResult(tuple(items), tuple(warnings + ([note] if note else [])), found.bucket_counts)


def data_version(cfg: "Config", items: tuple[DatasetItem, ...]) -> str:
    """The training data's content version: the set's ``dataset_version`` for the one set (as before
    sets existed), else a hash over each set's name, role and version."""
    if not cfg.data.sets:
        return dataset_version(items)
    # Not the folders: a moved dataset keeps its version (as dataset_version does for one set).
    rows = [[r["name"], r["regularization"], r["version"]] for r in set_records(cfg, items)]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def set_records(cfg: "Config", items: tuple[DatasetItem, ...]) -> list[dict[str, Any]]:
    """What the run record says about each set: its images, repeats, samples per epoch (for a
    regularization set its share of ``reg_per_epoch``, as the batcher interleaves them), masks and
    content version."""
    sets, names = cfg.data.all_sets, set_names(cfg.data)
    pools = [sum(i.repeats for i in items if i.set_index == k) for k in range(len(sets))]
    n_train = sum(n for n, s in zip(pools, sets) if not s.regularization)
    n_reg = sum(n for n, s in zip(pools, sets) if s.regularization)
    reg_total = reg_per_epoch(n_train, cfg.data.reg_ratio) if n_reg else 0
    out = []
    for index, s in enumerate(sets):
        mine = [i for i in items if i.set_index == index]
        out.append({"name": names[index], "dir": s.dir, "regularization": s.regularization,
                    "resolution": s.resolution, "images": len(mine), "repeats": s.repeats,
                    "samples_per_epoch": round(reg_total * pools[index] / n_reg) if s.regularization else
                    pools[index],
                    "masks": sum(i.mask is not None for i in mine) if s.mask_dir else
                    (len(mine) if s.alpha_mask else 0),
                    "version": dataset_version(mine) if mine else None})
    return out


def set_names(data: "Any") -> list[str]:
    """Each set's name: its own, else its folder's; a repeated name gets " #2", " #3"."""
    names: list[str] = []
    for i, s in enumerate(data.all_sets):
        base = s.name or Path(s.dir).name or f"set {i + 1}"
        name, n = base, 2
        while name in names:
            name, n = f"{base} #{n}", n + 1
        names.append(name)
    return names


def scan_result(items: tuple[DatasetItem, ...], warnings: tuple[str, ...]) -> ScanResult:
    counts: dict[tuple[int, int], int] = {}
    for item in items:
        counts[item.bucket] = counts.get(item.bucket, 0) + 1
    return ScanResult(tuple(items), tuple(warnings), dict(sorted(counts.items())))


def split_holdout(cfg: "Config", scanned: ScanResult) -> tuple[ScanResult, ScanResult]:
    """(training images, held-out images) of a ``scan``: held out are the last ``eval.holdout`` images
    of data.dir's sorted scan and every image of ``eval.holdout_dir``. A pure function of the file
    names, so training and every later evaluation agree on the split; held-out images are never
    trained on, only scored (``imglora eval``, ``eval.every``)."""
    held_root = Path(cfg.eval.holdout_dir) if cfg.eval.holdout_dir else None
    extra = tuple(i for i in scanned.items if held_root is not None and i.path.is_relative_to(held_root))
    outside = frozenset(extra)
    sets = cfg.data.all_sets
    own = tuple(i for i in scanned.items if i not in outside and not sets[i.set_index].regularization)
    n = cfg.eval.holdout
    if n and n >= len(own):
        where = cfg.data.dir if not cfg.data.sets else "the training sets"
        raise DataError([f"eval.holdout = {n} would hold out all {len(own)} images of {where}, leaving "
                         "none to train on; lower it or use eval.holdout_dir"])
    held = frozenset(own[len(own) - n:]) if n else frozenset()
    train = tuple(i for i in scanned.items if i not in outside and i not in held)
    return scan_result(train, scanned.warnings), scan_result(own[len(own) - n:] + extra if n else extra, ())


def _check_geometry(cfg: "Config", family: "Family") -> None:
    """The config's bucket and holdout-folder checks again, for a configuration built without the
    loader (``replace``): bucket sides the model cannot take fail here, before any encoder runs."""
    problems: list[str] = []
    bucket_checks(cfg.data, family.bucket_step, family.name, lambda key: f"{cfg.source}: {key}", problems)
    holdout_checks(cfg, lambda key: f"{cfg.source}: {key}", problems)
    if problems:
        raise ConfigError(problems, cfg.source)


