"""The metadata an exported LoRA carries: kohya's ``ss_*`` keys and ``modelspec.*`` (which
A1111/Forge and ComfyUI model managers show), ``imglora.*`` (the run, the base model's files and
checksums), and the addnet hashes A1111 reads instead of hashing the file."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..adapters import KINDS
from ..util.version import __version__

if TYPE_CHECKING:
    from ..config import Config
    from ..family import Exportable


def _unix(iso: str | None) -> float | None:
    try:
        return datetime.fromisoformat(iso).timestamp() if iso else None
    except ValueError:
        return None


def build_metadata(source: Any, cfg: "Config", family: "Exportable", name: str, fmt: str,
                   modules: dict[str, Any]) -> dict[str, str]:
    """kohya ``ss_*`` and ``modelspec.*`` keys (all strings, as kohya writes them) plus ``imglora.*``
    for the adapter ``source`` (an ``export.Source``) and its ``modules`` (``export.LoraModule``);
    the family adds its own (architecture, base model version, its training settings).

    A1111/Forge and ComfyUI model managers read ``ss_*`` and ``modelspec.*``; loaders ignore them.
    """
    rec = source.record
    first = cfg.data.first_training_set()
    res, trigger = first.resolution, first.trigger_word.strip()
    ranks = sorted({m.rank for m in modules.values()})
    alpha = cfg.lora.alpha or next(iter(modules.values())).alpha
    produced = datetime.fromtimestamp(int(source.path.stat().st_mtime))  # when these weights were written
    checksums = rec.get("model_checksums") or {}
    t = cfg.train
    meta: dict[str, Any] = {
        "ss_output_name": name,
        "ss_network_dim": cfg.lora.rank or ranks[-1],
        "ss_network_alpha": float(alpha),
        "ss_network_dropout": cfg.lora.dropout,
        "ss_network_args": "{}",
        "ss_v2": False,
        "ss_resolution": f"({res}, {res})" if res else None,
        "ss_steps": source.step,
        "ss_max_train_steps": rec.get("total_updates") or t.max_steps or None,
        "ss_learning_rate": t.learning_rate,
        "ss_unet_lr": t.learning_rate,
        "ss_text_encoder_lr": (t.text_encoder_lr or t.learning_rate) if cfg.lora.text_encoder else None,
        "ss_network_train_unet_only": not cfg.lora.text_encoder,
        "ss_lr_scheduler": t.scheduler,
        "ss_lr_warmup_steps": t.warmup_steps,
        "ss_optimizer": t.optimizer,
        "ss_seed": t.seed,
        "ss_batch_size_per_device": t.batch_size,
        "ss_gradient_accumulation_steps": t.grad_accum,
        "ss_max_grad_norm": t.max_grad_norm,
        "ss_mixed_precision": t.mixed_precision,
        "ss_gradient_checkpointing": cfg.memory.gradient_checkpointing,
        "ss_num_train_images": rec.get("dataset_items"),
        "ss_training_started_at": _unix(rec.get("started")),
        "ss_training_finished_at": _unix(rec.get("finished")),
        "ss_sd_model_name": cfg.model.path,
        "ss_training_comment": f"trained with imglora {__version__}",
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.title": name,
        "modelspec.date": produced.isoformat(),
        "modelspec.resolution": f"{res}x{res}" if res else None,
        "modelspec.trigger_phrase": trigger or None,
        "modelspec.description": f"LoRA for {cfg.model.path}, rank {ranks[-1]}, alpha {float(alpha):g}; "
                                 f"{source.label}, exported by imglora {__version__}",
        "imglora.version": __version__,
        "imglora.format": fmt,
        "imglora.run": cfg.run.name,
        "imglora.source": source.label,
        "imglora.weights": "ema" if source.path.parent.name == "adapter_ema" else "raw",
        "imglora.base_model": cfg.model.path,
        "imglora.base_model_checksums": json.dumps(checksums, sort_keys=True, separators=(",", ":"))
                                        if checksums else None,
        "imglora.base_model_hash": _summary_hash(checksums),
        "imglora.dataset_version": rec.get("dataset_version"),
        **family.export_metadata(cfg, rec),
        **adapter_type_metadata(cfg, sorted({m.kind for m in modules.values()})),
    }
    meta.update(base_model_hashes(rec, checksums))
    sets = rec.get("dataset_sets") or []
    if sets:  # kohya's per-folder summary: {folder: {n_repeats, img_count}}, regularization sets apart
        for key, reg in (("ss_dataset_dirs", False), ("ss_reg_dataset_dirs", True)):
            dirs = {s["name"]: {"n_repeats": s["repeats"], "img_count": s["images"]} for s in sets
                    if s["regularization"] == reg}
            if dirs:
                meta[key] = json.dumps(dirs)
    if trigger:
        # kohya counts caption tags per dataset folder; imglora records the tag it prepended to every caption.
        folder = Path(first.dir or "dataset").name
        meta["ss_tag_frequency"] = json.dumps({folder: {trigger: rec.get("dataset_items") or 1}})
    return {k: str(v) for k, v in meta.items() if v is not None}


def adapter_type_metadata(cfg: "Config", kinds: list[str]) -> dict[str, Any]:
    """What kohya and LyCORIS write for the adapter type: LoHa/LoKr are ``lycoris.kohya`` networks
    with their ``algo``; DoRA is kohya's ``dora_wd``."""
    lo, kind = cfg.lora, kinds[0] if len(kinds) == 1 else cfg.lora.type
    out: dict[str, Any] = {"imglora.adapter_type": kind, **KINDS[kind].metadata(lo)}
    if lo.loraplus_lr_ratio:  # as kohya records it (a training setting: the file's tensors are the same)
        args = json.loads(out.get("ss_network_args", "{}"))
        out["ss_network_args"] = json.dumps({**args, "loraplus_lr_ratio": f"{lo.loraplus_lr_ratio:g}"})
    blockwise = {"blocks": ",".join(lo.blocks), "block_dims": _pairs(lo.block_ranks),
                 "block_alphas": _pairs(lo.block_alphas), "block_lr": _pairs(lo.block_lr)}
    if any(blockwise.values()):  # lora.blocks & co., as selector lists (imglora's names; kohya has per-model ones)
        args = json.loads(out.get("ss_network_args", "{}"))
        out["ss_network_args"] = json.dumps({**args, **{k: v for k, v in blockwise.items() if v}})
    return out


