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
    data_checks(d, where, problems)


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
