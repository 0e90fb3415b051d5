"""The evaluation pass: images and held-out loss of a trained run, in a process of its own.

Sampling inside the training loop stacks a second memory peak on top of training's (text encoders,
the VAE decoder, a second set of activations), a classic cause of OOM on 24 GB cards. imglora never
samples while training; ``imglora eval RUN_DIR`` (or ``train.eval_after = true``) runs afterwards,
in a fresh process, and:

* loads the base model once, with the run's LoRA layout and the memory settings ``eval.fp8`` /
  ``eval.blocks_to_swap`` (which may differ from training's), then swaps each checkpoint's adapter
  weights in: the base is never reloaded per checkpoint;
* scores the family's own training loss on the held-out images and on the training images at
  fixed noise and fixed noise levels (the same generator seeds for every checkpoint and run), so the
  figures are deterministic and comparable; the draw with k = 0 is exactly the loop's ``eval.every``
  validation loss;
* generates one image per prompt and adapter strength at a fixed seed, resolution and number of
  sampler steps, and a contact sheet (rows: prompts, columns: strengths; strength 0 is the base
  model, bit for bit when neither FP8 nor block swap is on);
* writes an ``eval`` run record with its own peak device memory, host RSS and duration.

Outputs, in ``<run>/eval/``: ``step-NNNNNN/p{i}_s{strength}.png`` and ``contact_sheet.png`` per
checkpoint, ``losses.json`` (accumulated over invocations with the same loss settings) and
``loss_vs_step.png`` with the checkpoint of lowest held-out loss marked (LoRA overfits quickly).
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from ..util import atomic, devices
from ..adapters import inject as lora
from ..training import step as loop
from ..runs import record, sheets, telemetry, trackers
from ..training.checkpoint import EMA_DIR, list_checkpoints
from ..errors import ImgloraError
from ..family import Sampler, Swappable, supports, text_length
from ..memory.wrap import resolve_swap
from ..models.resolve import resolve_model
from ..runs.progress import Progress
from .common import family_of, saved_config

if TYPE_CHECKING:
    from ..config import Config
    from ..family import Family


LOSS_DRAWS = 4  # fixed-noise draws per image, averaged; draw 0 equals the loop's validation loss
LOSS_SEED_STRIDE = 104_729  # a prime apart from validation_loss's per-image stride (7919)
MAX_TRAIN_LOSS_IMAGES = 32  # the training-image loss uses at most this many images, evenly spaced


@dataclass
class EvalResult:
    run_dir: Path
    steps: list[int]  # the checkpoints evaluated, in order
    images: dict[int, list[list[Path]]] = field(default_factory=dict)  # step -> [prompt][strength]
    sheets: dict[int, Path] = field(default_factory=dict)  # step -> contact sheet
    losses: dict[int, dict[str, float | None]] = field(default_factory=dict)  # step -> heldout / train
    base_loss: dict[str, float | None] = field(default_factory=dict)
    best_step: int | None = None  # lowest held-out loss over losses.json (None without held-out images)
    plot: Path | None = None
    losses_file: Path | None = None
    record: Path | None = None


# ----------------------------------------------------------------------------------------------
# The run: its configuration and its adapters


def _final_step(run_dir: Path) -> int | None:
    records = [r for r in record.read_records(run_dir, "train") if r.get("adapter")]
    return records[-1].get("steps_done") if records else None


def select_checkpoints(run_dir: Path, which: str | int = "latest",
                       all_checkpoints: bool = False) -> list[tuple[int, Path]]:
    """(update, adapter folder) pairs to evaluate: ``latest``, ``final`` (the run's adapter/), an
    update number, or every kept checkpoint (plus the final adapter if it is not among them)."""
    ckpts = [(s, p / "adapter") for s, p in list_checkpoints(run_dir)]
    final_dir = Path(run_dir) / "adapter"
    final = None
    if final_dir.is_dir() and any(final_dir.iterdir()):
        step = _final_step(run_dir)
        final = (step if step is not None else (ckpts[-1][0] if ckpts else 0), final_dir)
    known = dict(ckpts)
    if final and final[0] not in known:
        known[final[0]] = final[1]
    available = ", ".join(str(s) for s in sorted(known)) or "none"
    if all_checkpoints:
        if not known:
            raise ImgloraError(f"{run_dir}: no checkpoints and no adapter to evaluate")
        return sorted(known.items())
    if which == "final":
        if final is None:
            raise ImgloraError(f"{run_dir}/adapter does not exist (the run was interrupted?); evaluate a "
                               f"checkpoint with --checkpoint STEP (kept: {available}) or latest")
        return [final]
    if which == "latest":
        if not known:
            raise ImgloraError(f"{run_dir}: no checkpoints and no adapter to evaluate")
        step = max(known)
        return [(step, known[step])]
    step = int(which)
    if step not in known:
        raise ImgloraError(f"--checkpoint {step}: no such checkpoint in {run_dir}; kept: {available}")
    return [(step, known[step])]


# ----------------------------------------------------------------------------------------------
# The pass


def eval_config(cfg: "Config", family: "Family") -> "Config":
    """The run's configuration as the evaluation runs it: no gradient checkpointing (no backward),
    eval.fp8 and eval.blocks_to_swap where set (a swap count through the family, which unsets its
    own per-list counts: the one route a swap count takes)."""
    e, changes = cfg.eval, {"gradient_checkpointing": False}
    if e.fp8 != "same":
        changes["fp8"] = e.fp8 == "on"
    if e.blocks_to_swap >= 0 and not supports(family, Swappable):
        changes["blocks_to_swap"] = e.blocks_to_swap  # (the config refuses a count above 0 there)
    cfg = cfg.replace(memory=changes)
    if e.blocks_to_swap >= 0 and supports(family, Swappable):
        cfg = family.with_blocks_to_swap(cfg, e.blocks_to_swap)
    return cfg


def eval_weights(weights: str, cfg: "Config") -> list[str]:
    """The weights to evaluate, in column order: raw, ema, both, or auto (both when the run kept a
    moving average, else raw)."""
    if weights == "auto":
        return ["raw", "ema"] if cfg.train.ema else ["raw"]
    if weights not in ("raw", "ema", "both"):
        raise ImgloraError(f"--weights {weights}: choose raw, ema, both or auto")
    if weights != "raw" and not cfg.train.ema:
        raise ImgloraError(f"--weights {weights}: the run was trained without train.ema, so it has no moving "
                           "average; use --weights raw")
    return ["raw", "ema"] if weights == "both" else [weights]


def evaluate(run_dir: str | Path, *, checkpoint: str | int = "latest", all_checkpoints: bool = False,
             prompts_file: str | Path | None = None, strengths: Sequence[float] | None = None,
             seed: int | None = None, overrides: Sequence[str] = (), weights: str = "auto",
             out: Callable[[str], None] = print) -> EvalResult:
    """Evaluate checkpoints of a trained run; see the module docstring for what is written.
    ``weights``: see :func:`eval_weights` (with two, the sheet has columns for each)."""
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    bad = [o for o in overrides if not o.strip().startswith("eval.")]
    if bad:
        raise ImgloraError(f"--set {bad[0]}: only eval.* keys can be changed for an evaluation; the rest is "
                           "fixed by the trained run")
    cfg = saved_config(run_dir, overrides)
    family = family_of(cfg)
    if not supports(family, Sampler):
        raise ImgloraError(f"the {family.name} family has no evaluation pass yet")
    cfg = eval_config(cfg, family)
    targets = select_checkpoints(run_dir, checkpoint, all_checkpoints)
    strengths = [float(s) for s in (cfg.eval.strengths if strengths is None else strengths)]
    if not strengths:
        raise ImgloraError("no adapter strengths to evaluate; give e.g. --strengths 0,0.5,1")
    seed = cfg.eval.seed if seed is None else seed
    kinds = eval_weights(weights, cfg)
    device = devices.default_device()
    dtype = devices.weight_dtype(cfg, device)  # as in training

    rec = record.RunRecord("eval", run_dir, cfg.to_dict())
    peaks = _PhasePeaks(rec, device)
    result = EvalResult(run_dir, [s for s, _ in targets])
    try:
        _evaluate(cfg, family, run_dir, targets, prompts_file, strengths, seed, device, dtype, rec, peaks,
                  result, out, kinds)
    except BaseException as exc:
        rec.set(error=f"{type(exc).__name__}: {exc}", **peaks.facts(), seconds=round(time.perf_counter() - t_start, 3))
        rec.write(status="failed")
        raise
    rec.set(**peaks.facts(), seconds=round(time.perf_counter() - t_start, 3))
    result.record = rec.write(status="ok")
    out(f"eval record: {result.record} ({telemetry.fmt_duration(time.perf_counter() - t_start)}"
        + (f", peak {telemetry.gib(rec.data['peak_memory']['peak_allocated'])}" if devices.is_cuda(device) else "")
        + f", peak RSS {rec.data['peak_memory']['peak_rss'] / 2**30:.2f} GiB)")
    return result


def _evaluate(cfg: "Config", family: "Family", run_dir: Path, targets: list[tuple[int, Path]],
              prompts_file: str | Path | None, strengths: list[float], seed: int, device: torch.device,
              dtype: torch.dtype, rec: record.RunRecord, peaks: "_PhasePeaks", result: EvalResult,
              out: Callable[[str], None], kinds: list[str]) -> None:
    with peaks.phase("resolve_model"):
        src = resolve_model(cfg.model, family)
        swap = resolve_swap(family, cfg, src)  # eval.blocks_to_swap already in cfg; refused here if it can't be
        loop.check_attention(cfg, device)
    with peaks.phase("cache"):  # held-out images are cached with the training images; usually all reused
        data = family.prepare_data(cfg, src, device)
    held = list(data.validation)
    trained = [s for s in data.samples if not s.regularization]  # the subject's images, not the class's
    stride = max(1, math.ceil(len(trained) / MAX_TRAIN_LOSS_IMAGES))
    train = trained[::stride]
    prompts = _read_prompts(prompts_file) if prompts_file else list(cfg.eval.prompts) or family.default_prompts(cfg)
    out(f"eval: {len(targets)} checkpoint(s) {[s for s, _ in targets]}, {len(prompts)} prompt(s) x strengths "
        f"{', '.join(f'{s:g}' for s in strengths)}, seed {seed}; loss on {len(held)} held-out and "
        f"{len(train)} training image(s)")
    with peaks.phase("encode_prompts"):
        encoded = family.encode_prompts(src, prompts, cfg, device)

    with peaks.phase("load_model"):
        trainable = family.load_trainable(src, cfg, device, dtype, swap)
        model = trainable.model
        _, memory = loop.adapt(trainable, family, cfg, device, swap, out)
        model.eval()
        if memory.swapper is None and not cfg.memory.fp8 and cfg.memory.quantization == "none":
            # torch picks another matmul path (at::matmul folds batch dimensions) when a weight requires
            # grad, which changes the last bits; a model as diffusers loads it has requires_grad=True, so
            # this makes strength 0 equal the base pipeline bit for bit. Everything here runs under no_grad.
            for name, p in model.named_parameters():
                if not lora.is_adapter_parameter(name):
                    p.requires_grad_(True)
        sampler = family.load_sampler(src, model, cfg, device, dtype)
    settings = getattr(sampler, "settings", {})
    hook = model.register_forward_pre_hook(lambda *_: memory.before_forward())  # block swap prefetch
    accelerator = loop.accelerator_for(cfg, trackers.for_run(cfg, run_dir))
    autocast = accelerator.autocast  # the training step's mixed precision
    tracked = trackers.start(accelerator, cfg, "eval")  # run.log_with: into the training's run

    encoders = loop.text_encoders(trainable)  # lora.text_encoder: prompts encoded by the adapted encoders
    tokens = []
    if encoders:
        tokenizers, max_len = family.load_tokenizers(src), text_length(family, cfg, src)
        tokens = [{k: v[None].to(device) for k, v in family.tokenize(tokenizers, p, max_len).items()} for p in prompts]

    def strength(s: float) -> None:
        for module in (model, *encoders.values()):
            lora.set_strength(module, s)

    def prompts_now() -> list[Any]:
        """The prompts' embeddings as the text encoders give them at this adapter and strength (the
        cached-style ones from the frozen encoders without lora.text_encoder)."""
        if not encoders:
            return encoded
        with torch.no_grad(), autocast():
            return [{**e, **{k: v[0] for k, v in trainable.encode_text(t).items()}} for e, t in zip(encoded, tokens)]

    def losses() -> dict[str, float | None]:
        with peaks.phase("loss"):
            return {"heldout": _fixed_noise_loss(trainable, held, family, device, memory, cfg.train.seed, autocast),
                    "train": _fixed_noise_loss(trainable, train, family, device, memory, cfg.train.seed, autocast)}

    base_images: list[Any] | None = None
    # The columns: each weights' strengths (the base model, strength 0, once).
    columns = [(k, s) for n, k in enumerate(kinds) for s in strengths if not (s == 0 and n > 0)]
    bar = Progress(len(targets) * len(prompts) * len(columns), "eval samples")
    try:
        out(f"  scoring the base model's loss on {len(held)} held-out and {len(train)} training image(s)")
        strength(0.0)
        result.base_loss = losses()
        for step, adapter_dir in list(targets):
            folders = {kind: adapter_dir if kind == "raw" else adapter_dir.parent / EMA_DIR for kind in kinds}
            weights = _read_whole(family, trainable, folders)
            if weights is None:  # pruned by the training run since the checkpoints were listed
                out(f"  step {step}: skipped: {adapter_dir} was removed while this evaluation ran (a training run "
                    "keeps only its newest train.keep_checkpoints checkpoints)")
                targets.remove((step, adapter_dir))
                bar.update(len(prompts) * len(columns))
                continue
            grid: list[list[Any]] = [[None] * len(columns) for _ in prompts]
            for kind in kinds:
                for module, state in weights[kind]:
                    lora.load_adapter_state(module, state)
                strength(1.0)
                if kind == kinds[0]:
                    result.losses[step] = losses()
                else:  # the moving average's figures beside the trained weights'
                    result.losses[step][kind] = losses()
                with peaks.phase("generate"):
                    for j, (k, s) in enumerate(columns):
                        if k != kind:
                            continue
                        if s == 0 and base_images is not None:  # the base model: the same for every checkpoint
                            for i in range(len(prompts)):
                                grid[i][j] = base_images[i]
                            bar.update(len(prompts))
                            continue
                        strength(s)
                        for i, e in enumerate(prompts_now()):
                            with memory.kernel():
                                grid[i][j] = sampler(e, seed)
                            bar.update()
                        if s == 0:
                            base_images = [grid[i][j] for i in range(len(prompts))]
            folder = run_dir / "eval" / f"step-{step:06d}"
            lo = result.losses[step]
            kind = "heldout" if lo["heldout"] is not None else "train"
            label = "held-out loss" if kind == "heldout" else "training-image loss"
            title = (f"{run_dir.name} - step {step} - {label} {_fmt(lo[kind])} "
                     f"(base model {_fmt(result.base_loss[kind])})")
            result.images[step], result.sheets[step] = sheets.write_outputs(
                folder, grid, prompts, [s for _, s in columns], title, [k == "ema" for k, _ in columns],
                [e["control_image"] for e in encoded] if encoded and isinstance(encoded[0], dict) and "control_image" in encoded[0] else None)
            out(f"  step {step}: held-out loss {_fmt(lo['heldout'])}, training-image loss {_fmt(lo['train'])}; "
                f"{len(prompts) * len(columns)} samples, sheet {result.sheets[step]}")
            if tracked:
                _track(tracked, step, lo, result.sheets[step])
    finally:
        bar.close()
        hook.remove()
        if tracked:
            tracked.close()
    result.steps = [s for s, _ in targets]
    if not targets:
        raise ImgloraError(f"{run_dir}: every checkpoint chosen was removed while this evaluation ran (pruned by "
                           "training); evaluate the ones kept now, e.g. --checkpoint latest")

    table = _merge_losses(run_dir / "eval" / "losses.json", cfg, data.version, len(held), len(train),
                          result, targets)
    result.losses_file = run_dir / "eval" / "losses.json"
    rows = table["checkpoints"]
    result.best_step = table["best_step"]
    if len(rows) >= 2 or (len(targets) > 1):
        result.plot = run_dir / "eval" / "loss_vs_step.png"
        sheets.plot_losses(rows, table["base"], result.best_step, result.plot, run_dir.name, LOSS_DRAWS)
    if result.best_step is not None:
        best = next(r for r in rows if r["step"] == result.best_step)
        out(f"best checkpoint by held-out loss: update {result.best_step} (held-out {_fmt(best['heldout'])}, "
            f"training-image {_fmt(best['train'])}): {best['adapter']}")
    elif not held:
        out("no held-out images (set eval.holdout or eval.holdout_dir), so no best checkpoint is named: "
            "the training-image loss keeps falling as a LoRA overfits")
    rec.set(model_dir=str(src.root), model_source=src.to_record(), pid=os.getpid(), prompts=prompts, strengths=strengths, seed=seed,
            sampling=settings, memory=memory.facts,
            memory_settings={"fp8": cfg.memory.fp8, "blocks_to_swap": cfg.memory.blocks_to_swap,
                             "swap": memory.facts.get("swap")},
            loss_settings=table["settings"], base_loss=result.base_loss, weights=kinds,
            losses=[{"step": s, **result.losses[s], "adapter": str(a)} for s, a in targets],
            best_step=result.best_step,
            best_checkpoint=next((r["adapter"] for r in rows if r["step"] == result.best_step), None),
            outputs={"sheets": {str(k): str(v) for k, v in result.sheets.items()},
                     "losses": str(result.losses_file), "plot": str(result.plot) if result.plot else None})


def _read_whole(family: "Family", trainable: Any, folders: dict[str, Path]) -> dict[str, list[Any]] | None:
    """Each folder's adapter states (per module: the denoiser, trained text encoders), read into
    memory before any is used, or None when a folder is gone. Training prunes a checkpoint by
    renaming it away first (checkpoint.remove), so a folder that still exists after every read
    was read whole."""
    encoders = loop.text_encoders(trainable)
    try:
        weights = {kind: [(trainable.model, family.read_adapter(folder)),
                          *[(enc, family.read_adapter(folder, part)) for part, enc in encoders.items()]]
                   for kind, folder in folders.items()}
    except FileNotFoundError:
        return None
    return weights if all(folder.is_dir() for folder in folders.values()) else None


def _track(tracked: "trackers.Trackers", step: int, lo: dict[str, Any], sheet: Path) -> None:
    """A checkpoint's losses (and its moving average's) and contact sheet, into the run's trackers."""
    values = {f"eval/{k}_loss": lo[k] for k in ("heldout", "train")}
    values |= {f"eval/{k}_loss_ema": lo["ema"][k] for k in ("heldout", "train") if "ema" in lo}
    tracked.scalars(values, step)
    if sheet.suffix == ".png":
        from PIL import Image

        with Image.open(sheet) as im:
            tracked.images("eval/contact_sheet", [im.convert("RGB")], step)