def _pairs(values: dict[str, Any]) -> str:
    return ",".join(f"{k}={v:g}" for k, v in values.items())


def base_model_hashes(rec: dict[str, Any], checksums: dict[str, str]) -> dict[str, str]:
    """For a model trained from single files: the main file's name and its hashes as kohya writes
    them (``ss_sd_model_name``, ``ss_new_sd_model_hash`` = sha256 of the file, ``ss_sd_model_hash`` =
    the legacy 8-digit hash of 64 KiB at 1 MiB), so the LoRA can be traced to the exact checkpoint."""
    files = (rec.get("model_source") or {}).get("files") or {}
    if not files:
        return {}
    part, main = next(iter(files.items()))
    out = {"ss_sd_model_name": Path(main).name,
           "imglora.base_model_files": json.dumps({k: Path(v).name for k, v in files.items()}, sort_keys=True)}
    full = checksums.get(f"{part}:{Path(main).name}")
    if full:
        out["ss_new_sd_model_hash"] = full
    try:
        with open(main, "rb") as fh:
            fh.seek(0x100000)
            out["ss_sd_model_hash"] = hashlib.sha256(fh.read(0x10000)).hexdigest()[:8]
    except OSError:
        pass  # the base moved since training; the full checksum above still names it
    return out


def _summary_hash(checksums: dict[str, str]) -> str | None:
    """One sha256 over the base model's per-file checksums, to compare bases at a glance."""
    if not checksums:
        return None
    return hashlib.sha256("".join(f"{k}={v}\n" for k, v in sorted(checksums.items())).encode()).hexdigest()


def addnet_hashes(blob: bytes) -> tuple[str, str]:
    """(sshs_model_hash, sshs_legacy_hash) as kohya's train_util.precalculate_safetensors_hashes:
    sha256 of the tensor bytes after the header, and the legacy 8-digit hash of bytes 1 MiB..1 MiB+64 KiB.
    A1111's LoRA loader uses the first as the LoRA's hash instead of hashing the file itself."""
    header = 8 + int.from_bytes(blob[:8], "little")
    return hashlib.sha256(blob[header:]).hexdigest(), hashlib.sha256(blob[0x100000:0x110000]).hexdigest()[:8]


def serialize(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The file's bytes, with the addnet hashes added to ``metadata`` (computed, as kohya does,
    on the tensors with only the ss_* metadata, so they do not depend on the other keys)."""
    from safetensors.torch import save

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    ss_only = {k: v for k, v in metadata.items() if k.startswith("ss_")}
    metadata["sshs_model_hash"], metadata["sshs_legacy_hash"] = addnet_hashes(save(tensors, metadata=ss_only))
    return save(tensors, metadata=metadata)
