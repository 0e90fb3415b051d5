"""Content-addressed cache of VAE latents and text-encoder outputs.

Each entry is one safetensors file named by the sha256 of everything that determines its content:
- latents: the image's bytes, its bucket, the crop (mode and, for random crops, the seed that
  fixes the offset), the flip, its loss mask (the mask file's bytes, or the alpha channel's use),
  whether the VAE posterior's standard deviation is kept beside its mean (``cache.latents``),
  for edit pairs its source images' bytes (encoded in the same entry as ``control_latents``),
  the VAE's identity (checksum of its weights and config) and dtype; the mask, resized and
  cropped with the image, is stored in the entry beside the latents;
- text: the exact text, the text encoders' and tokenizers' identity, the token length, dtype. Each
  text variant a run may train on is an entry of its own: a caption's shuffled / tag-dropped
  variants and the empty caption of caption dropout (``captions``). Where the family's text
  encoder reads the source images too (``text_reads_sources``: Qwen-Image-Edit), a text entry is
  one image's: its sources' bytes, bucket and crop key it as well.
Change any of these and the key changes, so a stale entry can never be found, let alone used.
Entries carry their own key and a checksum of their tensors in the header; an entry that is
corrupt, or that is another valid entry copied or renamed into its place, is detected on read
and re-encoded. Writes go to a temporary name and are renamed into place.

``fill_cache`` encodes only what is missing and loads an encoder only when something is missing,
so a second run over unchanged data loads no model and encodes nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..util import atomic, devices
from ..runs import record
from . import text_tokens
from ..errors import ImgloraError
from ..family import option, text_length, text_options
from ..util.hashing import sha256_file
from ..runs.progress import Progress
from .dataset import DatasetItem, ScanResult
from .captions import EMPTY, TextChoice, choice_for, preservation_captions
from .samples import PreparedData, Sample
from .scan import data_version, scan, scan_result, set_records, split_holdout
from .store import Cache, CorruptEntry
from .cache_warnings import mask_warning, overflow_warning
from .encode import encode_latent, source_views

if TYPE_CHECKING:
    from ..models.source import ModelSource
    import torch

    from ..config import Config
    from ..family import CacheEncoder as Family

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # bump when the meaning of an entry changes; old entries are then never matched


@dataclass(frozen=True)
class LatentSpec:
    """One latent entry: an image fitted to its bucket, maybe flipped, with its loss mask if any."""

    item: DatasetItem
    image_sha256: str
    flip: bool
    crop_seed: int
    key: str
    crop: str = "center"
    alpha_mask: bool = False  # the mask is the image's alpha channel (item.mask: a mask file)
    posterior_std: bool = False  # cache.latents = "sample": the posterior's standard deviation cached too


@dataclass(frozen=True)
class TextSpec:
    caption: str  # the text encoded: a caption, one of its variants, or "" (caption dropout)
    key: str
    item: DatasetItem | None = None  # text_reads_sources: the image whose sources the encoder reads with it
    crop: str = "center"  # ... fitted to its bucket as its latents' sources are (unflipped)
    crop_seed: int = 0


@dataclass
class CachePlan:
    scan: ScanResult
    latents: list[LatentSpec]
    texts: dict[str, TextSpec]  # text -> spec
    encoder_dtype: str
    text_max_length: int
    identities: dict[str, str] = field(default_factory=dict)
    choices: dict[DatasetItem, TextChoice] = field(default_factory=dict)  # what each image's caption trains as
    text_options: dict[str, Any] = field(default_factory=dict)  # family.text_options: keyed, passed to encode_text
    per_image_text: bool = False  # text_reads_sources: texts are keyed by (text, item), not by text
    # Output preservation (imglora.adapters.preservation): each training image's other captions by name, "dop"
    # (the trigger word replaced by train.dop_class) and "blank" (the empty caption).
    preserve: dict[DatasetItem, dict[str, str]] = field(default_factory=dict)

    def text_ref(self, item: DatasetItem, text: str) -> Any:
        """The key of ``item``'s ``text`` in ``texts``."""
        return (text, item) if self.per_image_text else text

    def item_texts(self, item: DatasetItem) -> list[str]:
        """Every text ``item`` needs an entry of: its caption's variants, then its preservation captions."""
        return list(dict.fromkeys([*self.choices[item].texts(), *self.preserve.get(item, {}).values()]))


@dataclass
class FillStats:
    latents_encoded: int = 0
    latents_reused: int = 0
    texts_encoded: int = 0
    texts_reused: int = 0
    seconds: float = 0.0
    loaded_vae: bool = False
    loaded_text_encoders: bool = False
    to_encode: int = 0  # entries missing when filling began


