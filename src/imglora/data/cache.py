"""Content-addressed cache of VAE latents and text-encoder outputs.

Each entry is one safetensors file named by the sha256 of everything that determines its content:
- latents: the image's bytes, its bucket, the crop (mode and, for random crops, the seed that
  fixes the offset), the flip, the VAE's identity (checksum of its weights and config) and dtype;
- text: the exact caption, the text encoders' and tokenizers' identity, the token length, dtype.
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import atomic, record
from ..errors import ImgloraError
from ..progress import Progress
from .buckets import fit_to_bucket
from .dataset import DatasetItem, ScanResult, scan_dataset
from .images import file_sha256, open_image

if TYPE_CHECKING:
    import torch

    from ..config import Config
    from ..families import Family

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # bump when the meaning of an entry changes; old entries are then never matched


class CorruptEntry(ImgloraError):
    pass


@dataclass(frozen=True)
class LatentSpec:
    """One latent entry: an image fitted to its bucket, maybe flipped."""

    item: DatasetItem
    image_sha256: str
    flip: bool
    crop_seed: int
    key: str


@dataclass(frozen=True)
class TextSpec:
    caption: str
    key: str


@dataclass
class CachePlan:
    scan: ScanResult
    latents: list[LatentSpec]
    texts: dict[str, TextSpec]  # caption -> spec
    encoder_dtype: str
    text_max_length: int
    identities: dict[str, str] = field(default_factory=dict)


@dataclass
class FillStats:
    latents_encoded: int = 0
    latents_reused: int = 0
    texts_encoded: int = 0
    texts_reused: int = 0
    seconds: float = 0.0
    loaded_vae: bool = False
    loaded_text_encoders: bool = False


def _key(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps({"format": CACHE_FORMAT, **fields}, sort_keys=True).encode()).hexdigest()


def resolve_encoder_dtype(name: str, device: "torch.device | str") -> str:
    if name != "auto":
        return name
    return "bf16" if str(device).startswith("cuda") else "fp32"


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


class Cache:
    """Entries under ``root/<kind>/<key[:2]>/<key>.safetensors``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / f"{key}.safetensors"

    def has(self, kind: str, key: str) -> bool:
        return self.path(kind, key).is_file()

    def put(self, kind: str, key: str, tensors: dict[str, "torch.Tensor"], info: dict[str, Any] | None = None) -> None:
        # The key inside the entry: a valid entry of another key in this file's place is caught on read.
        meta = {"checksum": _checksum(tensors), "key": key, "kind": kind}
        if info:
            meta["info"] = json.dumps(info, sort_keys=True)
        atomic.save_safetensors(self.path(kind, key), tensors, metadata=meta)

    def drop(self, kind: str, key: str) -> None:
        self.path(kind, key).unlink(missing_ok=True)

    def get(self, kind: str, key: str) -> dict[str, "torch.Tensor"]:
        from safetensors import SafetensorError, safe_open

        path = self.path(kind, key)
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptEntry(f"cache entry {path} cannot be read ({exc}); it will be re-encoded") from None
        if meta.get("key") != key:
            raise CorruptEntry(f"cache entry {path} holds another entry (key {str(meta.get('key'))[:12]}..., copied or "
                               "renamed into this place); it will be re-encoded")
        if meta.get("checksum") != _checksum(tensors):
            raise CorruptEntry(f"cache entry {path} does not match its checksum; it will be re-encoded")
        return tensors

    def info(self, kind: str, key: str) -> dict[str, Any]:
        """What the encoder noted beside an entry's tensors (e.g. token counts), from its header only."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path(kind, key)), framework="pt") as fh:
                return json.loads((fh.metadata() or {}).get("info", "{}"))
        except (SafetensorError, OSError, ValueError):
            return {}


def _checksum(tensors: dict[str, "torch.Tensor"]) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------


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
    return _scan_result(scanned.items + extra.items, scanned.warnings + extra.warnings)


def _scan_result(items: tuple[DatasetItem, ...], warnings: tuple[str, ...]) -> ScanResult:
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
        from ..errors import DataError

        raise DataError([f"eval.holdout = {n} would hold out all {len(own)} images of {cfg.data.dir}, leaving "
                         "none to train on; lower it or use eval.holdout_dir"])
    train, held = own[:len(own) - n], own[len(own) - n:] + extra
    return _scan_result(train, scanned.warnings), _scan_result(held, ())


def subplan(the_plan: "CachePlan", items: tuple[DatasetItem, ...]) -> "CachePlan":
    """The part of a plan that covers some of its images (their latents and captions)."""
    keep = set(items)
    captions = {i.caption for i in items}
    return CachePlan(_scan_result(tuple(i for i in the_plan.scan.items if i in keep), the_plan.scan.warnings),
                     [s for s in the_plan.latents if s.item in keep],
                     {c: s for c, s in the_plan.texts.items() if c in captions},
                     the_plan.encoder_dtype, the_plan.text_max_length, dict(the_plan.identities))


def _check_geometry(cfg: "Config", family: "Family") -> None:
    """Bucket sides the model cannot take (e.g. an odd FLUX latent) fail here, before any encoder runs."""
    from ..errors import ConfigError

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


def plan(cfg: "Config", family: "Family", model_dir: Path, device: "torch.device | str",
         scanned: ScanResult | None = None) -> CachePlan:
    """Compute every entry's key without loading a model or decoding an image."""
    scanned = scanned or scan(cfg, family)
    enc_dtype = resolve_encoder_dtype(cfg.cache.encoder_dtype, device)
    max_len = cfg.cache.text_max_length or family.text_max_length
    vae_id = record.identity(family.vae_folders(model_dir))
    text_id = record.identity(family.text_folders(model_dir))
    latents = []
    for item in scanned.items:
        sha = file_sha256(item.path)
        # A random crop is fixed per image by a seed derived from the run seed and the image, so
        # it is reproducible and part of the key; a center crop does not depend on the seed.
        crop_seed = int(sha[:8], 16) ^ cfg.train.seed if cfg.data.crop == "random" else 0
        for flip in ((False, True) if cfg.data.flip else (False,)):
            key = _key({"kind": "latents", "family": family.name, "image": sha, "bucket": list(item.bucket),
                        "crop": cfg.data.crop, "crop_seed": crop_seed, "flip": flip, "vae": vae_id,
                        "dtype": enc_dtype})
            latents.append(LatentSpec(item, sha, flip, crop_seed, key))
    texts = {}
    for item in scanned.items:
        if item.caption not in texts:
            key = _key({"kind": "text", "family": family.name, "caption": item.caption, "encoders": text_id,
                        "max_length": max_len, "dtype": enc_dtype})
            texts[item.caption] = TextSpec(item.caption, key)
    return CachePlan(scanned, latents, texts, enc_dtype, max_len, {"vae": vae_id, "text_encoders": text_id})


