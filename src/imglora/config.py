"""Presets: TOML files read into one frozen, typed ``Config``.

``load(path, overrides)`` returns a ``Config`` or raises one ``ConfigError`` that lists every
problem at once (unknown keys with "did you mean", wrong types, out-of-range values, missing
required keys, TOML syntax errors with their line), each naming the file and the dotted key.
It never loads a model, so a bad preset costs nothing.

Each field carries its help text, range and choices in its metadata; the validator and
``imglora config --help-keys`` read them from there, so a field is declared in exactly one place.

Relative paths in a preset (``data.dir``, ``cache.dir``, ``run.output_dir``) are relative to the
working directory, as in kohya sd-scripts and ai-toolkit; ``extends`` is relative to the file
that names it.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from .errors import ConfigError

SCHEMA_VERSION = 1
REQUIRED = dataclasses.MISSING


def _f(default: Any = REQUIRED, help: str = "", *, min: float | None = None, max: float | None = None,
       min_exclusive: bool = False) -> Any:
    meta = {"help": help, "min": min, "max": max, "min_exclusive": min_exclusive}
    if isinstance(default, list):
        return field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
    if default is REQUIRED:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


Family = Literal["sdxl", "flux", "llm"]
DType = Literal["bf16", "fp16", "fp32"]


@dataclass(frozen=True)
class ModelConfig:
    family: Family = _f(help="Model family: sdxl, flux or llm.")
    path: str = _f(help="A local diffusers/transformers folder, a hub id already in the local "
                        "Hugging Face cache, or tiny:sdxl / tiny:flux / tiny:llm.")
    dtype: DType = _f("bf16", help="Precision of the frozen base weights on a GPU (fp32 on CPU).")


@dataclass(frozen=True)
class DataConfig:
    dir: str = _f("", help="Image folder with same-name .txt captions; N_name subfolders repeat N times.")
    resolution: int = _f(1024, help="Target side length; buckets keep the area close to resolution².",
                         min=64, max=4096)
    buckets: bool = _f(True, help="Aspect-ratio buckets; false crops every image to a square.")
    bucket_step: int = _f(0, help="Bucket sides are multiples of this; 0 = the family's (64 SDXL, 16 FLUX).",
                          min=0, max=512)
    min_bucket_side: int = _f(256, help="Smallest bucket side.", min=16, max=8192)
    max_bucket_side: int = _f(2048, help="Largest bucket side.", min=16, max=8192)
    caption_ext: str = _f(".txt", help="Extension of caption files beside the images.")
    missing_caption: Literal["error", "default"] = _f(
        "error", help="An image without a caption is an error, or gets default_caption.")
    default_caption: str = _f("", help="Caption for images without one when missing_caption = \"default\".")
    trigger_word: str = _f("", help="Prepended to every caption that does not already contain it.")
    crop: Literal["center", "random"] = _f("center", help="Crop to the bucket at the center or at a "
                                           "seeded random offset (fixed per image, so it can be cached).")
    flip: bool = _f(False, help="Also train on horizontally flipped images (both are cached).")
    skip_bad_images: bool = _f(False, help="Skip unreadable images with a warning instead of failing.")
    repeats: int = _f(1, help="Repeats for images directly in data.dir.", min=1, max=10000)
    file: str = _f("", help="LLM: JSONL of conversations, one {\"messages\": [...]} per line.")
    max_seq_len: int = _f(2048, help="LLM: tokens per example; longer conversations are truncated.",
                          min=16, max=1_000_000)


@dataclass(frozen=True)
class CacheConfig:
    dir: str = _f(".imglora/cache", help="Where latents and text-encoder outputs are cached.")
    encoder_dtype: Literal["auto", "fp32", "bf16", "fp16"] = _f(
        "auto", help="Precision of the VAE and text encoders while caching; auto = bf16 on CUDA, fp32 on CPU.")
    text_max_length: int = _f(0, help="Token length of cached text embeddings; 0 = family default "
                                      "(77 SDXL, 512 FLUX).", min=0, max=4096)


@dataclass(frozen=True)
class LoraConfig:
    rank: int = _f(16, help="LoRA rank (dimension).", min=1, max=1024)
    alpha: float = _f(0.0, help="LoRA alpha; the update is scaled by alpha / rank. 0 = equal to rank.",
                      min=0.0, max=65536.0)
    dropout: float = _f(0.0, help="Dropout on the LoRA path.", min=0.0, max=0.99)
    targets: list[str] = _f([], help="Module names to adapt (peft target_modules); empty = the family's defaults.")


@dataclass(frozen=True)
class BudgetConfig:
    max_cost: float = _f(0.0, help="Stop (with a checkpoint) when the projected session cost exceeds this; "
                                   "0 = no limit. Needs hourly_rate.", min=0.0, max=1e9)
    hourly_rate: float = _f(0.0, help="What the machine costs per hour, in your currency.", min=0.0, max=1e6)
    max_hours: float = _f(0.0, help="Stop (with a checkpoint) when the projected session exceeds this many "
                                    "hours; 0 = no limit.", min=0.0, max=1e6)
    smoke_steps: int = _f(20, help="Measured updates (after warm-up) before the session is projected.",
                          min=1, max=100_000)
    currency: str = _f("USD", help="Shown with costs.")


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = _f(0, help="Optimizer updates to run; 0 = use epochs.", min=0, max=10_000_000)
    epochs: int = _f(0, help="Passes over the dataset (with repeats), used when max_steps = 0.",
                     min=0, max=100_000)
    learning_rate: float = _f(1e-4, help="Peak learning rate.", min=0.0, max=1.0, min_exclusive=True)
    optimizer: Literal["adamw", "adamw8bit", "adafactor"] = _f("adamw", help="adamw (torch), adamw8bit "
                                                              "(bitsandbytes) or adafactor (transformers).")
    weight_decay: float = _f(0.01, help="Decoupled weight decay.", min=0.0, max=1.0)
    adam_beta1: float = _f(0.9, help="AdamW beta1.", min=0.0, max=0.99999)
    adam_beta2: float = _f(0.999, help="AdamW beta2.", min=0.0, max=0.99999)
    adam_eps: float = _f(1e-8, help="AdamW epsilon.", min=0.0, max=1.0, min_exclusive=True)
    scheduler: Literal["constant", "linear", "cosine", "cosine_with_restarts", "polynomial"] = _f(
        "constant", help="Learning-rate schedule after the linear warmup (diffusers' get_scheduler, as kohya "
                         "sd-scripts): constant, linear or cosine decay to 0, cosine_with_restarts, polynomial.")
    scheduler_cycles: int = _f(1, help="cosine_with_restarts: number of hard restarts.", min=1, max=10_000)
    scheduler_power: float = _f(1.0, help="polynomial: decay power (1 = linear), down to 1e-7.", min=0.0, max=100.0,
                                min_exclusive=True)
    warmup_steps: int = _f(0, help="Linear warmup, in optimizer updates.", min=0, max=10_000_000)
    batch_size: int = _f(1, help="Images per micro-batch.", min=1, max=1024)
    grad_accum: int = _f(1, help="Micro-batches per optimizer update.", min=1, max=1024)
    max_grad_norm: float = _f(1.0, help="Gradient clipping norm; 0 = off.", min=0.0, max=1e6)
    seed: int = _f(42, help="Seed for data order, noise and LoRA init.", min=0, max=2**32 - 1)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = _f(
        "auto", help="auto = bf16 on CUDA, none on CPU.")
    checkpoint_every: int = _f(0, help="Save a checkpoint every N updates; 0 = only at the end.",
                               min=0, max=10_000_000)
    keep_checkpoints: int = _f(3, help="How many of the newest checkpoints to keep.", min=1, max=100_000)
    log_every: int = _f(10, help="Log loss and timing every N updates (each log is a host-device sync).",
                        min=1, max=100_000)
    noise_offset: float = _f(0.0, help="SDXL: noise offset strength.", min=0.0, max=1.0)
    min_snr_gamma: float = _f(0.0, help="SDXL: min-SNR-γ loss weighting; 0 = off (5 is common).",
                              min=0.0, max=1000.0)
    timestep_sampling: Literal["sigmoid", "logit_normal", "uniform", "shift"] = _f(
        "shift", help="FLUX: how training timesteps are drawn.")
    sigmoid_scale: float = _f(1.0, help="FLUX: scale of the normal draw for sigmoid/shift sampling.",
                              min=0.0, max=100.0, min_exclusive=True)
    discrete_flow_shift: float = _f(3.1582, help="FLUX: shift for timestep_sampling = \"shift\".",
                                    min=0.0, max=100.0, min_exclusive=True)
    resolution_dependent_shift: bool = _f(False, help="FLUX: derive the shift from the image size "
                                                      "as FLUX.1-dev inference does.")
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = _f(
        "none", help="FLUX: weighting of the flow-matching loss over noise levels (as SD3 / kohya).")
    guidance: float = _f(1.0, help="FLUX: guidance embedding value during training.", min=0.0, max=100.0)
    eval_after: bool = _f(False, help="Run `imglora eval` in a fresh process after training.")
    budget: BudgetConfig = field(default_factory=BudgetConfig, metadata={"help": "Budget guard."})


@dataclass(frozen=True)
class MemoryConfig:
    gradient_checkpointing: bool = _f(True, help="Recompute activations in backward to save memory.")
    fp8: bool = _f(False, help="Store frozen base weights as float8 (optimum-quanto qfloat8).")
    blocks_to_swap: int = _f(0, help="FLUX: transformer blocks kept on the CPU, counted as kohya "
                                     "sd-scripts does (N//2 double + (N - N//2)*2 single).", min=0, max=1000)
    double_blocks_to_swap: int = _f(-1, help="FLUX: explicit double-block count; -1 = from blocks_to_swap.",
                                    min=-1, max=1000)
    single_blocks_to_swap: int = _f(-1, help="FLUX: explicit single-block count; -1 = from blocks_to_swap.",
                                    min=-1, max=1000)
    quantization: Literal["none", "qint4", "nf4"] = _f(
        "none", help="LLM: 4-bit frozen base weights: qint4 (optimum-quanto) or nf4 (bitsandbytes, CUDA).")


@dataclass(frozen=True)
class EvalConfig:
    prompts: list[str] = _f([], help="Prompts for the evaluation pass; empty = a few defaults with the trigger word.")
    sample_steps: int = _f(20, help="Sampler steps per evaluation image.", min=1, max=1000)
    guidance_scale: float = _f(0.0, help="CFG / FLUX guidance at evaluation; 0 = family default.", min=0.0, max=100.0)
    seed: int = _f(0, help="Seed of the evaluation images.", min=0, max=2**32 - 1)
    holdout: int = _f(0, help="Images held out of training for the held-out loss.", min=0, max=100_000)
    holdout_fraction: float = _f(0.0, help="LLM: fraction of conversations held out for validation.",
                                 min=0.0, max=0.9)
    holdout_file: str = _f("", help="LLM: a separate JSONL of validation conversations.")
    every: int = _f(0, help="Validation loss on the held-out data every N updates during training; 0 = off.",
                    min=0, max=10_000_000)
    holdout_dir: str = _f("", help="A folder of captioned images used only for the held-out loss (in addition "
                                   "to eval.holdout); never trained on.")
    strengths: list[float] = _f([0.0, 0.5, 1.0], help="Adapter strengths of the evaluation images; 0 = the base "
                                                      "model (the columns of the contact sheet).")
    fp8: Literal["same", "on", "off"] = _f("same", help="FLUX: FP8 base weights during evaluation; same = as "
                                                        "memory.fp8 in training.")
    blocks_to_swap: int = _f(-1, help="FLUX: blocks swapped during evaluation (kohya's count, as "
                                      "memory.blocks_to_swap); -1 = as in training.", min=-1, max=1000)


@dataclass(frozen=True)
class ExportConfig:
    comfyui_dir: str = _f("", help="ComfyUI folder to export into (models/loras).")
    name: str = _f("", help="File name of the export; empty = run.name.")
    dtype: DType = _f("bf16", help="Precision of the exported tensors.")
    format: Literal["default", "kohya"] = _f("default", help="Key layout of the export.")


@dataclass(frozen=True)
class RunConfig:
    name: str = _f("", help="Run folder name; empty = the preset's file name.")
    output_dir: str = _f("runs", help="Parent folder of run folders.")


@dataclass(frozen=True)
class Config:
    version: int
    model: ModelConfig
    data: DataConfig
    cache: CacheConfig
    lora: LoraConfig
    train: TrainConfig
    memory: MemoryConfig
    eval: EvalConfig
    export: ExportConfig
    run: RunConfig
    source: str = ""  # the preset file; not part of the configuration's identity

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version}
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        return out

    def to_toml(self) -> str:
        return dumps_toml(self.to_dict())

    def replace(self, **sections: dict[str, Any]) -> "Config":
        """A copy with some fields changed, e.g. ``cfg.replace(train={"max_steps": 5})`` (unchecked)."""
        changes = {k: dataclasses.replace(getattr(self, k), **v) for k, v in sections.items()}
        return dataclasses.replace(self, **changes)

    def hash(self, sections: tuple[str, ...] | None = None) -> str:
        """sha256 of the resolved configuration (or some sections of it)."""
        d = self.to_dict()
        if sections is not None:
            d = {k: d[k] for k in sections}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "cache": CacheConfig, "lora": LoraConfig,
    "train": TrainConfig, "memory": MemoryConfig, "eval": EvalConfig, "export": ExportConfig,
    "run": RunConfig,
}
TOP_LEVEL = ("version", "extends", *SECTIONS)

# Migrations from older schema versions: MIGRATIONS[v] turns a version-v mapping into version v+1.
MIGRATIONS: dict[int, typing.Callable[[dict[str, Any]], dict[str, Any]]] = {}


# ----------------------------------------------------------------------------------------------
# Loading


def load(path: str | Path, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a preset (following ``extends``), apply ``--set`` overrides, check everything."""
    problems: list[str] = []
    origin: dict[str, str] = {}  # dotted key -> where its value came from, for messages
    raw = _read_with_extends(Path(path), problems, origin, chain=())
    if raw is None:
        raise ConfigError(problems, str(path))
    for item in overrides:
        _apply_override(raw, item, problems, origin)
    raw = _migrate(raw, str(path), problems)
    cfg = _build(raw, origin, problems, default_name=Path(path).stem, source=str(path))
    if problems:
        raise ConfigError(problems, str(path))
    assert cfg is not None
    return cfg


