"""Checks across fields that hold for every family (each family adds its own through the catalog).

Each problem names the key where it can be fixed (``where(dotted)`` adds the file or ``--set``) and
says what to do; the loader reports them all at once. Settings that are valid but do nothing as set
are ``notes`` instead (the loader adds them to ``cfg.notes``, which the commands print).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from . import offer as offers
from .schema import BudgetConfig, Config, DataConfig

Where = Callable[[str], str]


def cross_checks(cfg: Config, where: Where, problems: list[str]) -> None:
    t, m, d = cfg.train, cfg.memory, cfg.data
    if t.max_steps == 0 and t.epochs == 0:
        problems.append(f"{where('train.max_steps')}: set train.max_steps or train.epochs to a positive number")
    if m.fp8 and m.quantization != "none":
        problems.append(f"{where('memory.fp8')}: memory.fp8 = true and memory.quantization = "
                        f"\"{m.quantization}\" both quantize the frozen base; choose one (set memory.fp8 = false "
                        "for 4-bit QLoRA, or memory.quantization = \"none\" for fp8)")
    for key in ("fp8_compute", "fp8_fused"):
        if getattr(m, key) and not m.fp8:
            problems.append(f"{where('memory.' + key)}: runs the matmuls of fp8-stored weights, and memory.fp8 = "
                            f"false stores none; set memory.fp8 = true, or memory.{key} = false")
    if d.min_bucket_side > d.max_bucket_side:
        problems.append(f"{where('data.min_bucket_side')}: {d.min_bucket_side} is larger than "
                        f"data.max_bucket_side = {d.max_bucket_side}")
    if t.budget.max_cost and not t.budget.hourly_rate and not cfg.run.offer:
        problems.append(f"{where('train.budget.max_cost')}: set train.budget.hourly_rate (or run.offer) too, or the "
                        "cost cannot be projected")
    if t.warmup_steps and t.max_steps and t.warmup_steps > t.max_steps:
        problems.append(f"{where('train.warmup_steps')}: {t.warmup_steps} warmup steps exceed "
                        f"train.max_steps = {t.max_steps}")
    _adapter_checks(cfg, where, problems)
    _preservation_checks(cfg, where, problems)
    from . import optimizer_names as optimizers

    optimizers.check(cfg, where, problems)
    if t.ema and optimizers.is_schedule_free(t.optimizer):
        problems.append(f"{where('train.ema')}: a schedule-free optimizer already averages its iterates (its eval "
                        "weights are what is saved); train.ema on top is not supported")
    if m.offload_checkpoints and not m.gradient_checkpointing:
        # An error, not a note: the memory it promises would not be saved, and a run sized for it may not fit.
        problems.append(f"{where('memory.offload_checkpoints')}: moves what gradient checkpointing keeps to host "
                        "memory, and memory.gradient_checkpointing = false keeps nothing, so it would save no "
                        "memory; set memory.gradient_checkpointing = true, or memory.offload_checkpoints = false")
    _budget_checks(cfg, where, problems)
    _offer_checks(cfg, where, problems)
    data_checks(d, where, problems)
    holdout_checks(cfg, where, problems)
    _name_checks(cfg, where, problems)


def _preservation_checks(cfg: Config, where: Where, problems: list[str]) -> None:
    """train.dop_weight needs a class word and a trigger word to replace; neither kind of preservation
    works with text encoders trained in the step (their outputs for the other caption are not cached)."""
    t = cfg.train
    if t.dop_weight:
        if not t.dop_class.strip():
            problems.append(f"{where('train.dop_class')}: train.dop_weight = {t.dop_weight:g} needs the class word "
                            "that replaces the trigger word (e.g. \"person\")")
        if not any(s.trigger_word for s in cfg.data.all_sets if not s.regularization):
            problems.append(f"{where('train.dop_weight')}: differential output preservation replaces the trigger word "
                            "by train.dop_class, and no data set has a trigger_word; set data.trigger_word")
    elif t.dop_class:
        problems.append(f"{where('train.dop_class')}: is read only with train.dop_weight > 0; set both, or neither")
    if (t.dop_weight or t.blank_preservation_weight) and cfg.lora.text_encoder:
        key = "train.dop_weight" if t.dop_weight else "train.blank_preservation_weight"
        problems.append(f"{where(key)}: output preservation denoises other captions with cached text-encoder "
                        "outputs, and lora.text_encoder trains the text encoders; turn one of them off")


def _offer_checks(cfg: Config, where: Where, problems: list[str]) -> None:
    if not cfg.run.offer:
        return
    try:
        _, rate, _ = offers.parse_offer(cfg.run.offer)
    except ValueError as exc:
        problems.append(f"{where('run.offer')}: {exc}")
        return
    hourly = cfg.train.budget.hourly_rate
    if hourly and hourly != rate:
        problems.append(f"{where('run.offer')}: its rate {rate:g} differs from train.budget.hourly_rate = {hourly:g}; "
                        "give the rate once (remove train.budget.hourly_rate: the offer's rate is the budget's)")


def _budget_checks(cfg: Config, where: Where, problems: list[str]) -> None:
    """A budget limit is checked once, when the session is projected: a run that ends first is never
    checked. That is an error (the guard asked for would not act), not a note."""
    t, b = cfg.train, cfg.train.budget
    limits = [k for k in ("max_cost", "max_hours") if getattr(b, k)]
    at = offers.projection_update(b.smoke_steps, t.log_every)
    if not limits or not t.max_steps or at < t.max_steps:
        return
    fits = (t.max_steps - 1) // t.log_every * t.log_every - offers.WARMUP_UPDATES  # largest smoke_steps that fits
    fix = (f"lower train.budget.smoke_steps to at most {fits}" if fits >= 1 else
           "raise train.max_steps or lower train.log_every, or drop the budget for so short a run")
    problems.append(f"{where(f'train.budget.{limits[0]}')}: the budget guard checks it once, when it projects the "
                    f"session at update {at} ({offers.WARMUP_UPDATES} warm-up + train.budget.smoke_steps = "
                    f"{b.smoke_steps} measured updates, at a log: train.log_every = {t.log_every}), but "
                    f"train.max_steps = {t.max_steps} ends the run first, so it would never act; {fix}")


def notes(cfg: Config, where: Where) -> list[str]:
    """Settings that are valid but do nothing, or undo the training, as set: said to the user (as
    ``cfg.notes``), not refused, since each can be meant (a machine's base preset, an experiment)."""
    t, m, out = cfg.train, cfg.memory, []
    if m.ema_on_cpu and not t.ema:
        out.append(f"{where('memory.ema_on_cpu')}: does nothing without train.ema = true (there is no moving "
                   "average to keep in host memory)")
    b = t.budget
    at = offers.projection_update(b.smoke_steps, t.log_every)
    if t.max_steps and at >= t.max_steps and b.smoke_steps != BudgetConfig().smoke_steps:  # a limit: an error
        out.append(f"{where('train.budget.smoke_steps')}: {b.smoke_steps} measured updates (after "
                   f"{offers.WARMUP_UPDATES} warm-up ones) end at update {at}, and train.max_steps = "
                   f"{t.max_steps}: this run is never projected (no session time or cost is printed)")
    for i, s in enumerate(cfg.data.all_sets):
        if s.caption_dropout == 1.0:
            trigger = f" and the trigger word {s.trigger_word!r}" if s.trigger_word else ""
            out.append(f"{where(set_key(cfg.data, i, 'caption_dropout'))}: 1.0 trains every step on the empty "
                       f"caption, so the captions{trigger} are never learned; a small rate such as 0.05 keeps "
                       "the adapter working without its prompt")
    return out


# A name that stays in its folder and that ComfyUI lists on every OS: no folders, nothing Windows refuses.
_NOT_IN_A_NAME = re.compile(r'[<>:"/\\|?*\x00-\x1f]')
PLAIN_NAME_RULE = 'use a plain file name without folders or any of <>:"/\\|?*'


def is_plain_name(name: str) -> bool:
    """Whether ``name`` is one plain file name: not empty, no folder part (``..``, ``/``, ``\\``), not
    hidden, nothing Windows refuses. ``export --name``, ``export.name`` and ``run.name`` share it."""
    return bool(name) and not name.startswith(".") and not _NOT_IN_A_NAME.search(name)



_EXTENSION = re.compile(r"\.?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


def extension_problem(value: str) -> str | None:
    """Why ``value`` is not a file extension (``.txt``, ``txt``, ``.cap.txt``), or None. It is joined
    to each image's name, so a folder part (``/../x``), a dot alone or an empty one would write or read
    elsewhere, or fail deep inside pathlib."""
    if _EXTENSION.fullmatch(value) and len(value) <= 32:
        return None
    return (f"{value!r} is not a file extension: give letters, digits, '_' or '-' after a dot, such as \".txt\" or "
            "\".caption\" (no folder part, at most 32 characters)")

def export_stem(name: str) -> str:
    """An export name as written, without spaces around it or the ``.safetensors`` it may end in."""
    name = name.strip()
    return name[: -len(".safetensors")] if name.endswith(".safetensors") else name


def _name_checks(cfg: Config, where: Where, problems: list[str]) -> None:
    """run.name is a folder under run.output_dir and export.name a file in the export folder: a name
    with a folder part (``../../x``) would write outside them."""
    if not is_plain_name(cfg.run.name):
        problems.append(f"{where('run.name')}: {cfg.run.name!r} is not a plain name: {PLAIN_NAME_RULE} (the run "
                        "folder is run.output_dir/run.name; choose the parent folder with run.output_dir)")
    if cfg.export.name and not is_plain_name(export_stem(cfg.export.name)):
        problems.append(f"{where('export.name')}: {cfg.export.name!r} is not a plain name: {PLAIN_NAME_RULE} (choose "
                        "the folder with export.comfyui_dir or `imglora export --out`)")


def _adapter_checks(cfg: Config, where: Where, problems: list[str]) -> None:
    """The [lora] checks every adapter type shares; which key belongs to which type, and each type's
    own rules, are the adapter types' (``imglora.adapters``, through the catalog's ``check``)."""
    if cfg.lora.factor == 0:
        problems.append(f"{where('lora.factor')}: must be -1 (automatic) or a positive divisor, got 0")


def set_key(data: DataConfig, index: int, key: str) -> str:
    """The dotted key of a per-set setting: ``data.sets[1].key``, or ``data.key`` for the one set."""
    return f"data.sets[{index}].{key}" if data.sets else f"data.{key}"


def bucket_checks(d: DataConfig, step: int, family: str, where: Where, problems: list[str]) -> None:
    """Bucket sides the model cannot take (e.g. an odd FLUX latent): ``step`` is the family's bucket
    step, the multiple every side of its images must be. The config checks it (the family's check
    passes its step) and so does the data scan, before any encoder runs."""
    side = d.bucket_step or step
    if side % step:
        near = max(step, round(side / step) * step)
        problems.append(f"{where('data.bucket_step')}: {side} must be a multiple of {step} for the {family} "
                        f"family (e.g. {near}, or 0 for the family's {step})")
        side = step
    for i, s in enumerate(d.all_sets):
        if not d.buckets and s.resolution % side:
            problems.append(f"{where(set_key(d, i, 'resolution'))}: {s.resolution} must be a multiple of {side} "
                            "with data.buckets = false")


def holdout_checks(cfg: Config, where: Where, problems: list[str]) -> None:
    """eval.holdout_dir's images are never trained on, so it cannot lie inside a set's folder (whose
    scan would train on them). Paths only: the folders need not exist yet."""
    if not cfg.eval.holdout_dir:
        return
    held = Path(cfg.eval.holdout_dir).resolve()
    for i, s in enumerate(cfg.data.all_sets):
        if s.dir and (held == Path(s.dir).resolve() or Path(s.dir).resolve() in held.parents):
            key = set_key(cfg.data, i, "dir")
            problems.append(f"{where('eval.holdout_dir')}: {cfg.eval.holdout_dir!r} is inside {key} = {s.dir!r}; "
                            f"move the held-out images to a folder of their own, next to {key}")


def data_checks(d: DataConfig, where: Where, problems: list[str]) -> None:
    """Each set on its own, then the sets together."""
    for i, s in enumerate(d.all_sets):
        def at(key: str) -> str:
            return where(set_key(d, i, key))

        why = extension_problem(s.caption_ext)
        if why:
            problems.append(f"{at('caption_ext')}: {why}")
        if d.bucket_step > s.resolution:
            problems.append(f"{where('data.bucket_step')}: {d.bucket_step} is larger than "
                            f"{set_key(d, i, 'resolution')} = {s.resolution}")
        if s.mask_dir and s.alpha_mask:
            problems.append(f"{at('mask_dir')}: a set takes its loss masks from mask_dir or from the images' alpha "
                            "channel (alpha_mask = true), not both; choose one")
        if s.class_caption and not s.regularization:
            problems.append(f"{at('class_caption')}: only a regularization set (regularization = true) uses a class "
                            "caption; for a training set use default_caption with missing_caption = \"default\"")
    if all(s.regularization for s in d.all_sets):
        key = "data.sets" if d.sets else "data.regularization"
        problems.append(f"{where(key)}: every set is a regularization set, so there is nothing to train on; add a "
                        "set of training images (regularization = false)")