def fill_cache(cfg: "Config", family: "Family", model_dir: Path, device: "torch.device | str",
               the_plan: CachePlan | None = None, progress: bool = True) -> tuple[CachePlan, FillStats]:
    """Encode every missing entry; load the VAE / text encoders only if something is missing."""
    t0 = time.perf_counter()
    the_plan = the_plan or plan(cfg, family, model_dir, device)
    cache = Cache(cfg.cache.dir)
    stats = FillStats()
    # Existence is enough here: entries are renamed into place only when complete. Readers verify
    # the checksum (training on load, `--verify` on demand) and drop a corrupt entry.
    todo_lat = [s for s in the_plan.latents if not cache.has("latents", s.key)]
    todo_txt = [s for s in the_plan.texts.values() if not cache.has("text", s.key)]
    stats.latents_reused = len(the_plan.latents) - len(todo_lat)
    stats.texts_reused = len(the_plan.texts) - len(todo_txt)

    if todo_lat:
        import torch

        dtype = torch_dtype(the_plan.encoder_dtype)
        vae = family.load_vae(model_dir, torch.device(device), dtype)
        stats.loaded_vae = True
        with Progress(len(todo_lat), "encoding latents", enabled=progress) as bar:
            for spec in todo_lat:
                cache.put("latents", spec.key, _finite(encode_latent(family, vae, spec, cfg.data.crop),
                                                       str(spec.item.path), the_plan.encoder_dtype))
                stats.latents_encoded += 1
                bar.update()
        del vae
        _free(device)
    if todo_txt:
        import torch

        encoders = family.load_text_encoders(model_dir, torch.device(device), torch_dtype(the_plan.encoder_dtype))
        stats.loaded_text_encoders = True
        with Progress(len(todo_txt), "encoding captions", enabled=progress) as bar:
            for spec in todo_txt:
                tensors = family.encode_text(encoders, spec.caption, the_plan.text_max_length)
                tokens = family.count_tokens(encoders, spec.caption, the_plan.text_max_length)
                cache.put("text", spec.key, _finite(tensors, f"caption {spec.caption!r}", the_plan.encoder_dtype),
                          info={"tokens": tokens})
                stats.texts_encoded += 1
                bar.update()
        del encoders
        _free(device)
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
                         f"{dtype!r}; the SDXL VAE overflows in fp16 — use \"bf16\" or \"fp32\""])
    return tensors


