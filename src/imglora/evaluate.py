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

import gc
import json
import math
import os
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from . import atomic, config, lora, record, telemetry
from .checkpoint import list_checkpoints
from .errors import ConfigError, ImgloraError
from .families import get_family
from .progress import Progress

if TYPE_CHECKING:
    from PIL import Image

    from .config import Config
    from .families import Family

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


def run_config(run_dir: Path, overrides: Sequence[str] = ()) -> "Config":
    """The resolved configuration the run was trained with (its newest train record), plus
    ``eval.*`` overrides. Other keys are fixed by what was trained."""
    bad = [o for o in overrides if not o.strip().startswith("eval.")]
    if bad:
        raise ImgloraError(f"--set {bad[0]}: only eval.* keys can be changed for an evaluation; the rest is "
                           "fixed by the trained run")
    records = record.read_records(run_dir, "train")
    data = records[-1]["config"] if records else None
    if data is None:  # no record (copied checkpoints only): the newest checkpoint has the config too
        ckpts = list_checkpoints(run_dir)
        if not ckpts:
            raise ImgloraError(f"{run_dir}: not a run folder (no records/*-train.json and no checkpoints/); "
                               "give the folder `imglora train` wrote, e.g. runs/<name>")
        data = json.loads((ckpts[-1][1] / "state.json").read_text())["config"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.toml"
        path.write_text(config.dumps_toml(data))
        try:
            return config.load(path, list(overrides))
        except ConfigError as exc:  # name the run, not the temporary file
            raise ConfigError([p.replace(str(path), "train record") for p in exc.problems], str(run_dir)) from None


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
# What image families share (their eval methods are one-liners over these)


def caption_prompts(cfg: "Config", family: "Family", n: int = 2) -> list[str]:
    """Default prompts: the captions of the first held-out images (else training images), each with
    and without the trigger word, so the rows show what the trigger adds and whether the adapter
    leaks into prompts without it. The trigger is data.trigger_word, or else the first comma-separated
    tag when every caption starts with the same one (kohya-style "sks toy, ..." captions)."""
    from .data import cache

    train, held = cache.split_holdout(cfg, cache.scan(cfg, family))
    captions = list(dict.fromkeys(i.caption for i in (*held.items, *train.items)))
    trigger = cfg.data.trigger_word.strip() or _shared_first_tag([i.caption for i in train.items])
    prompts: list[str] = []
    for caption in captions[:n]:
        prompts.append(caption)
        if trigger:
            without = re.sub(rf"(?<!\w){re.escape(trigger)}(?!\w)\s*,?\s*", "", caption).strip(" ,")
            if without and without != caption:
                prompts.append(without)
    return prompts or ([trigger] if trigger else ["a photo"])


def _shared_first_tag(captions: list[str]) -> str:
    if len(captions) < 2 or not all("," in c for c in captions):
        return ""
    firsts = {c.split(",", 1)[0].strip() for c in captions}
    return firsts.pop() if len(firsts) == 1 else ""


def encode_with_text_encoders(family: "Family", model_dir: Path, prompts: list[str], cfg: "Config",
                              device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Prompt embeddings as the cache computes captions' (same encoders, precision and length),
    then the encoders are freed: they are never in memory together with the denoiser."""
    from .data.cache import resolve_encoder_dtype, torch_dtype

    encoders = family.load_text_encoders(model_dir, device, torch_dtype(resolve_encoder_dtype(
        cfg.cache.encoder_dtype, device)))
    max_len = cfg.cache.text_max_length or family.text_max_length
    out = [family.encode_text(encoders, p, max_len) for p in prompts]
    del encoders
    _free(device)
    return out


def sample_size(cfg: "Config", family: "Family") -> int:
    """The square side of evaluation images: data.resolution, a multiple of the family's bucket step."""
    step = family.bucket_step
    return max(step, cfg.data.resolution // step * step)


def diffusers_sampler(family: "Family", model_dir: Path, model: torch.nn.Module, cfg: "Config",
                      device: torch.device, dtype: torch.dtype, default_guidance: float) -> Callable[..., Any]:
    """A sampler over the family's diffusers pipeline built around the trained (LoRA-injected)
    denoiser, without text encoders: prompts arrive as embeddings (see encode_with_text_encoders)."""
    import diffusers

    diffusers.utils.logging.disable_progress_bar()  # imglora prints its own progress
    vae = family.load_vae(model_dir, device, dtype)
    none = {name: None for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")}
    pipe = getattr(diffusers, family.pipeline).from_pretrained(model_dir, vae=vae, **none,
                                                               **{family.denoiser: model})
    pipe.set_progress_bar_config(disable=True)
    size = sample_size(cfg, family)
    guidance = cfg.eval.guidance_scale or default_guidance
    steps = cfg.eval.sample_steps

    @torch.no_grad()
    def sample(embeds: dict[str, torch.Tensor], seed: int) -> "Image.Image":
        kwargs = {k: embeds[k][None].to(device, model.dtype) for k in ("prompt_embeds", "pooled_prompt_embeds")}
        # A CPU generator: the same image on any device for the same seed (diffusers draws there).
        return pipe(**kwargs, height=size, width=size, num_inference_steps=steps, guidance_scale=guidance,
                    generator=torch.Generator("cpu").manual_seed(seed)).images[0]

    sample.settings = {"size": size, "steps": steps, "guidance": guidance}  # type: ignore[attr-defined]
    return sample


def set_strength(model: torch.nn.Module, strength: float) -> None:
    """Scale every LoRA layer's update by ``strength``; 0 disables the adapter, so each layer runs
    its base layer alone and the output is the base model's exactly."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            m.enable_adapters(strength != 0)
        if isinstance(m, LoraLayer) and strength != 0:
            for name in list(m.scaling):
                m.set_scale(name, strength)


# ----------------------------------------------------------------------------------------------
# The pass


def eval_memory(cfg: "Config", family: "Family") -> dict[str, Any]:
    """memory.* for the evaluation: eval.fp8 / eval.blocks_to_swap where they are set."""
    e, changes = cfg.eval, {"gradient_checkpointing": False}  # no backward here
    if e.fp8 != "same":
        changes["fp8"] = e.fp8 == "on"
    if e.blocks_to_swap >= 0:
        if e.blocks_to_swap and not family.swappable_blocks:
            raise ImgloraError(f"eval.blocks_to_swap = {e.blocks_to_swap}: block swapping is implemented for the "
                               f"flux family only; set it to -1 or 0 for {family.name}")
        changes.update(blocks_to_swap=e.blocks_to_swap, double_blocks_to_swap=-1, single_blocks_to_swap=-1)
    return changes


def evaluate(run_dir: str | Path, *, checkpoint: str | int = "latest", all_checkpoints: bool = False,
             prompts_file: str | Path | None = None, strengths: Sequence[float] | None = None,
             seed: int | None = None, overrides: Sequence[str] = (),
             out: Callable[[str], None] = print) -> EvalResult:
    """Evaluate checkpoints of a trained run; see the module docstring for what is written."""
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    cfg = run_config(run_dir, overrides)
    family = get_family(cfg.model.family)
    if not all(hasattr(family, m) for m in ("default_prompts", "encode_prompts", "load_sampler")):
        raise ImgloraError(f"the {family.name} family has no evaluation pass yet")
    cfg = cfg.replace(memory=eval_memory(cfg, family))
    targets = select_checkpoints(run_dir, checkpoint, all_checkpoints)
    strengths = [float(s) for s in (cfg.eval.strengths if strengths is None else strengths)]
    if not strengths:
        raise ImgloraError("no adapter strengths to evaluate; give e.g. --strengths 0,0.5,1")
    seed = cfg.eval.seed if seed is None else seed
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from .train import weight_dtype

    dtype = weight_dtype(cfg, device)  # as in training

    rec = record.RunRecord("eval", run_dir, cfg.to_dict())
    peaks = _PhasePeaks(rec, device)
    result = EvalResult(run_dir, [s for s, _ in targets])
    try:
        _evaluate(cfg, family, run_dir, targets, prompts_file, strengths, seed, device, dtype, rec, peaks,
                  result, out)
    except BaseException as exc:
        rec.set(error=f"{type(exc).__name__}: {exc}", **peaks.facts(), seconds=round(time.perf_counter() - t_start, 3))
        rec.write(status="failed")
        raise
    rec.set(**peaks.facts(), seconds=round(time.perf_counter() - t_start, 3))
    result.record = rec.write(status="ok")
    out(f"eval record: {result.record} ({telemetry.fmt_duration(time.perf_counter() - t_start)}"
        + (f", peak {telemetry.gib(rec.data['peak_memory']['peak_allocated'])}" if device.type == "cuda" else "")
        + f", peak RSS {rec.data['peak_memory']['peak_rss'] / 2**30:.2f} GiB)")
    return result


def _evaluate(cfg: "Config", family: "Family", run_dir: Path, targets: list[tuple[int, Path]],
              prompts_file: str | Path | None, strengths: list[float], seed: int, device: torch.device,
              dtype: torch.dtype, rec: record.RunRecord, peaks: "_PhasePeaks", result: EvalResult,
              out: Callable[[str], None]) -> None:
    from .train import adapt
    from .models import resolve_model

    with peaks.phase("resolve_model"):
        model_dir = resolve_model(cfg.model.path, cfg.model.family)
    with peaks.phase("cache"):  # held-out images are cached with the training images; usually all reused
        data = family.prepare_data(cfg, model_dir, device)
    held = list(data.validation)
    stride = max(1, math.ceil(len(data.samples) / MAX_TRAIN_LOSS_IMAGES))
    train = list(data.samples)[::stride]
    prompts = _read_prompts(prompts_file) if prompts_file else list(cfg.eval.prompts) or family.default_prompts(cfg)
    out(f"eval: {len(targets)} checkpoint(s) {[s for s, _ in targets]}, {len(prompts)} prompt(s) x strengths "
        f"{', '.join(f'{s:g}' for s in strengths)}, seed {seed}; loss on {len(held)} held-out and "
        f"{len(train)} training image(s)")
    with peaks.phase("encode_prompts"):
        encoded = family.encode_prompts(model_dir, prompts, cfg, device)

    with peaks.phase("load_model"):
        trainable = family.load_trainable(model_dir, cfg, device, dtype)
        model = trainable.model
        _, memory = adapt(trainable, family, cfg, device, out)
        model.eval()
        if memory.swapper is None and not cfg.memory.fp8 and cfg.memory.quantization == "none":
            # torch picks another matmul path (at::matmul folds batch dimensions) when a weight requires
            # grad, which changes the last bits; a model as diffusers loads it has requires_grad=True, so
            # this makes strength 0 equal the base pipeline bit for bit. Everything here runs under no_grad.
            for name, p in model.named_parameters():
                if "lora_" not in name:
                    p.requires_grad_(True)
        sampler = family.load_sampler(model_dir, model, cfg, device, dtype)
    settings = getattr(sampler, "settings", {})
    hook = model.register_forward_pre_hook(lambda *_: memory.before_forward())  # block swap prefetch

    def losses() -> dict[str, float | None]:
        with peaks.phase("loss"):
            return {"heldout": _fixed_noise_loss(trainable, held, family, device, memory, cfg.train.seed),
                    "train": _fixed_noise_loss(trainable, train, family, device, memory, cfg.train.seed)}

    base_images: list[Any] | None = None
    bar = Progress(len(targets) * len(prompts) * len(strengths), "eval samples")
    try:
        out(f"  scoring the base model's loss on {len(held)} held-out and {len(train)} training image(s)")
        set_strength(model, 0.0)
        result.base_loss = losses()
        for step, adapter_dir in targets:
            lora.load_adapter_state(model, family.read_adapter(adapter_dir))
            set_strength(model, 1.0)
            result.losses[step] = losses()
            grid: list[list[Any]] = [[None] * len(strengths) for _ in prompts]
            with peaks.phase("generate"):
                for j, s in enumerate(strengths):
                    if s == 0 and base_images is not None:  # the base model: the same for every checkpoint
                        for i in range(len(prompts)):
                            grid[i][j] = base_images[i]
                        bar.update(len(prompts))
                        continue
                    set_strength(model, s)
                    for i, e in enumerate(encoded):
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
            result.images[step], result.sheets[step] = _write_outputs(folder, grid, prompts, strengths, title)
            out(f"  step {step}: held-out loss {_fmt(lo['heldout'])}, training-image loss {_fmt(lo['train'])}; "
                f"{len(prompts) * len(strengths)} samples, sheet {result.sheets[step]}")
    finally:
        bar.close()
        hook.remove()

    table = _merge_losses(run_dir / "eval" / "losses.json", cfg, data.version, len(held), len(train),
                          result, targets)
    result.losses_file = run_dir / "eval" / "losses.json"
    rows = table["checkpoints"]
    result.best_step = table["best_step"]
    if len(rows) >= 2 or (len(targets) > 1):
        result.plot = run_dir / "eval" / "loss_vs_step.png"
        _plot(rows, table["base"], result.best_step, result.plot, run_dir.name)
    if result.best_step is not None:
        best = next(r for r in rows if r["step"] == result.best_step)
        out(f"best checkpoint by held-out loss: update {result.best_step} (held-out {_fmt(best['heldout'])}, "
            f"training-image {_fmt(best['train'])}): {best['adapter']}")
    elif not held:
        out("no held-out images (set eval.holdout or eval.holdout_dir), so no best checkpoint is named: "
            "the training-image loss keeps falling as a LoRA overfits")
    rec.set(model_dir=str(model_dir), pid=os.getpid(), prompts=prompts, strengths=strengths, seed=seed,
            sampling=settings, memory=memory.facts,
            memory_settings={k: getattr(cfg.memory, k) for k in ("fp8", "blocks_to_swap", "double_blocks_to_swap",
                                                                   "single_blocks_to_swap")},
            loss_settings=table["settings"], base_loss=result.base_loss,
            losses=[{"step": s, **result.losses[s], "adapter": str(a)} for s, a in targets],
            best_step=result.best_step,
            best_checkpoint=next((r["adapter"] for r in rows if r["step"] == result.best_step), None),
            outputs={"sheets": {str(k): str(v) for k, v in result.sheets.items()},
                     "losses": str(result.losses_file), "plot": str(result.plot) if result.plot else None})


@torch.no_grad()
def _fixed_noise_loss(trainable: Any, samples: list[Any], family: "Family", device: torch.device, memory: Any,
                      seed: int) -> float | None:
    """The family's training loss at fixed noise and noise levels: LOSS_DRAWS generator seeds per
    image, the same for every checkpoint and run; draw 0 is the training loop's validation loss."""
    if not samples:
        return None
    from .train import validation_loss

    total = sum(validation_loss(trainable, samples, family.collate, device, memory, seed + LOSS_SEED_STRIDE * k)
                for k in range(LOSS_DRAWS))
    return total / LOSS_DRAWS


def _read_prompts(path: str | Path) -> list[str]:
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if line and not line.startswith("#")]
    if not prompts:
        raise ImgloraError(f"{path}: no prompts (one per line; lines starting with # are comments)")
    return prompts


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def strength_label(s: float) -> str:
    return f"{s:g}"


# ----------------------------------------------------------------------------------------------
# Outputs


def _write_outputs(folder: Path, grid: list[list[Any]], prompts: list[str], strengths: list[float],
                   title: str) -> tuple[list[list[Path]], Path]:
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("p*_s*.*"):  # an earlier evaluation's, maybe with other prompts or strengths
        stale.unlink()
    paths: list[list[Path]] = []
    if isinstance(grid[0][0], str):  # a text family: answers instead of images
        for i, row in enumerate(grid):
            paths.append([])
            for s, answer in zip(strengths, row):
                path = folder / f"p{i}_s{strength_label(s)}.txt"
                atomic.write_text(path, answer)
                paths[-1].append(path)
        sheet = folder / "answers.md"
        lines = [f"# {title}", ""]
        for prompt, row in zip(prompts, grid):
            lines += [f"## {prompt}", ""] + [f"**{'base model' if s == 0 else f'adapter, strength {strength_label(s)}'}**"
                                             f"\n\n{a}\n" for s, a in zip(strengths, row)]
        atomic.write_text(sheet, "\n".join(lines))
        return paths, sheet
    for i, row in enumerate(grid):
        paths.append([])
        for s, image in zip(strengths, row):
            path = folder / f"p{i}_s{strength_label(s)}.png"
            with atomic.atomic_path(path, suffix=".png") as tmp:
                image.save(tmp, format="PNG")
            paths[-1].append(path)
    sheet = folder / "contact_sheet.png"
    with atomic.atomic_path(sheet, suffix=".png") as tmp:
        contact_sheet(grid, prompts, strengths, title).save(tmp, format="PNG")
    return paths, sheet


def contact_sheet(grid: list[list["Image.Image"]], prompts: list[str], strengths: list[float],
                  title: str = "") -> "Image.Image":
    """Rows are prompts (labelled with the prompt text), columns adapter strengths (0 = the base model)."""
    from PIL import Image, ImageDraw

    side = max(im.width for row in grid for im in row)
    cell = max(192, min(512, side))  # tiny images are enlarged (pixelated) so labels fit, huge ones shrunk
    fs = max(12, cell // 14)
    font = _font(fs)
    pad = max(4, fs // 2)
    label_w = cell
    head_h = pad + 2 * (fs + pad)
    width = label_w + len(strengths) * (cell + pad) + pad
    height = head_h + len(prompts) * (cell + pad) + pad
    sheet = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((pad, pad), title, fill="black", font=font)
    for j, s in enumerate(strengths):
        label = "strength 0 (base)" if s == 0 else f"strength {strength_label(s)}"
        draw.text((label_w + j * (cell + pad), pad + fs + pad), label, fill="black", font=font)
    max_lines = max(1, cell // (fs + 3))
    for i, prompt in enumerate(prompts):
        y = head_h + i * (cell + pad)
        lines = _wrap(draw, prompt, font, label_w - 2 * pad, max_lines)
        draw.multiline_text((pad, y), "\n".join(lines), fill="black", font=font, spacing=3)
        for j, image in enumerate(grid[i]):
            image = image.convert("RGB")
            resample = Image.NEAREST if image.width <= cell else Image.LANCZOS
            fitted = image.resize((cell, max(1, round(image.height * cell / image.width))), resample)
            sheet.paste(fitted, (label_w + j * (cell + pad), y))
    return sheet


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the small bitmap font only
        return ImageFont.load_default()


def _wrap(draw: Any, text: str, font: Any, width: int, max_lines: int) -> list[str]:
    lines: list[str] = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}", font=font) <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1].rstrip(" ,.") + "..."
    return lines


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


def _plot(rows: list[dict[str, Any]], base: dict[str, Any], best: int | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if any(r["heldout"] is not None for r in rows):
        ax.plot(steps, [r["heldout"] for r in rows], "o-", lw=2, color="C1", label="held-out loss")
        if base.get("heldout") is not None:
            ax.axhline(base["heldout"], ls=":", color="C1", alpha=0.7, label="held-out, base model")
    ax.plot(steps, [r["train"] for r in rows], "s--", lw=1.5, color="C0", label="training-image loss")
    if base.get("train") is not None:
        ax.axhline(base["train"], ls=":", color="C0", alpha=0.7, label="training images, base model")
    if best is not None:
        value = next(r["heldout"] for r in rows if r["step"] == best)
        ax.plot([best], [value], "*", ms=16, color="C3", label=f"best: update {best}")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer update (checkpoint)")
    ax.set_ylabel(f"loss (fixed noise, mean of {LOSS_DRAWS} draws)")
    ax.set_title(f"{title}: loss against step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic.atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


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


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# train.eval_after


def run_subprocess(run_dir: Path, out: Callable[[str], None] = print) -> int:
    """``imglora eval RUN_DIR`` in a fresh process, after the caller has dropped its model: the
    evaluation's memory peak never stacks on training's. Returns the exit code."""
    import subprocess

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out(f"train.eval_after: running `imglora eval {run_dir}` in a fresh process")
    code = subprocess.run([sys.executable, "-m", "imglora.cli", "eval", str(run_dir)], check=False).returncode
    if code:
        out(f"evaluation failed (exit code {code}); the adapter is saved; retry with `imglora eval {run_dir}`")
    return code
