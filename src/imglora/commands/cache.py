"""``imglora cache-latents``: fill the content-keyed cache, or verify it."""

from __future__ import annotations

from typing import Callable

from ..util import devices
from ..runs import record
from ..util.atomic import check_writable
from ..config import Config
from ..data import cache
from ..data.scan import data_version, scan, split_holdout
from ..errors import ImgloraError
from ..family import CacheEncoder, supports
from ..models.resolve import resolve_model
from .common import family_of


def cache_latents(cfg: Config, *, verify: bool, out: Callable[[str], None], warn: Callable[[str], None]) -> int:
    """Encode what is missing (or, with ``verify``, re-check every entry); returns an exit code."""
    family = family_of(cfg)
    if not supports(family, CacheEncoder):
        raise ImgloraError(f"the {family.name} family caches nothing: its data is tokenized when training starts")
    device = devices.default_device()
    if not verify:
        check_writable(cfg.cache.dir, "cache.dir")
    rec = record.RunRecord("cache-latents", cfg.run_dir, cfg.to_dict())
    with rec.phase("resolve_model"):
        src = resolve_model(cfg.model, family)
    with rec.phase("scan"):
        scanned = scan(cfg, family)
    for w in scanned.warnings:
        warn(f"warning: {w}")
    if verify:
        report = cache.verify(cfg, family, src, device)
        if report.manifest:
            warn(f"warning: {report.manifest}")
        out(f"{report.ok} entries ok, {len(report.missing)} missing, {len(report.stale)} stale, "
            f"{len(report.corrupt)} corrupt")
        for label, rows in (("missing", report.missing), ("stale", report.stale), ("corrupt", report.corrupt)):
            for row in rows:
                out(f"  {label}: {row}")
        if report.missing or report.corrupt:
            warn("run `imglora cache-latents` again to encode missing and corrupt entries")
            return 1
        return 0
    with rec.phase("cache"):
        the_plan, stats = cache.fill_cache(cfg, family, src, device)
    out(f"latents: {stats.latents_encoded} encoded, {stats.latents_reused} reused; "
        f"text: {stats.texts_encoded} encoded, {stats.texts_reused} reused; "
        f"{stats.seconds:.2f} s (cache in {cfg.cache.dir})")
    with rec.phase("checksums"):
        rec.set(model_dir=str(src.root), model_source=src.to_record(), model_checksums=src.checksums(),
                dataset_version=data_version(cfg, split_holdout(cfg, scanned)[0].items),
                dataset_items=len(scanned.items),
                cache_identities=the_plan.identities,
                cache_stats={k: v for k, v in vars(stats).items()})
    out(f"record: {rec.write()}")
    return 0
