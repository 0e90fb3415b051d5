"""Export a trained adapter as a file that ComfyUI's stock loaders map completely.

The family says which key forms it offers and how its modules are named there (``Exportable``);
this module does what is the same for every family: find the adapter to export (the final one or
a checkpoint), read it with its type and exact alpha and rank per module, write the file under a
temporary name and rename it (never replacing an existing file without ``force``), the
``ss_*``/``modelspec.*`` metadata, and the ComfyUI workflows beside it.

Every exported module makes ComfyUI's patched weight equal the trained model's merged weight
(``adapter_forms``: LoRA ``(alpha / rank) · up @ down``, DoRA with a ``dora_scale`` compensated for
ComfyUI's normalisation, LoHa/LoKr in LyCORIS names). Loaders compute ``alpha / rank`` per module,
so alpha is written per module and fused LoRA modules get a fused alpha (``fuse``). Weights are
read with safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..adapters import KINDS, forms as af
from ..util import atomic
from ..models import comfyui as comfy
from . import workflows
from ..training.checkpoint import EMA_DIR, list_checkpoints
from ..config.checks import PLAIN_NAME_RULE, export_stem, is_plain_name
from ..util.devices import DTYPES
from ..errors import ImgloraError
from ..runs.record import read_records
from .metadata import build_metadata, serialize

if TYPE_CHECKING:
    from ..config import Config
    from ..family import Exportable

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
    warnings: tuple[str, ...] = ()  # e.g. an unfinished run's checkpoint was exported


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
    config: dict[str, Any]    # the resolved preset it was trained with (any schema version)
    record: dict[str, Any]    # the newest train record ({} when there is none)
    warnings: tuple[str, ...] = ()  # what the user should know about this choice


# ---------------------------------------------------------------------------------------------
# The one entry point
# ---------------------------------------------------------------------------------------------


def export(run_dir: Path, family: "Exportable", source: Source, cfg: "Config", *, comfyui: Path | None = None,
           out: Path | None = None, name: str | None = None, dtype: str | None = None, fmt: str | None = None,
           force: bool = False) -> ExportResult:
    """Export ``source`` (an adapter of ``run_dir``, trained with ``cfg``) for ComfyUI and diffusers,
    with two ComfyUI workflows beside it.

    Destination: ``comfyui`` (its LoRA folder), else ``out`` (a file, or a folder), else the run's
    ``export.comfyui_dir``, else ``<run_dir>/export/``. ``name``, ``dtype`` and ``fmt`` default to
    the run's ``[export]`` settings (name: run.name).
    """
    dtype = dtype or cfg.export.dtype
    fmt = fmt or cfg.export.format
    if fmt == "default":
        fmt = family.export_formats[0]
    if dtype not in DTYPES:
        raise ImgloraError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    if fmt not in family.export_formats:
        raise ImgloraError(f"--format {fmt}: the {cfg.model.family} family exports {', '.join(family.export_formats)}")
    given = ((name, "--name"), (cfg.export.name, "export.name"), (cfg.run.name, "run.name"),
             (run_dir.name, "the run folder's name"))
    name = export_name(*next(((n, k) for n, k in given if n), ("", "--name")))
    if comfyui is None and out is None and cfg.export.comfyui_dir:
        comfyui = Path(cfg.export.comfyui_dir)
    dest = destination(run_dir, name, comfyui, out)
    if dest.exists() and not force:  # checked before any work; checked again, atomically, on rename
        raise _exists_error(dest)

    modules = read_adapter(source.path, cfg)
    tensors = export_dtype(family.export_tensors(modules, fmt, base_weights(family, cfg, modules)), DTYPES[dtype])
    metadata = build_metadata(source, cfg, family, name, fmt, modules)
    blob = serialize(tensors, metadata)
    write_new(dest, blob, force)

    stem = dest.name[: -len(".safetensors")]
    with_clip = any(not k.startswith(("unet.", "transformer.")) for k in modules)
    nodes = family.comfyui_nodes(dest.name, evaluation_prompt(cfg), "", cfg.eval.seed, f"imglora/{stem}", with_clip,
                                 cfg.model)
    api, ui = workflows.to_api(nodes), workflows.to_ui(nodes)
    paths = write_workflows(stem, api, ui, [dest.parent, run_dir / EXPORT_SUBDIR])
    _record(run_dir, source, cfg, dest, fmt, dtype, len(tensors), blob)
    return ExportResult(dest, len(tensors), fmt, paths[0], paths[1], metadata, source.path, source.step,
                        source.warnings)


# ---------------------------------------------------------------------------------------------
# Which adapter, and where to
# ---------------------------------------------------------------------------------------------


def find_source(run_dir: Path, which: str = "latest", adapter_file: str = "pytorch_lora_weights.safetensors",
                weights: str = "auto") -> Source:
    """The adapter to export: the final one, the newest checkpoint, or the checkpoint of a step;
    ``weights``: "raw" (the trained weights), "ema" (train.ema's moving average, ``adapter_ema/``),
    or "auto" (the moving average when the run kept one)."""
    if not run_dir.is_dir():
        raise ImgloraError(f"{run_dir}: no such run folder; give the folder `imglora train` wrote (runs/<name>)")
    records = read_records(run_dir, "train")
    record = records[-1] if records else {}
    folder = weights_folder(weights, record.get("config", {}), run_dir)
    final = run_dir / folder / adapter_file
    ckpts = [(step, path) for step, path in list_checkpoints(run_dir) if (path / folder / adapter_file).is_file()]
    finished = [r for r in records if r.get("adapter")]
    final_step = finished[-1].get("steps_done") if finished else None
    which = str(which).strip().lower()
    unfinished = False
    available = ", ".join(str(s) for s, _ in ckpts) or "none"
    label = ", moving average (train.ema)" if folder == EMA_DIR else ""

    if which == "latest":
        # The final adapter unless a resumed run got further and was stopped before its end.
        if final.is_file() and not (ckpts and final_step is not None and ckpts[-1][0] > final_step):
            which = "final"
        elif ckpts:
            which = str(ckpts[-1][0])
            unfinished = True  # the newest checkpoint, chosen for the user: say when it is not the run's end
        else:
            raise ImgloraError(f"{run_dir} holds no adapter (adapter/{adapter_file}) and no checkpoint: is it a "
                               "run folder of `imglora train`, and did training save anything yet?")
    if which == "final":
        if not final.is_file():
            raise ImgloraError(f"{run_dir} has no final adapter (adapter/{adapter_file}); the run did not finish. "
                               f"Export a checkpoint with --checkpoint STEP (available: {available}).")
        if not record:
            raise ImgloraError(f"{run_dir}/records holds no train record, so the run's settings (family, rank, "
                               "alpha) are unknown; export a checkpoint instead, or re-run `imglora train`.")
        label = "final adapter" + (f" (step {final_step})" if final_step is not None else "") + label
        return Source(final, final_step, label, record["config"], record)
    if not which.isdigit():
        raise ImgloraError(f"--checkpoint {which}: give a step number, 'latest' or 'final'")
    step = int(which)
    for s, path in ckpts:
        if s == step:
            state = json.loads((path / "state.json").read_text())
            warned = _unfinished(step, state.get("total_updates") or record.get("total_updates")) if unfinished else ()
            return Source(path / folder / adapter_file, step, f"checkpoint step {step}{label}", state["config"], record,
                          warned)
    raise ImgloraError(f"{run_dir} has no checkpoint for step {step}; available steps: {available}")


def _unfinished(step: int, total: int | None) -> tuple[str, ...]:
    """The warning for exporting, as "latest", the checkpoint of a run that stopped before its end."""
    if not total or step >= total:
        return ()
    return (f"the run stopped at update {step} of {total}; exporting its checkpoint {step}, not a finished "
            f"adapter. To finish the run, resume it (`imglora train PRESET ... --resume`) and export again; "
            f"--checkpoint {step} exports this one without this warning",)


def weights_folder(weights: str, config: dict[str, Any], run_dir: Path) -> str:
    """``adapter`` or ``adapter_ema`` for ``--weights raw|ema|auto`` (auto: ema when the run kept one)."""
    ema = bool(config.get("train", {}).get("ema"))
    if weights == "auto":
        return EMA_DIR if ema else "adapter"
    if weights == "ema" and not ema and not (run_dir / EMA_DIR).is_dir():
        raise ImgloraError(f"--weights ema: {run_dir} was trained without train.ema, so it has no moving average; "
                           "use --weights raw")
    if weights not in ("raw", "ema"):
        raise ImgloraError(f"--weights {weights}: choose raw, ema or auto")
    return EMA_DIR if weights == "ema" else "adapter"


def export_name(name: str, setting: str = "--name") -> str:
    """A file name ComfyUI lists on every OS: no folders, no characters Windows refuses (the rule the
    config checks export.name and run.name with). ``setting`` names where the name came from."""
    name = export_stem(name)
    if not is_plain_name(name):
        raise ImgloraError(f"{setting} {name!r}: {PLAIN_NAME_RULE}")
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

def read_adapter(path: Path, cfg: "Config") -> dict[str, af.Module]:
    """``{"<component>.<module path>": adapter_forms.Module}`` from a diffusers-layout adapter file
    (keys ``<component>.<module>.<peft suffix>``: ``lora_A.weight``, ``hada_w1_a``, ``lokr_w1``, ...).

    The adapter type, alpha and rank (per module, after peft's rank/alpha patterns) come from the
    file's own ``lora_adapter_metadata`` (the peft config saved with those exact weights), else from
    the run's ``lora`` settings.
    """
    from ..util.owned import read_file

    try:
        tensors, header = read_file(path)
    except Exception as exc:  # safetensors raises its own error types for truncated or foreign files
        raise ImgloraError(f"{path}: cannot read the adapter ({exc}); the file is damaged or not an imglora "
                           "adapter") from None
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        parts = key.split(".")
        at = next((i for i, p in enumerate(parts) if p.startswith(af.ADAPTER_PREFIXES)), None)
        if at is None or at < 2:
            raise ImgloraError(f"{path}: unexpected tensor {key!r} (expected <component>.<module>.lora_A.weight, "
                               ".hada_w1_a, .lokr_w1, ...)")
        groups.setdefault(".".join(parts[:at]), {})[key] = value
    peft_meta = json.loads(header.get("lora_adapter_metadata", "{}"))
    modules = {}
    for module, own in sorted(groups.items()):
        component, inner = module.split(".", 1)
        meta = {k[len(component) + 1:]: v for k, v in peft_meta.items() if k.startswith(f"{component}.")}
        kind, alpha, rank, rslora = module_settings(meta, inner, cfg)
        try:
            modules[module] = af.read_peft_module(own, module, kind, alpha, rank, use_rslora=rslora)
        except ImgloraError as exc:
            raise ImgloraError(f"{path}: {exc}") from None
    if not modules:
        raise ImgloraError(f"{path} holds no adapter weights")
    return modules


def module_settings(meta: dict[str, Any], module: str, cfg: "Config") -> tuple[str, float, int, bool]:
    """(adapter type, alpha, rank, rsLoRA) of ``module`` as peft applies them: the saved peft config
    ``meta`` (one component's), with its rank and alpha patterns; without one, the run's settings."""
    if not meta:
        lo = cfg.lora
        return lo.type, float(lo.alpha or lo.rank), int(lo.rank), False
    if meta.get("lora_bias"):
        raise ImgloraError("LoRA biases (peft lora_bias) have no ComfyUI form")
    kind = next((k for k in KINDS.values() if k.is_peft_config(meta)), None)
    if kind is None:
        raise ImgloraError(f"peft adapter type {str(meta.get('peft_type', 'LORA')).upper()} cannot be exported "
                           f"({', '.join(KINDS)} can)")
    return (kind.name, *kind.module_settings(meta, module))


def base_weights(family: "Exportable", cfg: "Config", modules: dict[str, af.Module]) -> dict[str, torch.Tensor]:
    """The base model's weights (fp32) of the modules whose ComfyUI form depends on them (DoRA:
    ComfyUI normalises by the original weight's row norm, so ``dora_scale`` is computed against
    it), read from the files the run trained on; {} when no module needs one."""
    names = [name for name, m in modules.items() if KINDS[m.kind].needs_base_weight]
    if not names:
        return {}
    from ..models.resolve import resolve_model

    try:
        src = resolve_model(cfg.model, family)
    except ImgloraError as exc:
        raise ImgloraError(f"exporting DoRA for ComfyUI needs the base model's weights of the adapted layers "
                           f"(ComfyUI divides by their norms): {exc}") from None
    return family.base_weights(src, names)


def export_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every adapter tensor in ``dtype``, except ``alpha`` (a 0-dim fp32 scalar) and ``dora_scale``
    (fp32: bf16 would round away the compensation it carries)."""
    return {k: v if k.endswith((".alpha", ".dora_scale")) else v.to(dtype) for k, v in tensors.items()}


# ---------------------------------------------------------------------------------------------
# Building blocks of the families' key forms
# ---------------------------------------------------------------------------------------------


def alpha_tensor(value: float) -> torch.Tensor:
    # A 0-dim float32, as kohya writes it: ComfyUI calls .item(), diffusers' FLUX loader needs a float tensor.
    return torch.tensor(float(value), dtype=torch.float32)


def kohya_tensors(name: str, m: LoraModule) -> dict[str, torch.Tensor]:
    """``<name>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``: the kohya form ComfyUI reads."""
    return {f"{name}.lora_down.weight": m.down, f"{name}.lora_up.weight": m.up, f"{name}.alpha": alpha_tensor(m.alpha)}


def kohya_name(prefix: str, path: str) -> str:
    """``(lora_unet, down_blocks.1.x.to_q)`` -> ``lora_unet_down_blocks_1_x_to_q``."""
    return f"{prefix}_{path.replace('.', '_')}"


def add_unique(out: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    # Dots become underscores, so two odd module paths could collide; never let one overwrite another.
    clash = out.keys() & new.keys()
    if clash:
        raise ImgloraError(f"two modules map to the same exported name {sorted(clash)[0]!r}")
    out.update(new)


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


def evaluation_prompt(cfg: "Config") -> str:
    """The run's first evaluation prompt, with the trigger word in it."""
    trigger = cfg.data.first_training_set().trigger_word.strip()
    prompt = cfg.eval.prompts[0].strip() if cfg.eval.prompts else (f"a photo of {trigger}" if trigger else "a photo")
    if trigger and trigger.lower() not in prompt.lower():
        prompt = f"{trigger}, {prompt}"
    return prompt


def _record(run_dir: Path, source: Source, cfg: "Config", dest: Path, fmt: str, dtype: str, n_tensors: int,
            blob: bytes) -> None:
    from ..runs.record import RunRecord

    rec = RunRecord("export", run_dir, cfg.to_dict())
    rec.set(source=str(source.path), step=source.step, destination=str(dest), format=fmt, dtype=dtype,
            n_tensors=n_tensors, sha256=hashlib.sha256(blob).hexdigest(), warnings=list(source.warnings),
            exported_at=datetime.now(timezone.utc).isoformat())
    rec.write()