class CachingInterrupted(ImgloraError):
    """Ctrl-C while encoding: every entry written so far is complete (renamed into place) and kept."""

    exit_code = 130  # as a shell reports SIGINT

    def __init__(self, stats: FillStats, cache_dir: Path):
        done = stats.latents_encoded + stats.texts_encoded
        super().__init__(
            f"interrupted while caching: {done} of {stats.to_encode} entries were written and are kept in "
            f"{cache_dir}; the rest are encoded next time" if stats.to_encode else
            "interrupted while caching, before any entry was encoded; nothing was written")


def _key(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps({"format": CACHE_FORMAT, **fields}, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------


def subplan(the_plan: "CachePlan", items: tuple[DatasetItem, ...]) -> "CachePlan":
    """The part of a plan that covers some of its images (their latents and captions)."""
    keep = set(items)
    choices = {i: c for i, c in the_plan.choices.items() if i in keep}
    refs = {the_plan.text_ref(i, t) for i in choices for t in the_plan.item_texts(i)}
    return CachePlan(scan_result(tuple(i for i in the_plan.scan.items if i in keep), the_plan.scan.warnings),
                     [s for s in the_plan.latents if s.item in keep],
                     {c: s for c, s in the_plan.texts.items() if c in refs},
                     the_plan.encoder_dtype, the_plan.text_max_length, dict(the_plan.identities), choices,
                     dict(the_plan.text_options), the_plan.per_image_text,
                     {i: p for i, p in the_plan.preserve.items() if i in keep})


def plan(cfg: "Config", family: "Family", src: "ModelSource", device: "torch.device | str",
         scanned: ScanResult | None = None) -> CachePlan:
    """Compute every entry's key without loading a model or decoding an image."""
    scanned = scanned or scan(cfg, family)
    enc_dtype = devices.encoder_dtype_name(cfg.cache.encoder_dtype, device)
    max_len = text_length(family, cfg, src)
    options = text_options(family, cfg)
    vae_id = record.identity(family.vae_folders(src))
    text_id = record.identity(family.text_folders(src))
    sets = cfg.data.all_sets
    latents = []
    sampled = cfg.cache.latents == "sample"
    fitted: dict[DatasetItem, dict[str, Any]] = {}  # each image's crop, for the text entries that read its sources
    for item in scanned.items:
        s = sets[item.set_index]
        sha = sha256_file(item.path)
        # A random crop is fixed per image by a seed derived from the run seed and the image, so
        # it is reproducible and part of the key; a center crop does not depend on the seed.
        crop_seed = int(sha[:8], 16) ^ cfg.train.seed if s.crop == "random" else 0
        # Only present when there is a mask, so entries without one keep the keys they had.
        mask = {"mask": sha256_file(item.mask)} if item.mask else {"mask": "alpha"} if s.alpha_mask else {}
        if item.controls:  # edit pairs: the source images' bytes (and order) key the entry too
            mask["controls"] = [sha256_file(c) for c in item.controls]
        if sampled:  # the standard deviation beside the mean (entries of the mean keep their keys)
            mask["posterior"] = "sample"
        fitted[item] = {"controls": mask.get("controls", []), "bucket": list(item.bucket), "crop": s.crop,
                        "crop_seed": crop_seed}
        for flip in ((False, True) if s.flip else (False,)):
            key = _key({"kind": "latents", "family": family.name, "image": sha, "bucket": list(item.bucket),
                        "crop": s.crop, "crop_seed": crop_seed, "flip": flip, "vae": vae_id,
                        "dtype": enc_dtype, **mask})
            latents.append(LatentSpec(item, sha, flip, crop_seed, key, s.crop, s.alpha_mask, sampled))
    held = set(split_holdout(cfg, scanned)[1].items)
    choices = {item: choice_for(item, sets[item.set_index], held_out=item in held) for item in scanned.items}
    preserve = preservation_captions(cfg, [i for i in scanned.items if i not in held])
    texts: dict[Any, TextSpec] = {}
    per_image = bool(option(family, "text_reads_sources"))
    for item, choice in (choices.items() if text_tokens.caches_text(cfg, family) else ()):
        for text in dict.fromkeys([*choice.texts(), *preserve.get(item, {}).values()]):
            ref = (text, item) if per_image else text
            if ref in texts:
                continue
            view = fitted[item] if per_image else {}  # the sources as the encoder reads them
            key = _key({"kind": "text", "family": family.name, "caption": text, "encoders": text_id,
                        "max_length": max_len, "dtype": enc_dtype, **options, **view})
            texts[ref] = (TextSpec(text, key, item, view["crop"], view["crop_seed"]) if per_image
                          else TextSpec(text, key))
    return CachePlan(scanned, latents, texts, enc_dtype, max_len, {"vae": vae_id, "text_encoders": text_id},
                     choices, options, per_image, preserve)


def fill_cache(cfg: "Config", family: "Family", src: "ModelSource", device: "torch.device | str",
               the_plan: CachePlan | None = None, progress: bool = True) -> tuple[CachePlan, FillStats]:
    """Encode every missing entry; load the VAE / text encoders only if something is missing. A
    Ctrl-C meanwhile raises ``CachingInterrupted``, saying how many entries were kept."""
    stats = FillStats()
    try:
        return _fill_cache(cfg, family, src, device, the_plan, progress, stats)
    except KeyboardInterrupt:
        raise CachingInterrupted(stats, Path(cfg.cache.dir)) from None


def _fill_cache(cfg: "Config", family: "Family", src: "ModelSource", device: "torch.device | str",
                the_plan: CachePlan | None, progress: bool, stats: FillStats) -> tuple[CachePlan, FillStats]:
    t0 = time.perf_counter()
    the_plan = the_plan or plan(cfg, family, src, device)
    cache = Cache(cfg.cache.dir)
    # Existence is enough here: entries are renamed into place only when complete. Readers verify
    # the checksum (training on load, `--verify` on demand) and drop a corrupt entry.
    todo_lat = list({s.key: s for s in the_plan.latents if not cache.has("latents", s.key)}.values())
    todo_txt = list({s.key: s for s in the_plan.texts.values() if not cache.has("text", s.key)}.values())
    stats.latents_reused = len({s.key for s in the_plan.latents}) - len(todo_lat)
    stats.texts_reused = len({s.key for s in the_plan.texts.values()}) - len(todo_txt)
    stats.to_encode = len(todo_lat) + len(todo_txt)

    if todo_lat:
        import torch

        dtype = devices.dtype(the_plan.encoder_dtype)
        vae = family.load_vae(src, torch.device(device), dtype)
        stats.loaded_vae = True
        with Progress(len(todo_lat), "encoding latents", enabled=progress) as bar:
            for spec in todo_lat:
                cache.put("latents", spec.key, _finite(encode_latent(family, vae, spec),
                                                       str(spec.item.path), the_plan.encoder_dtype))
                stats.latents_encoded += 1
                bar.update()
        del vae
        devices.free(device)
    if todo_txt:
        import torch

        encoders = family.load_text_encoders(src, torch.device(device), devices.dtype(the_plan.encoder_dtype))
        stats.loaded_text_encoders = True
        with Progress(len(todo_txt), "encoding captions", enabled=progress) as bar:
            for spec in todo_txt:
                sources = {"sources": source_views(spec)} if spec.item is not None else {}
                tensors = family.encode_text(encoders, spec.caption, the_plan.text_max_length,
                                             **the_plan.text_options, **sources)
                tokens = family.count_tokens(encoders, spec.caption, the_plan.text_max_length)
                what = f"caption {spec.caption!r}" + (f" of {spec.item.path.name}" if spec.item is not None else "")
                cache.put("text", spec.key, _finite(tensors, what, the_plan.encoder_dtype), info={"tokens": tokens})
                stats.texts_encoded += 1
                bar.update()
        del encoders
        devices.free(device)
    problem = read_manifest(cfg)[1]
    if problem:
        log.warning("%s", problem)
    write_manifest(cfg, the_plan)
    stats.seconds = time.perf_counter() - t0
    return the_plan, stats


def _finite(tensors: dict[str, "torch.Tensor"], what: str, dtype: str) -> dict[str, "torch.Tensor"]:
    """Never cache NaN or infinity: it would poison every run that reads the entry."""
    import torch

    bad = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        from ..errors import DataError

        raise DataError([f"{what}: encoding gave NaN or infinite values ({', '.join(bad)}) with cache.encoder_dtype "
                         f"{dtype!r}; some VAEs overflow in fp16 — use \"bf16\" or \"fp32\""])
    return tensors


def _data_dirs(cfg: "Config") -> str:
    return "|".join(dict.fromkeys(str(Path(s.dir).resolve()) for s in cfg.data.all_sets))


def manifest_path(cfg: "Config") -> Path:
    ident = hashlib.sha256(f"{_data_dirs(cfg)}|{cfg.model.family}|{cfg.model.path}".encode())
    return Path(cfg.cache.dir) / "manifests" / f"{ident.hexdigest()[:16]}.json"


def write_manifest(cfg: "Config", the_plan: CachePlan) -> None:
    atomic.write_json(manifest_path(cfg), {
        "format": CACHE_FORMAT, "data_dir": _data_dirs(cfg), "model": cfg.model.path,
        "identities": the_plan.identities, "encoder_dtype": the_plan.encoder_dtype,
        "text_max_length": the_plan.text_max_length,
        "latents": [{"image": str(s.item.path), "image_sha256": s.image_sha256, "bucket": list(s.item.bucket),
                     "flip": s.flip, "key": s.key} for s in the_plan.latents],
        "texts": [{"caption": s.caption, "key": s.key} for s in the_plan.texts.values()],
    })


def read_manifest(cfg: "Config") -> tuple[dict[str, Any], str | None]:
    """The manifest of the last fill (what it cached), and why it could not be read, if so: then
    it is taken as empty and rebuilt. The entries do not depend on it (each carries its own key and
    checksum), so a damaged manifest loses nothing but the list of entries that went stale."""
    path = manifest_path(cfg)
    empty: dict[str, Any] = {"latents": [], "texts": []}
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        return empty, None
    except (ValueError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        detail = str(exc)
    else:
        if _manifest_ok(manifest):
            return manifest, None
        detail = "not a cache manifest: expected latents and texts lists of entries with their keys"
    return empty, (f"the cache manifest {path} is corrupt ({detail}); rebuilt from the current data and models "
                   "(every entry is checked by its own checksum, none is lost; entries cached for an older "
                   "setup can no longer be listed as stale)")


def _manifest_ok(manifest: Any) -> bool:
    if not isinstance(manifest, dict):
        return False
    return all(isinstance(manifest.get(kind), list)
               and all(isinstance(e, dict) and isinstance(e.get("key"), str) and label in e for e in manifest[kind])
               for kind, label in (("latents", "image"), ("texts", "caption")))


@dataclass
class VerifyReport:
    ok: int = 0
    missing: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    manifest: str | None = None  # why the manifest was unreadable (then rebuilt), if it was


def verify(cfg: "Config", family: "Family", src: "ModelSource", device: "torch.device | str") -> VerifyReport:
    """Re-check every entry the manifest lists against the data and models as they are now."""
    report = VerifyReport()
    cache = Cache(cfg.cache.dir)
    current = plan(cfg, family, src, device)
    now_keys = {s.key for s in current.latents} | {s.key for s in current.texts.values()}
    manifest, report.manifest = read_manifest(cfg)
    if report.manifest:
        try:
            write_manifest(cfg, current)
        except OSError as exc:  # a read-only cache can still be verified
            report.manifest = report.manifest.replace(
                "rebuilt from", f"not rebuilt ({exc.strerror}); `imglora cache-latents` rebuilds it from")
    for kind, entries, label in (("latents", manifest["latents"], "image"), ("text", manifest["texts"], "caption")):
        for e in entries:  # entries recorded at the last fill that no longer match the data
            what = f"{kind} of {e[label]!r}"
            if e["key"] not in now_keys:
                report.stale.append(f"{what}: its source, model or settings changed since it was cached")
    for kind, specs in (("latents", current.latents), ("text", list(current.texts.values()))):
        for s in specs:
            what = f"{kind} of {str(s.item.path) if kind == 'latents' else s.caption!r}"
            if not cache.has(kind, s.key):
                report.missing.append(what)
                continue
            try:
                cache.get(kind, s.key)
                report.ok += 1
            except CorruptEntry as exc:
                report.corrupt.append(f"{what}: {exc}")
    return report


def load_samples(cfg: "Config", family: "Family", src: "ModelSource", device: "torch.device | str",
                 the_plan: CachePlan, stats: FillStats | None = None) -> list[Sample]:
    """Read every entry of the plan into memory; a corrupt entry is dropped and re-encoded once
    (counted in ``stats`` when given). A text entry is read once and shared by every image using it."""
    cache = Cache(cfg.cache.dir)
    for attempt in (1, 2):
        try:
            captions = list(dict.fromkeys(t for i in the_plan.choices for t in the_plan.item_texts(i)))
            texts = text_tokens.entries(cfg, family, src, captions,
                                        {c: cache.get("text", s.key) for c, s in the_plan.texts.items()},
                                        the_plan.text_max_length)
            by_item: dict[DatasetItem, list[dict[str, "torch.Tensor"]]] = {}
            for spec in the_plan.latents:
                by_item.setdefault(spec.item, []).append(cache.get("latents", spec.key))
            break
        except CorruptEntry as exc:
            if attempt == 2:
                raise
            log.warning("%s", exc)
            for kind, key in [("text", s.key) for s in the_plan.texts.values()] + \
                             [("latents", s.key) for s in the_plan.latents]:
                if cache.has(kind, key):
                    try:
                        cache.get(kind, key)
                    except CorruptEntry:
                        cache.drop(kind, key)
            _, refill = fill_cache(cfg, family, src, device, the_plan)
            if stats is not None:  # what was just re-encoded was counted as reused before
                stats.latents_encoded += refill.latents_encoded
                stats.latents_reused -= refill.latents_encoded
                stats.texts_encoded += refill.texts_encoded
                stats.texts_reused -= refill.texts_encoded
    return [_sample(cfg, item, entries, the_plan.choices[item],
                    {t: texts[the_plan.text_ref(item, t)] for t in the_plan.item_texts(item)},
                    the_plan.preserve.get(item, {}))
            for item, entries in by_item.items()]


def _sample(cfg: "Config", item: DatasetItem, entries: list[dict[str, "torch.Tensor"]], choice: TextChoice,
            texts: dict[str, dict[str, "torch.Tensor"]], preserve: dict[str, str]) -> Sample:
    """``texts``: the image's text entries by text; ``preserve``: its preservation captions by name."""
    import torch

    kept = {name: texts[caption] for name, caption in preserve.items()}

    reg = cfg.data.all_sets[item.set_index].regularization
    if reg and cfg.data.prior_loss_weight != 1.0:  # only then: batches without it stay as they were
        weight = torch.tensor(cfg.data.prior_loss_weight, dtype=torch.float32)
        entries = [{**e, "loss_weight": weight} for e in entries]
    if len(choice.variants) == 1 and not choice.dropout:  # one text: each variant holds it, as always
        return Sample(item.bucket, item.repeats, tuple({**e, **texts[choice.variants[0]]} for e in entries),
                      regularization=reg, sources=len(item.controls), preserve=kept)
    return Sample(item.bucket, item.repeats, tuple(entries), texts=tuple(texts[t] for t in choice.variants),
                  caption_dropout=choice.dropout, empty_text=texts[EMPTY] if choice.dropout else None,
                  regularization=reg, sources=len(item.controls), preserve=kept)


def prepare_images(cfg: "Config", family: "Family", src: "ModelSource", device: "torch.device | str") -> PreparedData:
    """Fill the cache for whatever is missing (encoders loaded only then, and freed), load it."""
    the_plan, stats = fill_cache(cfg, family, src, device)  # held-out images too: one encoder load
    train_scan, held_scan = split_holdout(cfg, the_plan.scan)
    train_plan = subplan(the_plan, train_scan.items)
    samples = load_samples(cfg, family, src, device, train_plan, stats)
    held = (load_samples(cfg, family, src, device, subplan(the_plan, held_scan.items), stats)
            if held_scan.items else [])
    warnings = list(the_plan.scan.warnings)
    for warning in (overflow_warning(cfg, the_plan),
                    mask_warning(cfg, samples, list(dict.fromkeys(s.item for s in train_plan.latents)))):
        if warning:
            warnings.append(warning)
    sets = set_records(cfg, train_scan.items)
    store = Cache(cfg.cache.dir)  # the entries' files: their tensors and a small header
    text_bytes = sum(store.path("text", s.key).stat().st_size for s in train_plan.texts.values())
    if text_bytes > TEXT_MEMORY_WARN * _host_memory():
        warnings.append(f"the {len(train_plan.texts)} cached text entries take {text_bytes / 2**30:.1f} GiB of host "
                        "memory; lower shuffle_variants, or cache.text_max_length where the captions are short")
    several = len(sets) > 1
    per_set = "; ".join(f"{r['name']}: {r['images']} images, {r['samples_per_epoch']} per epoch"
                        + (" (regularization)" if r["regularization"] else "") for r in sets) if several else ""
    summary = (f"{len(samples)} images" + (f" in {len(sets)} sets ({per_set})" if several else "")
               + (f" (+{len(held)} held out)" if held else "")
               + f", {len(train_plan.texts)} text entries ({text_bytes / 2**20:.1f} MiB in memory)"
               + f", cache {stats.latents_encoded + stats.texts_encoded} encoded / "
               f"{stats.latents_reused + stats.texts_reused} reused"
               + text_tokens.summary(cfg, family, len({t for c in the_plan.choices.values() for t in c.texts()})))
    return PreparedData(samples, data_version(cfg, train_scan.items), tuple(warnings), summary, validation=held,
                        sets=sets, encoded=stats.latents_encoded + stats.texts_encoded)


TEXT_MEMORY_WARN = 0.25  # share of the machine's memory the text entries may take before a warning


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: never warn
        return 2**62
