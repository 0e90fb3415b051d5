"""Export a trained adapter as a LoRA that ComfyUI's stock loaders map completely.

Key forms (checked against ComfyUI's comfy/lora.py and diffusers' lora_conversion_utils.py):

- SDXL: kohya form with diffusers module paths, ``lora_unet_<path, dots as underscores>.lora_down.weight``
  / ``.lora_up.weight`` / ``.alpha``. ComfyUI maps every UNet Linear/Conv2d name in this form;
  it does not map the attention layers in the peft layout the trainer saves. diffusers loads it too.
- FLUX (default): diffusers form, ``transformer.<path>.lora_A.weight`` / ``.lora_B.weight`` plus an
  ``.alpha`` per module. ComfyUI patches q, k and v into their slices of the fused BFL weights itself.
- FLUX (``fmt="kohya"``): the kohya/BFL form, ``lora_unet_double_blocks_N_img_attn_qkv`` etc.,
  with q/k/v (and the single blocks' MLP input) fused into one LoRA per BFL weight.

Every exported module satisfies ``(alpha / rank) · up @ down == trained delta``: loaders compute
``alpha / down.shape[0]``, so alpha is written per module and fused modules get a fused alpha.
Weights are read with safetensors only; the file is written under a temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import torch

from . import __version__, atomic
from . import comfyui as comfy
from .checkpoint import list_checkpoints
from .errors import ImgloraError
from .lora import ADAPTER_FILE
from .record import read_records

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FORMATS = ("default", "kohya")
EXPORT_SUBDIR = "export"  # in the run folder: exports without a destination, and workflow copies


@dataclass(frozen=True)
class ExportResult:
    path: Path              # the exported .safetensors
    n_tensors: int
    format: str             # "default" or "kohya"
    workflow_api: Path      # ComfyUI API-format workflow beside the export
    workflow_ui: Path       # ComfyUI UI graph beside the export (drop it onto the ComfyUI page)
    metadata: dict[str, str]
    source: Path            # the adapter file that was exported
    step: int | None        # its training step, when known


@dataclass(frozen=True)
class LoraModule:
    """One adapted module; its update is ``alpha / rank · up @ down`` with ``rank = down.shape[0]``."""
    down: torch.Tensor  # peft lora_A: (rank, in) or (rank, in, kh, kw)
    up: torch.Tensor    # peft lora_B: (out, rank) or (out, rank, 1, 1)
    alpha: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass(frozen=True)
class Source:
    path: Path                # adapter safetensors
    step: int | None
    label: str                # how messages name it
    config: dict[str, Any]    # the resolved preset it was trained with
    record: dict[str, Any]    # the newest train record ({} when there is none)


# ---------------------------------------------------------------------------------------------
# The one entry point
# ---------------------------------------------------------------------------------------------


def export(run_dir: Path, *, checkpoint: str = "latest", comfyui: Path | None = None, out: Path | None = None,
           name: str | None = None, dtype: str | None = None, fmt: str | None = None,
           force: bool = False) -> ExportResult:
    """Export a run's adapter for ComfyUI (and diffusers), with two ComfyUI workflows beside it.

    ``checkpoint``: "latest" (the newest of the final adapter and the checkpoints), "final", or a
    step number. Destination: ``comfyui`` (its LoRA folder), else ``out`` (a file, or a folder),
    else the run's ``export.comfyui_dir`` setting, else ``<run_dir>/export/``. ``name``, ``dtype``
    and ``fmt`` default to the run's ``[export]`` settings, then to run.name, "bf16", "default".
    """
    run_dir = Path(run_dir)
    _refuse_other_families(run_dir)
    source = find_source(run_dir, checkpoint)
    cfg = source.config
    settings = cfg.get("export", {})
    dtype = dtype or settings.get("dtype") or "bf16"
    fmt = fmt or settings.get("format") or "default"
    if dtype not in DTYPES:
        raise ImgloraError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    if fmt not in FORMATS:
        raise ImgloraError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    family = cfg["model"]["family"]
    if (family, fmt) not in CONVERTERS:
        raise ImgloraError(f"{run_dir}: export supports the sdxl and flux families, not {family!r}")
    name = export_name(name or settings.get("name") or cfg.get("run", {}).get("name") or run_dir.name)
    if comfyui is None and out is None and settings.get("comfyui_dir"):
        comfyui = Path(settings["comfyui_dir"])
    dest = destination(run_dir, name, comfyui, out)
    if dest.exists() and not force:  # checked before any work; checked again, atomically, on rename
        raise _exists_error(dest)

    modules = read_adapter(source.path, cfg)
    tensors = {k: v.to(DTYPES[dtype]) if k.endswith(".weight") else v
               for k, v in CONVERTERS[(family, fmt)](modules).items()}
    metadata = build_metadata(source, name, family, fmt, modules)
    blob = serialize(tensors, metadata)
    write_new(dest, blob, force)

    stem = dest.name[: -len(".safetensors")]
    with_clip = any(not k.startswith(("unet.", "transformer.")) for k in modules)
    api, ui = comfy.workflows(family, dest.name, evaluation_prompt(cfg), seed=int(cfg.get("eval", {}).get("seed", 0)),
                                prefix=f"imglora/{stem}", with_clip=family == "flux" and with_clip)
    paths = write_workflows(stem, api, ui, [dest.parent, run_dir / EXPORT_SUBDIR])
    _record(run_dir, source, dest, fmt, dtype, len(tensors), blob)
    return ExportResult(dest, len(tensors), fmt, paths[0], paths[1], metadata, source.path, source.step)


# ---------------------------------------------------------------------------------------------
# Which adapter, and where to
# ---------------------------------------------------------------------------------------------


def find_source(run_dir: Path, which: str = "latest") -> Source:
    """The adapter to export: the final one, the newest checkpoint, or the checkpoint of a step."""
    if not run_dir.is_dir():
        raise ImgloraError(f"{run_dir}: no such run folder; give the folder `imglora train` wrote (runs/<name>)")
    final = run_dir / "adapter" / ADAPTER_FILE
    ckpts = [(step, path) for step, path in list_checkpoints(run_dir) if (path / "adapter" / ADAPTER_FILE).is_file()]
    records = read_records(run_dir, "train")
    record = records[-1] if records else {}
    finished = [r for r in records if r.get("adapter")]
    final_step = finished[-1].get("steps_done") if finished else None
    which = str(which).strip().lower()
    available = ", ".join(str(s) for s, _ in ckpts) or "none"

    if which == "latest":
        # The final adapter unless a resumed run got further and was stopped before its end.
        if final.is_file() and not (ckpts and final_step is not None and ckpts[-1][0] > final_step):
            which = "final"
        elif ckpts:
            which = str(ckpts[-1][0])
        else:
            raise ImgloraError(f"{run_dir} holds no adapter (adapter/{ADAPTER_FILE}) and no checkpoint: is it a "
                               "run folder of `imglora train`, and did training save anything yet?")
    if which == "final":
        if not final.is_file():
            raise ImgloraError(f"{run_dir} has no final adapter (adapter/{ADAPTER_FILE}); the run did not finish. "
                               f"Export a checkpoint with --checkpoint STEP (available: {available}).")
        if not record:
            raise ImgloraError(f"{run_dir}/records holds no train record, so the run's settings (family, rank, "
                               "alpha) are unknown; export a checkpoint instead, or re-run `imglora train`.")
        label = "final adapter" + (f" (step {final_step})" if final_step is not None else "")
        return Source(final, final_step, label, record["config"], record)
    if not which.isdigit():
        raise ImgloraError(f"--checkpoint {which}: give a step number, 'latest' or 'final'")
    step = int(which)
    for s, path in ckpts:
        if s == step:
            state = json.loads((path / "state.json").read_text())
            return Source(path / "adapter" / ADAPTER_FILE, step, f"checkpoint step {step}", state["config"], record)
    raise ImgloraError(f"{run_dir} has no checkpoint for step {step}; available steps: {available}")


def _refuse_other_families(run_dir: Path) -> None:
    """An LLM run holds a PEFT adapter, not an image LoRA: say what to use instead of "no adapter"."""
    records = read_records(run_dir, "train") if run_dir.is_dir() else []
    ckpts = list_checkpoints(run_dir) if run_dir.is_dir() else []
    cfg = records[-1]["config"] if records else (
        json.loads((ckpts[-1][1] / "state.json").read_text())["config"] if ckpts else None)
    family = (cfg or {}).get("model", {}).get("family")
    if family and family not in FAMILY_META:
        raise ImgloraError(f"{run_dir} trained a {family} model; export writes image-model LoRAs for ComfyUI. For an "
                           f"LLM adapter use the PEFT folder {run_dir / 'adapter'} as it is (PeftModel.from_pretrained, "
                           f"vllm serve --enable-lora), or `imglora merge {run_dir} --out DIR` for a merged model")


_BAD_NAME = re.compile(r'[<>:"/\\|?*\x00-\x1f]')


def export_name(name: str) -> str:
    """A file name ComfyUI lists on every OS: no folders, no characters Windows refuses."""
    name = name.strip()
    if name.endswith(".safetensors"):
        name = name[: -len(".safetensors")]
    if not name or name.startswith(".") or _BAD_NAME.search(name):
        raise ImgloraError(f"--name {name!r}: use a plain file name without folders or any of <>:\"/\\|?*")
    return name


def destination(run_dir: Path, name: str, comfyui_dir: Path | None, out: Path | None) -> Path:
    if comfyui_dir is not None and out is not None:
        raise ImgloraError("give either --comfyui or --out, not both")
    if comfyui_dir is not None:
        return comfy.export_folder(comfy.find_root(comfyui_dir)) / f"{name}.safetensors"
    if out is None:
        return run_dir / EXPORT_SUBDIR / f"{name}.safetensors"
    out = Path(out).expanduser()
    if out.is_dir():
        return out / f"{name}.safetensors"
    if out.suffix != ".safetensors":
        raise ImgloraError(f"--out {out}: name a .safetensors file or an existing folder")
    return out


def _exists_error(dest: Path) -> ImgloraError:
    return ImgloraError(f"{dest} already exists; pass --force to replace it, or choose another --name")


# ---------------------------------------------------------------------------------------------
# Reading the trained adapter
# ---------------------------------------------------------------------------------------------

_PEFT_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


def read_adapter(path: Path, config: dict[str, Any]) -> dict[str, LoraModule]:
    """``{"<component>.<module path>": LoraModule}`` from a diffusers-layout adapter file.

    alpha comes from the file's own ``lora_adapter_metadata`` (the peft config saved with those
    exact weights), else from the run's ``lora`` settings.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as exc:  # safetensors raises its own error types for truncated or foreign files
        raise ImgloraError(f"{path}: cannot read the adapter ({exc}); the file is damaged or not an imglora "
                           "adapter") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        m = _PEFT_KEY.match(key)
        if not m or "." not in m["module"]:
            raise ImgloraError(f"{path}: unexpected tensor {key!r} (expected <component>.<module>.lora_A/B.weight; "
                               "LoRA biases and DoRA are not exported)")
        pairs.setdefault(m["module"], {})[m["which"]] = value
    peft_meta = json.loads(header.get("lora_adapter_metadata", "{}"))
    modules = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ImgloraError(f"{path}: {module} has lora_{next(iter(ab))} without its partner")
        down, up = ab["A"], ab["B"]
        if up.shape[1] != down.shape[0]:
            raise ImgloraError(f"{path}: {module}: lora_B {tuple(up.shape)} does not fit lora_A {tuple(down.shape)}")
        component = module.split(".", 1)[0]
        modules[module] = LoraModule(down, up, module_alpha(peft_meta, component, config, down.shape[0], path))
    if not modules:
        raise ImgloraError(f"{path} holds no LoRA weights")
    return modules