def encode_latent(family: "Family", vae: Any, spec: LatentSpec, crop: str) -> dict[str, "torch.Tensor"]:
    import numpy as np
    import torch

    fit = fit_to_bucket(open_image(spec.item.path), spec.item.bucket, crop=crop, seed=spec.crop_seed)
    if spec.flip:
        fit = fit.flipped()
    pixels = torch.from_numpy(np.asarray(fit.image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)[None]
    out = family.encode_image(vae, pixels)
    # SDXL micro-conditioning, (h, w) / (top, left) as in the SDXL paper; harmless for other families.
    out["time_ids"] = torch.tensor([*fit.original_size, *fit.crop_top_left, *fit.target_size], dtype=torch.float32)
    return out


def _free(device: "torch.device | str") -> None:
    import gc

    import torch

    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


def manifest_path(cfg: "Config") -> Path:
    ident = hashlib.sha256(f"{Path(cfg.data.dir).resolve()}|{cfg.model.family}|{cfg.model.path}".encode())
    return Path(cfg.cache.dir) / "manifests" / f"{ident.hexdigest()[:16]}.json"


def write_manifest(cfg: "Config", the_plan: CachePlan) -> None:
    atomic.write_json(manifest_path(cfg), {
        "format": CACHE_FORMAT, "data_dir": str(Path(cfg.data.dir).resolve()), "model": cfg.model.path,
        "identities": the_plan.identities, "encoder_dtype": the_plan.encoder_dtype,
        "text_max_length": the_plan.text_max_length,
        "latents": [{"image": str(s.item.path), "image_sha256": s.image_sha256, "bucket": list(s.item.bucket),
                     "flip": s.flip, "key": s.key} for s in the_plan.latents],
        "texts": [{"caption": s.caption, "key": s.key} for s in the_plan.texts.values()],
    })


@dataclass
class VerifyReport:
    ok: int = 0
    missing: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)


def verify(cfg: "Config", family: "Family", model_dir: Path, device: "torch.device | str") -> VerifyReport:
    """Re-check every entry the manifest lists against the data and models as they are now."""
    report = VerifyReport()
    cache = Cache(cfg.cache.dir)
    current = plan(cfg, family, model_dir, device)
    now_keys = {s.key for s in current.latents} | {s.key for s in current.texts.values()}
    try:
        manifest = json.loads(manifest_path(cfg).read_text())
    except FileNotFoundError:
        manifest = {"latents": [], "texts": []}
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


@dataclass(frozen=True)
class Sample:
    """One training image as the loop sees it: cached tensors for each variant (flip) and its bucket."""

    bucket: tuple[int, int]
    repeats: int
    variants: tuple[dict[str, "torch.Tensor"], ...]