@torch.no_grad()
def _fixed_noise_loss(trainable: Any, samples: list[Any], family: "Family", device: torch.device, memory: Any,
                      seed: int, autocast: Callable[[], Any]) -> float | None:
    """The family's training loss at fixed noise and noise levels: LOSS_DRAWS generator seeds per
    image, the same for every checkpoint and run; draw 0 is the training loop's validation loss."""
    if not samples:
        return None
    total = sum(loop.validation_loss(trainable, memory, samples, family.collate, device, seed + LOSS_SEED_STRIDE * k,
                                     autocast) for k in range(LOSS_DRAWS))
    return total / LOSS_DRAWS


def _read_prompts(path: str | Path) -> list[str]:
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if line and not line.startswith("#")]
    if not prompts:
        raise ImgloraError(f"{path}: no prompts (one per line; lines starting with # are comments)")
    return prompts


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _merge_losses(path: Path, cfg: "Config", data_version: str, n_held: int, n_train: int, result: EvalResult,
                  targets: list[tuple[int, Path]]) -> dict[str, Any]:
    """Add this invocation's figures to losses.json; figures made with other loss settings (another
    seed, held-out split or data) are not comparable and are replaced."""
    settings = {"draws": LOSS_DRAWS, "seed": cfg.train.seed, "data": data_version, "heldout_images": n_held,
                "train_images": n_train, "holdout": cfg.eval.holdout, "holdout_dir": cfg.eval.holdout_dir}
    try:
        table = json.loads(path.read_text())
        if table.get("settings") != settings:
            table = None
    except (FileNotFoundError, json.JSONDecodeError):
        table = None
    rows = {r["step"]: r for r in (table or {}).get("checkpoints", [])}
    for step, adapter in targets:
        rows[step] = {"step": step, **result.losses[step], "adapter": str(adapter)}
    rows_sorted = [rows[s] for s in sorted(rows)]
    scored = [r for r in rows_sorted if r["heldout"] is not None]
    best = min(scored, key=lambda r: (r["heldout"], r["step"]))["step"] if scored else None
    table = {"settings": settings, "base": result.base_loss, "checkpoints": rows_sorted, "best_step": best}
    atomic.write_json(path, table)
    return table


# ----------------------------------------------------------------------------------------------
# Memory


class _PhasePeaks:
    """Peak device memory per phase (the counters are reset at each phase) and of the whole pass."""

    def __init__(self, rec: record.RunRecord, device: torch.device):
        self.rec, self.device = rec, device
        self.by_phase: dict[str, int | None] = {}
        self.reserved: int | None = None
        telemetry.reset_peaks(device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        telemetry.reset_peaks(self.device)
        with self.rec.phase(name):
            yield
        m = telemetry.memory(self.device)
        if m["peak_allocated"] is not None:
            self.by_phase[name] = max(self.by_phase.get(name) or 0, m["peak_allocated"])
            self.reserved = max(self.reserved or 0, m["peak_reserved"])

    def facts(self) -> dict[str, Any]:
        m = telemetry.memory(self.device)  # rss and peak_rss: this process's, i.e. the evaluation's alone
        peak = max((v for v in self.by_phase.values() if v is not None), default=None)
        return {"peak_memory": {**m, "peak_allocated": peak, "peak_reserved": self.reserved},
                "phase_peak_allocated": self.by_phase or None}