def _read_toml(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        problems.append(f"{path}: no such preset file")
        return None
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{path}: cannot read the preset ({exc})")
        return None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # The message ends with "(at line L, column C)"; that is what a user needs.
        problems.append(f"{path}: TOML syntax error: {exc}")
        return None


def _read_with_extends(path: Path, problems: list[str], origin: dict[str, str],
                       chain: tuple[Path, ...]) -> dict[str, Any] | None:
    resolved = path.resolve()
    if resolved in chain:
        problems.append(f"{path}: extends forms a cycle: " + " -> ".join(str(p) for p in (*chain, resolved)))
        return None
    data = _read_toml(path, problems)
    if data is None:
        return None
    parent = data.pop("extends", None)
    merged: dict[str, Any] = {}
    if parent is not None:
        if not isinstance(parent, str) or not parent:
            problems.append(f"{path}: extends: expected the path of another preset, got {parent!r}")
        else:
            base = _read_with_extends(path.parent / parent, problems, origin, (*chain, resolved))
            if base is None:
                return None
            merged = base
    _merge_into(merged, data, str(path), origin, prefix="")
    return merged


def _merge_into(dst: dict[str, Any], src: dict[str, Any], where: str, origin: dict[str, str], prefix: str) -> None:
    for key, value in src.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge_into(dst[key], value, where, origin, prefix=f"{dotted}.")
        else:
            dst[key] = value
            _mark(origin, dotted, value, where)


def _mark(origin: dict[str, str], dotted: str, value: Any, where: str) -> None:
    origin[dotted] = where
    if isinstance(value, dict):
        for k, v in value.items():
            _mark(origin, f"{dotted}.{k}", v, where)


def parse_override_value(text: str) -> Any:
    """A ``--set`` value is read as a TOML value (1e-4, true, [\"a\"], \"x\"); anything else is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _apply_override(raw: dict[str, Any], item: str, problems: list[str], origin: dict[str, str]) -> None:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or "." not in key:
        problems.append(f"--set {item}: expected section.key=value, e.g. --set train.max_steps=100")
        return
    *tables, name = key.split(".")
    table = raw
    for depth, part in enumerate(tables):
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            problems.append(f"--set {key}: {'.'.join(tables[:depth + 1])} is not a table")
            return
    table[name] = parse_override_value(value.strip())
    origin[key] = "--set"


def _migrate(raw: dict[str, Any], where: str, problems: list[str]) -> dict[str, Any]:
    version = raw.get("version", SCHEMA_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        problems.append(f"{where}: version: expected a positive integer schema version, got {version!r}")
        return raw
    if version > SCHEMA_VERSION:
        problems.append(f"{where}: version: this preset has schema version {version}, but this imglora "
                        f"reads up to {SCHEMA_VERSION}; upgrade imglora")
        return raw
    while version < SCHEMA_VERSION:
        raw = MIGRATIONS[version](raw)
        version += 1
    raw["version"] = version
    return raw


# ----------------------------------------------------------------------------------------------
# Checking


def _build(raw: dict[str, Any], origin: dict[str, str], problems: list[str], default_name: str,
           source: str) -> Config | None:
    def where(dotted: str) -> str:
        src = origin.get(dotted) or next((v for k, v in origin.items() if k.startswith(dotted + ".")), source)
        return f"--set {dotted}" if src == "--set" else f"{src}: {dotted}"

    for key in raw:
        if key not in TOP_LEVEL:
            problems.append(f"{where(key)}: unknown section{_did_you_mean(key, TOP_LEVEL)}")
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            problems.append(f"{where(name)}: expected a [{name}] table, got {_describe(table)}")
            table = {}
        sections[name] = _build_section(name, cls, table, where, problems)
    if any(s is None for s in sections.values()):
        return None
    if not sections["run"].name:
        sections["run"] = dataclasses.replace(sections["run"], name=default_name)
    if sections["lora"].alpha == 0:
        sections["lora"] = dataclasses.replace(sections["lora"], alpha=float(sections["lora"].rank))
    cfg = Config(version=raw.get("version", SCHEMA_VERSION), source=source, **sections)
    _cross_checks(cfg, where, problems)
    return cfg


def _build_section(name: str, cls: type, table: dict[str, Any], where, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    ok = True
    for key, value in table.items():
        dotted = f"{name}.{key}"
        if key not in hints:
            problems.append(f"{where(dotted)}: unknown key{_did_you_mean(key, names)}")
            continue
        if dataclasses.is_dataclass(hints[key]):  # a sub-table such as [train.budget]
            if not isinstance(value, dict):
                problems.append(f"{where(dotted)}: expected a table, got {_describe(value)}")
                ok = False
                continue
            sub = _build_section(dotted, hints[key], value, where, problems)
            ok = ok and sub is not None
            values[key] = sub
            continue
        f = next(f for f in dataclasses.fields(cls) if f.name == key)
        err, coerced = _check_value(value, hints[key], f.metadata)
        if err:
            problems.append(f"{where(dotted)}: {err}")
            ok = False
        else:
            values[key] = coerced
    for f in dataclasses.fields(cls):
        if f.default is REQUIRED and f.default_factory is REQUIRED and f.name not in table:
            problems.append(f"{where(name)}.{f.name}: missing required key ({f.metadata['help']})")
            ok = False
    if not ok:
        return None
    return cls(**values)


def _check_value(value: Any, tp: Any, meta: typing.Mapping[str, Any]) -> tuple[str | None, Any]:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) is type(choices[0]):
            return None, value
        hint = _did_you_mean(str(value), [str(c) for c in choices]) if isinstance(value, str) else ""
        return f"expected one of {', '.join(map(repr, choices))}, got {_describe(value)}{hint}", None
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            return f"expected a list, got {_describe(value)}", None
        for i, item in enumerate(value):
            err, _ = _check_value(item, item_tp, {})
            if err:
                return f"item {i}: {err}", None
        return None, list(value)
    if tp is bool:
        if isinstance(value, bool):
            return None, value
        return f"expected true or false, got {_describe(value)}", None
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return _check_range(value, meta), value
        return f"expected an integer, got {_describe(value)}", None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
            if not math.isfinite(value):
                return f"expected a finite number, got {value}", None
            return _check_range(value, meta), value
        return f"expected a number, got {_describe(value)}", None
    if tp is str:
        if isinstance(value, str):
            return None, value
        return f"expected a string, got {_describe(value)}", None
    raise TypeError(f"config field type {tp!r} has no checker")  # a bug in this module, not user input


def _check_range(value: float, meta: typing.Mapping[str, Any]) -> str | None:
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and (value < lo or (meta.get("min_exclusive") and value == lo)):
        bound = f"greater than {lo}" if meta.get("min_exclusive") else f"at least {lo}"
        return f"must be {bound}, got {value}"
    if hi is not None and value > hi:
        return f"must be at most {hi}, got {value}"
    return None


def _cross_checks(cfg: Config, where, problems: list[str]) -> None:
    t, m, d = cfg.train, cfg.memory, cfg.data
    if t.max_steps == 0 and t.epochs == 0:
        problems.append(f"{where('train.max_steps')}: set train.max_steps or train.epochs to a positive number")
    if cfg.model.family == "llm" and not d.file:
        problems.append(f"{where('data.file')}: missing required key for the llm family (a JSONL of conversations)")
    if m.fp8 and m.quantization != "none":
        problems.append(f"{where('memory.fp8')}: memory.fp8 = true and memory.quantization = "
                        f"\"{m.quantization}\" both quantize the frozen base; choose one (set memory.fp8 = false "
                        "for 4-bit QLoRA, or memory.quantization = \"none\" for fp8)")
    if cfg.memory.quantization != "none" and cfg.model.family != "llm":
        problems.append(f"{where('memory.quantization')}: 4-bit quantization is for the llm family; "
                        "image families use memory.fp8")
    if cfg.model.family in ("sdxl", "flux") and not d.dir:
        problems.append(f"{where('data.dir')}: missing required key for the {cfg.model.family} family "
                        "(the folder of training images)")
    if d.min_bucket_side > d.max_bucket_side:
        problems.append(f"{where('data.min_bucket_side')}: {d.min_bucket_side} is larger than "
                        f"data.max_bucket_side = {d.max_bucket_side}")
    if cfg.model.family != "flux" and (m.blocks_to_swap or m.double_blocks_to_swap > 0 or m.single_blocks_to_swap > 0):
        problems.append(f"{where('memory.blocks_to_swap')}: block swapping is implemented for the flux family "
                        f"only; set it to 0 for {cfg.model.family}")
    if m.blocks_to_swap and (m.double_blocks_to_swap >= 0 or m.single_blocks_to_swap >= 0):
        problems.append(f"{where('memory.blocks_to_swap')}: give either blocks_to_swap or "
                        "double_blocks_to_swap/single_blocks_to_swap, not both")
    if d.bucket_step > d.resolution:
        problems.append(f"{where('data.bucket_step')}: {d.bucket_step} is larger than data.resolution = {d.resolution}")
    if t.budget.max_cost and not t.budget.hourly_rate:
        problems.append(f"{where('train.budget.max_cost')}: set train.budget.hourly_rate too, or the cost "
                        "cannot be projected")
    if t.warmup_steps and t.max_steps and t.warmup_steps > t.max_steps:
        problems.append(f"{where('train.warmup_steps')}: {t.warmup_steps} warmup steps exceed "
                        f"train.max_steps = {t.max_steps}")


def _did_you_mean(word: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def _describe(value: Any) -> str:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "table"}
    kind = kinds.get(type(value), type(value).__name__)
    return f"the {kind} {json.dumps(value, default=str)}"


# ----------------------------------------------------------------------------------------------
# Writing


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def dumps_toml(data: dict[str, Any], prefix: str = "") -> str:
    """Write a mapping of scalars, lists and nested tables as TOML."""
    head = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    parts = []
    if head:
        parts.append("\n".join(([f"[{prefix}]"] if prefix else []) + head))
    for name, table in data.items():
        if isinstance(table, dict):
            parts.append(dumps_toml(table, f"{prefix}.{name}" if prefix else name).rstrip("\n"))
    return "\n\n".join(parts) + "\n"


def field_help() -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field, for documentation."""
    rows: list[tuple[str, str, str]] = []

    def walk(prefix: str, cls: type) -> None:
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                walk(f"{prefix}.{f.name}", tp)
                continue
            if f.default is not REQUIRED:
                default = _toml_value(f.default)
            elif f.default_factory is not REQUIRED:
                default = _toml_value(f.default_factory())
            else:
                default = "(required)"
            rows.append((f"{prefix}.{f.name}", default, f.metadata["help"]))

    for name, cls in SECTIONS.items():
        walk(name, cls)
    return rows