def module_alpha(meta: dict[str, Any], component: str, config: dict[str, Any], rank: int, path: Path) -> float:
    """The alpha that makes ``alpha / rank`` equal peft's scaling for this module."""
    peft = {k[len(component) + 1:]: v for k, v in meta.items() if k.startswith(f"{component}.")}
    if peft.get("lora_alpha") is None:
        lora_cfg = config.get("lora", {})
        if "alpha" not in lora_cfg:
            raise ImgloraError(f"{path}: no LoRA alpha in the file or in the run's settings")
        alpha, r = float(lora_cfg["alpha"] or lora_cfg["rank"]), int(lora_cfg["rank"])
    else:
        alpha, r = float(peft["lora_alpha"]), int(peft["r"])
        if peft.get("rank_pattern") or peft.get("alpha_pattern"):
            raise ImgloraError(f"{path}: per-module rank or alpha patterns are not supported by export")
        if peft.get("use_dora") or peft.get("lora_bias"):
            raise ImgloraError(f"{path}: DoRA and LoRA biases have no ComfyUI LoRA form; export supports plain LoRA")
    if rank != r:
        raise ImgloraError(f"{path}: a {component} module has rank {rank}, the adapter's settings say {r}")
    if peft.get("use_rslora"):
        return alpha * math.sqrt(rank)  # rsLoRA scales by alpha / sqrt(rank)
    return alpha


