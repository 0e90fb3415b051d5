"""Which images a run uses: ``data.dir``'s scan plus ``eval.holdout_dir``, split into the images
trained on and the held-out ones (a pure function of the file names)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError, DataError, ImgloraError
from .dataset import DatasetItem, ScanResult, scan_dataset

if TYPE_CHECKING:
    from ..config import Config
    from ..family import CacheEncoder as Family


def scan(cfg: "Config", family: "Family") -> ScanResult:
    """Every image the run uses: data.dir's, then eval.holdout_dir's (held out; see split_holdout)."""
    d = cfg.data
    _check_geometry(cfg, family)

    def one(root: str, repeats: int) -> ScanResult:
        return scan_dataset(
            Path(root), resolution=d.resolution, step=d.bucket_step or family.bucket_step,
            min_side=d.min_bucket_side, max_side=d.max_bucket_side, use_buckets=d.buckets,
            caption_ext=d.caption_ext, missing_caption=d.missing_caption, default_caption=d.default_caption,
            trigger_word=d.trigger_word, default_repeats=repeats, skip_bad_images=d.skip_bad_images,
        )

    scanned = one(d.dir, d.repeats)
    if not cfg.eval.holdout_dir:
        return scanned
    held_root = Path(cfg.eval.holdout_dir).resolve()
    if held_root == Path(d.dir).resolve() or Path(d.dir).resolve() in held_root.parents:
        raise ImgloraError(f"eval.holdout_dir = {cfg.eval.holdout_dir!r} is inside data.dir = {d.dir!r}; "
                           "move the held-out images to a folder of their own, next to data.dir")
    extra = one(cfg.eval.holdout_dir, 1)
    return scan_result(scanned.items + extra.items, scanned.warnings + extra.warnings)


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
    own = tuple(i for i in scanned.items if i not in outside)
    n = cfg.eval.holdout
    if n and n >= len(own):
        raise DataError([f"eval.holdout = {n} would hold out all {len(own)} images of {cfg.data.dir}, leaving "
                         "none to train on; lower it or use eval.holdout_dir"])
    train, held = own[:len(own) - n], own[len(own) - n:] + extra
    return scan_result(train, scanned.warnings), scan_result(held, ())


def _check_geometry(cfg: "Config", family: "Family") -> None:
    """Bucket sides the model cannot take (e.g. an odd FLUX latent) fail here, before any encoder runs."""
    d, step = cfg.data, family.bucket_step
    problems = []
    if d.bucket_step and d.bucket_step % step:
        problems.append(f"{cfg.source}: data.bucket_step = {d.bucket_step} must be a multiple of {step} for the "
                        f"{family.name} family")
    if not d.buckets and d.resolution % (d.bucket_step or step):
        problems.append(f"{cfg.source}: data.resolution = {d.resolution} must be a multiple of "
                        f"{d.bucket_step or step} with data.buckets = false")
    if problems:
        raise ConfigError(problems, cfg.source)