def load_samples(cfg: "Config", family: "Family", model_dir: Path, device: "torch.device | str",
                 the_plan: CachePlan, stats: FillStats | None = None) -> list[Sample]:
    """Read every entry of the plan into memory; a corrupt entry is dropped and re-encoded once
    (counted in ``stats`` when given)."""
    cache = Cache(cfg.cache.dir)
    for attempt in (1, 2):
        try:
            texts = {c: cache.get("text", s.key) for c, s in the_plan.texts.items()}
            by_item: dict[Path, list[dict[str, "torch.Tensor"]]] = {}
            for spec in the_plan.latents:
                entry = {**cache.get("latents", spec.key), **texts[spec.item.caption]}
                by_item.setdefault(spec.item.path, []).append(entry)
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
            _, refill = fill_cache(cfg, family, model_dir, device, the_plan)
            if stats is not None:  # what was just re-encoded was counted as reused before
                stats.latents_encoded += refill.latents_encoded
                stats.latents_reused -= refill.latents_encoded
                stats.texts_encoded += refill.texts_encoded
                stats.texts_reused -= refill.texts_encoded
    items = {s.item.path: s.item for s in the_plan.latents}
    return [Sample(items[p].bucket, items[p].repeats, tuple(v)) for p, v in by_item.items()]


def overflow_warning(cfg: "Config", the_plan: CachePlan) -> str | None:
    """One warning naming the captions longer than their text encoder's token limit: they were cut
    off when encoded, so their tail is never trained on. Read from the entries' headers (the
    encoder counted the tokens), so it is said on every run, not only the one that encoded them."""
    cache = Cache(cfg.cache.dir)
    images: dict[str, list[str]] = {}
    for item in the_plan.scan.items:
        images.setdefault(item.caption, []).append(item.path.name)
    long: list[str] = []
    for caption, spec in the_plan.texts.items():
        tokens = cache.info("text", spec.key).get("tokens", {})
        over = [f"{name} {n} of {limit}" for name, (n, limit) in sorted(tokens.items()) if n > limit]
        if over:
            long.append(f"{', '.join(images.get(caption, ['?'])[:2])} ({'; '.join(over)} tokens)")
    if not long:
        return None
    return (f"{len(long)} caption(s) are longer than the text encoder reads and are cut off (the rest is not "
            f"trained on): {', '.join(long[:5])}{', ...' if len(long) > 5 else ''}; shorten them, or raise "
            "cache.text_max_length where the encoder allows it")


@dataclass
class PreparedData:
    """What the training loop needs from a family's data preparation."""

    samples: list[Sample]
    version: str  # dataset version (a hash over the content)
    warnings: tuple[str, ...]
    summary: str  # one line for the user
    validation: list[Sample] = field(default_factory=list)  # held out; loss only, never trained on


def prepare_images(cfg: "Config", family: "Family", model_dir: Path, device: "torch.device | str") -> PreparedData:
    """Fill the cache for whatever is missing (encoders loaded only then, and freed), load it."""
    from .dataset import dataset_version

    the_plan, stats = fill_cache(cfg, family, model_dir, device)  # held-out images too: one encoder load
    train_scan, held_scan = split_holdout(cfg, the_plan.scan)
    samples = load_samples(cfg, family, model_dir, device, subplan(the_plan, train_scan.items), stats)
    held = (load_samples(cfg, family, model_dir, device, subplan(the_plan, held_scan.items), stats)
            if held_scan.items else [])
    warnings = list(the_plan.scan.warnings)
    overflow = overflow_warning(cfg, the_plan)
    if overflow:
        warnings.append(overflow)
    return PreparedData(samples, dataset_version(train_scan.items), tuple(warnings),
                        f"{len(samples)} images" + (f" (+{len(held)} held out)" if held else "")
                        + f", cache {stats.latents_encoded + stats.texts_encoded} encoded / "
                        f"{stats.latents_reused + stats.texts_reused} reused", validation=held)