# ---------------------------------------------------------------------------------------------
# Key forms
# ---------------------------------------------------------------------------------------------

KOHYA_PREFIX = {  # (family, component) -> kohya prefix; ComfyUI maps lora_te3_ to FLUX's T5
    ("sdxl", "unet"): "lora_unet", ("sdxl", "text_encoder"): "lora_te1", ("sdxl", "text_encoder_2"): "lora_te2",
    ("flux", "text_encoder"): "lora_te1", ("flux", "text_encoder_2"): "lora_te3",
}


def kohya_name(family: str, module: str) -> str:
    """``unet.down_blocks.1.x.to_q`` -> ``lora_unet_down_blocks_1_x_to_q`` (text encoders: lora_te1_/te2_)."""
    component, path = module.split(".", 1)
    prefix = KOHYA_PREFIX.get((family, component))
    if prefix is None:
        raise ImgloraError(f"no kohya name for {family} component {component!r}")
    return f"{prefix}_{path.replace('.', '_')}"


def _alpha(value: float) -> torch.Tensor:
    # A 0-dim float32, as kohya writes it: ComfyUI calls .item(), diffusers' FLUX loader needs a float tensor.
    return torch.tensor(float(value), dtype=torch.float32)


def _kohya_tensors(name: str, m: LoraModule) -> dict[str, torch.Tensor]:
    return {f"{name}.lora_down.weight": m.down, f"{name}.lora_up.weight": m.up, f"{name}.alpha": _alpha(m.alpha)}


