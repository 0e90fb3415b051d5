"""Checks across fields that hold for every family (each family adds its own through the catalog).

Each problem names the key where it can be fixed (``where(dotted)`` adds the file or ``--set``) and
says what to do; the loader reports them all at once.
"""

from __future__ import annotations

from typing import Callable

from .schema import Config, DataConfig

Where = Callable[[str], str]


def cross_checks(cfg: Config, where: Where, problems: list[str]) -> None:
    t, m, d = cfg.train, cfg.memory, cfg.data
    if t.max_steps == 0 and t.epochs == 0:
        problems.append(f"{where('train.max_steps')}: set train.max_steps or train.epochs to a positive number")
    if m.fp8 and m.quantization != "none":
        problems.append(f"{where('memory.fp8')}: memory.fp8 = true and memory.quantization = "
                        f"\"{m.quantization}\" both quantize the frozen base; choose one (set memory.fp8 = false "
                        "for 4-bit QLoRA, or memory.quantization = \"none\" for fp8)")
    if d.min_bucket_side > d.max_bucket_side:
        problems.append(f"{where('data.min_bucket_side')}: {d.min_bucket_side} is larger than "
                        f"data.max_bucket_side = {d.max_bucket_side}")
    if t.budget.max_cost and not t.budget.hourly_rate:
        problems.append(f"{where('train.budget.max_cost')}: set train.budget.hourly_rate too, or the cost "
                        "cannot be projected")
    if t.warmup_steps and t.max_steps and t.warmup_steps > t.max_steps:
        problems.append(f"{where('train.warmup_steps')}: {t.warmup_steps} warmup steps exceed "
                        f"train.max_steps = {t.max_steps}")
    _adapter_checks(cfg, where, problems)
    from .. import optimizers

    optimizers.check(cfg, where, problems)
    if t.ema and optimizers.is_schedule_free(t.optimizer):
        problems.append(f"{where('train.ema')}: a schedule-free optimizer already averages its iterates (its eval "
                        "weights are what is saved); train.ema on top is not supported")
    data_checks(d, where, problems)


def _adapter_checks(cfg: Config, where: Where, problems: list[str]) -> None:
    """Each [lora] key belongs to some adapter types; one set for another type is an error, not ignored."""
    lo, kind = cfg.lora, cfg.lora.type
    only = {"dropout": ("lora", "dora"), "rank_dropout": ("loha", "lokr"), "module_dropout": ("loha", "lokr"),
            "effective_conv2d": ("loha", "lokr"), "factor": ("lokr",), "decompose_both": ("lokr",)}
    unset = {"dropout": 0.0, "rank_dropout": 0.0, "module_dropout": 0.0, "effective_conv2d": False, "factor": -1,
             "decompose_both": False}
    for key, kinds in only.items():
        if kind not in kinds and getattr(lo, key) != unset[key]:
            hint = {"dropout": " (LoHa/LoKr: lora.rank_dropout, lora.module_dropout)",
                    "rank_dropout": " (LoRA/DoRA: lora.dropout)", "module_dropout": " (LoRA/DoRA: lora.dropout)"}
            problems.append(f"{where(f'lora.{key}')}: applies to lora.type = {' or '.join(map(repr, kinds))} only, "
                            f"and lora.type = {kind!r}{hint.get(key, '')}")
    if lo.factor == 0:
        problems.append(f"{where('lora.factor')}: must be -1 (automatic) or a positive divisor, got 0")



def set_key(data: DataConfig, index: int, key: str) -> str:
    """The dotted key of a per-set setting: ``data.sets[1].key``, or ``data.key`` for the one set."""
    return f"data.sets[{index}].{key}" if data.sets else f"data.{key}"


def data_checks(d: DataConfig, where: Where, problems: list[str]) -> None:
    """Each set on its own, then the sets together."""
    for i, s in enumerate(d.all_sets):
        def at(key: str) -> str:
            return where(set_key(d, i, key))

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