def _unique(out: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    # Dots become underscores, so two odd module paths could collide; never let one overwrite another.
    clash = out.keys() & new.keys()
    if clash:
        raise ImgloraError(f"two modules map to the same exported name {sorted(clash)[0]!r}")
    out.update(new)


def sdxl_tensors(modules: dict[str, LoraModule]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for module, m in modules.items():
        _unique(out, _kohya_tensors(kohya_name("sdxl", module), m))
    return out


def flux_tensors(modules: dict[str, LoraModule]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for module, m in modules.items():
        if not module.startswith(("transformer.", "text_encoder.")):
            raise ImgloraError(f"{module}: the FLUX default form has no mapping for this component; "
                               "use --format kohya (T5 weights map as lora_te3_)")
        out.update({f"{module}.lora_A.weight": m.down, f"{module}.lora_B.weight": m.up,
                    f"{module}.alpha": _alpha(m.alpha)})
    return out


# diffusers FLUX module -> BFL module (ComfyUI's flux_to_diffusers, read backwards).
_FLUX_DOUBLE = {
    "attn.to_q": "img_attn.qkv", "attn.to_k": "img_attn.qkv", "attn.to_v": "img_attn.qkv",
    "attn.add_q_proj": "txt_attn.qkv", "attn.add_k_proj": "txt_attn.qkv", "attn.add_v_proj": "txt_attn.qkv",
    "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
    "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
}
_FLUX_SINGLE = {
    "attn.to_q": "linear1", "attn.to_k": "linear1", "attn.to_v": "linear1", "proj_mlp": "linear1",
    "proj_out": "linear2", "norm.linear": "modulation.lin",
}
_FLUX_GLOBAL = {
    "x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
}
# Fused BFL weights: their diffusers parts in output-row order, each part's rows in units of the
# hidden size (q, k, v: 1; the single blocks' MLP input: mlp_ratio 4).
FLUX_FUSED = {
    "img_attn.qkv": (("attn.to_q", 1), ("attn.to_k", 1), ("attn.to_v", 1)),
    "txt_attn.qkv": (("attn.add_q_proj", 1), ("attn.add_k_proj", 1), ("attn.add_v_proj", 1)),
    "linear1": (("attn.to_q", 1), ("attn.to_k", 1), ("attn.to_v", 1), ("proj_mlp", 4)),
}
# diffusers' AdaLayerNormContinuous chunks (scale, shift); BFL's LastLayer chunks (shift, scale).
FLUX_SWAP_HALVES = {"final_layer.adaLN_modulation.1"}
_FLUX_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def flux_bfl_module(path: str) -> str:
    """``transformer_blocks.3.attn.to_k`` -> ``double_blocks.3.img_attn.qkv`` (paths without ``transformer.``)."""
    m = _FLUX_BLOCK.match(path)
    if m:
        kind, n, rest = m.groups()
        double = kind == "transformer_blocks"
        table, bfl = (_FLUX_DOUBLE, "double_blocks") if double else (_FLUX_SINGLE, "single_blocks")
        if rest in table:
            return f"{bfl}.{n}.{table[rest]}"
    elif path in _FLUX_GLOBAL:
        return _FLUX_GLOBAL[path]
    raise ImgloraError(f"transformer.{path}: no FLUX.1 (BFL) weight corresponds to this module; "
                       "export it with the default format")


def flux_fused_parts(bfl: str) -> tuple[tuple[str, int], ...] | None:
    """For a fused BFL module, ``(diffusers path, rows in hidden-size units)`` of its parts; else None."""
    m = re.match(r"^(double_blocks|single_blocks)\.(\d+)\.(.+)$", bfl)
    if not m or m[3] not in FLUX_FUSED:
        return None
    prefix = f"{'transformer_blocks' if m[1] == 'double_blocks' else 'single_transformer_blocks'}.{m[2]}."
    return tuple((prefix + part, mult) for part, mult in FLUX_FUSED[m[3]])


def fuse(parts: list[LoraModule | None], rows: list[int]) -> LoraModule:
    """One LoRA for a fused weight whose row slices are the parts (None = not trained, zero delta).

    down = the parts' downs stacked (fused rank R = Σ r_i); up = their ups placed block-diagonally.
    Loaders scale by alpha_f / R, so alpha_f = s·R with s the first part's alpha / rank: each slice
    then gets exactly s·B_i·A_i. (kohya's split_qkv keeps alpha_f = alpha, which weakens every slice
    k-fold: sd-scripts issue #2204.) Parts with a different scale get the ratio folded into their up.
    """
    trained = [p for p in parts if p is not None]
    ref = Fraction(trained[0].alpha) / trained[0].rank
    fused_rank = sum(p.rank for p in trained)
    ref_up = trained[0].up
    up = torch.zeros((sum(rows), fused_rank, *ref_up.shape[2:]), dtype=ref_up.dtype)
    row = col = 0
    for part, n_rows in zip(parts, rows):
        if part is not None:
            ratio = (Fraction(part.alpha) / part.rank) / ref
            up[row:row + n_rows, col:col + part.rank] = part.up if ratio == 1 else part.up * float(ratio)
            col += part.rank
        row += n_rows
    down = torch.cat([p.down for p in trained], dim=0)
    return LoraModule(down, up, float(ref * fused_rank))


def flux_kohya_tensors(modules: dict[str, LoraModule]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    by_target: dict[str, dict[str, LoraModule]] = {}
    for module, m in modules.items():
        component, path = module.split(".", 1)
        if component != "transformer":
            _unique(out, _kohya_tensors(kohya_name("flux", module), m))
            continue
        by_target.setdefault(flux_bfl_module(path), {})[path] = m
    for bfl, trained in sorted(by_target.items()):
        parts = flux_fused_parts(bfl)
        if parts is None:
            (m,) = trained.values()
            if bfl in FLUX_SWAP_HALVES:
                scale, shift = m.up.chunk(2, dim=0)
                m = LoraModule(m.down, torch.cat([shift, scale], dim=0), m.alpha)
        else:
            hidden = next(iter(trained.values())).down.shape[1]  # every part reads the hidden state
            rows = [mult * hidden for _, mult in parts]
            for (path, _), n_rows in zip(parts, rows):
                if path in trained and trained[path].up.shape[0] != n_rows:
                    raise ImgloraError(f"transformer.{path} has {trained[path].up.shape[0]} outputs, a FLUX.1 "
                                       f"{bfl} slice has {n_rows}; use the default format for this model")
            m = fuse([trained.get(path) for path, _ in parts], rows)
        _unique(out, _kohya_tensors(f"lora_unet_{bfl.replace('.', '_')}", m))
    return out


CONVERTERS: dict[tuple[str, str], Callable[[dict[str, LoraModule]], dict[str, torch.Tensor]]] = {
    ("sdxl", "default"): sdxl_tensors,
    ("sdxl", "kohya"): sdxl_tensors,  # SDXL's default already is the kohya form
    ("flux", "default"): flux_tensors,
    ("flux", "kohya"): flux_kohya_tensors,
}


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------

FAMILY_META = {
    "sdxl": {"ss_network_module": "networks.lora", "ss_base_model_version": "sdxl_base_v1-0",
             "modelspec.architecture": "stable-diffusion-xl-v1-base/lora",
             "modelspec.implementation": "https://github.com/Stability-AI/generative-models"},
    "flux": {"ss_network_module": "networks.lora_flux", "ss_base_model_version": "flux1",
             "modelspec.architecture": "flux-1-dev/lora",
             "modelspec.implementation": "https://github.com/black-forest-labs/flux"},
}


def _unix(iso: str | None) -> float | None:
    try:
        return datetime.fromisoformat(iso).timestamp() if iso else None
    except ValueError:
        return None


def build_metadata(source: Source, name: str, family: str, fmt: str,
                   modules: dict[str, LoraModule]) -> dict[str, str]:
    """kohya ``ss_*`` and ``modelspec.*`` keys (all strings, as kohya writes them) plus ``imglora.*``.

    A1111/Forge and ComfyUI model managers read ``ss_*`` and ``modelspec.*``; loaders ignore them.
    """
    cfg, rec = source.config, source.record

    def c(section: str, key: str) -> Any:
        return cfg.get(section, {}).get(key)

    res, trigger = c("data", "resolution"), (c("data", "trigger_word") or "").strip()
    ranks = sorted({m.rank for m in modules.values()})
    alpha = c("lora", "alpha") or next(iter(modules.values())).alpha
    produced = datetime.fromtimestamp(int(source.path.stat().st_mtime))  # when these weights were written
    checksums = rec.get("model_checksums") or {}
    meta: dict[str, Any] = {
        **FAMILY_META[family],
        "ss_output_name": name,
        "ss_network_dim": c("lora", "rank") or ranks[-1],
        "ss_network_alpha": float(alpha),
        "ss_network_dropout": c("lora", "dropout"),
        "ss_network_args": "{}",
        "ss_v2": False,
        "ss_resolution": f"({res}, {res})" if res else None,
        "ss_steps": source.step,
        "ss_max_train_steps": rec.get("total_updates") or c("train", "max_steps") or None,
        "ss_learning_rate": c("train", "learning_rate"),
        "ss_unet_lr": c("train", "learning_rate"),
        "ss_lr_scheduler": c("train", "scheduler"),
        "ss_lr_warmup_steps": c("train", "warmup_steps"),
        "ss_optimizer": c("train", "optimizer"),
        "ss_seed": c("train", "seed"),
        "ss_batch_size_per_device": c("train", "batch_size"),
        "ss_gradient_accumulation_steps": c("train", "grad_accum"),
        "ss_max_grad_norm": c("train", "max_grad_norm"),
        "ss_mixed_precision": c("train", "mixed_precision"),
        "ss_gradient_checkpointing": c("memory", "gradient_checkpointing"),
        "ss_num_train_images": rec.get("dataset_items"),
        "ss_training_started_at": _unix(rec.get("started")),
        "ss_training_finished_at": _unix(rec.get("finished")),
        "ss_sd_model_name": c("model", "path"),
        "ss_training_comment": f"trained with imglora {__version__}",
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.title": name,
        "modelspec.date": produced.isoformat(),
        "modelspec.resolution": f"{res}x{res}" if res else None,
        "modelspec.trigger_phrase": trigger or None,
        "modelspec.description": f"LoRA for {c('model', 'path')}, rank {ranks[-1]}, alpha {float(alpha):g}; "
                                 f"{source.label}, exported by imglora {__version__}",
        "imglora.version": __version__,
        "imglora.format": fmt,
        "imglora.run": cfg.get("run", {}).get("name"),
        "imglora.source": source.label,
        "imglora.base_model": c("model", "path"),
        "imglora.base_model_checksums": json.dumps(checksums, sort_keys=True, separators=(",", ":"))
                                        if checksums else None,
        "imglora.base_model_hash": _summary_hash(checksums),
        "imglora.dataset_version": rec.get("dataset_version"),
    }
    if trigger:
        # kohya counts caption tags per dataset folder; imglora records the tag it prepended to every caption.
        folder = Path(c("data", "dir") or "dataset").name
        meta["ss_tag_frequency"] = json.dumps({folder: {trigger: rec.get("dataset_items") or 1}})
    if family == "sdxl":
        meta["ss_noise_offset"] = c("train", "noise_offset")
        meta["ss_min_snr_gamma"] = c("train", "min_snr_gamma")
        meta["modelspec.prediction_type"] = _prediction_type(rec.get("model_dir"))
    else:
        meta["ss_timestep_sampling"] = c("train", "timestep_sampling")
        meta["ss_discrete_flow_shift"] = c("train", "discrete_flow_shift")
        meta["ss_sigmoid_scale"] = c("train", "sigmoid_scale")
        meta["ss_guidance_scale"] = c("train", "guidance")
    return {k: str(v) for k, v in meta.items() if v is not None}


def _summary_hash(checksums: dict[str, str]) -> str | None:
    """One sha256 over the base model's per-file checksums, to compare bases at a glance."""
    if not checksums:
        return None
    return hashlib.sha256("".join(f"{k}={v}\n" for k, v in sorted(checksums.items())).encode()).hexdigest()


def _prediction_type(model_dir: str | None) -> str:
    if not model_dir:
        return "epsilon"
    try:
        sched = json.loads((Path(model_dir) / "scheduler" / "scheduler_config.json").read_text())
    except (OSError, ValueError):
        return "epsilon"  # SDXL base 1.0
    return "v" if sched.get("prediction_type") == "v_prediction" else "epsilon"


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


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def write_new(dest: Path, data: bytes, force: bool) -> None:
    """Write ``dest`` under a temporary name, then rename; without ``force`` never replace a file,
    not even one that appeared while this one was being written."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    except OSError as exc:
        raise ImgloraError(f"cannot write into {dest.parent}: {exc.strerror or exc}") from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~atomic.umask())  # mkstemp makes it private; ComfyUI may run as another user
        if force:
            os.replace(tmp, dest)
            return
        try:
            os.link(tmp, dest)  # creates dest only if it does not exist, atomically
        except FileExistsError:
            raise _exists_error(dest) from None
        except OSError:  # file systems without hard links (FAT, some network shares)
            if dest.exists():
                raise _exists_error(dest) from None
            os.replace(tmp, dest)
    except OSError as exc:
        raise ImgloraError(atomic.explain(dest, exc)) from None
    finally:
        tmp.unlink(missing_ok=True)


def write_workflows(stem: str, api: dict[str, Any], ui: dict[str, Any], folders: list[Path]) -> tuple[Path, Path]:
    """``<stem>.workflow-api.json`` and ``<stem>.workflow.json`` in each folder; returns the first pair."""
    written: list[tuple[Path, Path]] = []
    for folder in dict.fromkeys(f.resolve() for f in folders):
        pair = (folder / f"{stem}.workflow-api.json", folder / f"{stem}.workflow.json")
        atomic.write_json(pair[0], api)
        atomic.write_json(pair[1], ui)
        written.append(pair)
    return written[0]


def evaluation_prompt(cfg: dict[str, Any]) -> str:
    """The run's first evaluation prompt, with the trigger word in it."""
    trigger = (cfg.get("data", {}).get("trigger_word") or "").strip()
    prompts = cfg.get("eval", {}).get("prompts") or []
    prompt = prompts[0].strip() if prompts else (f"a photo of {trigger}" if trigger else "a photo")
    if trigger and trigger.lower() not in prompt.lower():
        prompt = f"{trigger}, {prompt}"
    return prompt


def _record(run_dir: Path, source: Source, dest: Path, fmt: str, dtype: str, n_tensors: int, blob: bytes) -> None:
    from .record import RunRecord

    rec = RunRecord("export", run_dir, source.config)
    rec.set(source=str(source.path), step=source.step, destination=str(dest), format=fmt, dtype=dtype,
            n_tensors=n_tensors, sha256=hashlib.sha256(blob).hexdigest(),
            exported_at=datetime.now(timezone.utc).isoformat())
    rec.write()
