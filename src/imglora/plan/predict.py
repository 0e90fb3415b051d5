"""``imglora plan``: peak device memory and host RAM of a training run, predicted term by term
before anything is loaded.

Weights, LoRA, gradients and optimizer state are counted from the architecture built on the meta
device (exact tensor sizes; fp8 layers as quanto stores them; swapped blocks and the swap slots as
the swap engine lays them out). Activations are not estimated by a formula: the family's own loss,
forward and backward run on the meta device with every tensor counted as it is created and freed
(``memory.meta_run``, ``memory.meter``), so gradient checkpointing, attention, LoRA and the loss are
the code that will run. The prediction is of *allocated tensor bytes*; the tests check it within
10 % of the bytes a real step allocates on the CPU, and ``benchmarks/gpu_check.sh`` puts it next to
the measured CUDA peak.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..adapters import inject as lora
from .agreement import FP8_SETTINGS
from ..errors import ImgloraError
from ..memory.fp8 import would_quantize
from .meta_run import Autocast
from .meter import LiveBytes, held_bytes
from ..memory.swap_storage import ALIGN
from ..family import option

if TYPE_CHECKING:
    from ..config import Config
    from ..family import Family
    from ..memory.swap import SwapLayout
    from ..models.source import ModelSource

GiB = 2**30
CUDA_CONTEXT = int(0.5 * GiB)  # CUDA context and kernels: outside the allocator, assumed for "fits"
# Host memory a CUDA process holds beyond what `plan` measures of itself (it does not initialise
# CUDA): the runtime, cuBLAS/cuBLASLt, cuDNN and NCCL loaded, the context's host side and kernel
# images. A desk estimate (2.5 GiB), not yet measured on a GPU box: gpu_check records host RSS.
CUDA_HOST_ESTIMATE = int(2.5 * GiB)
ALLOCATOR_MARGIN = 1.05  # reserved / allocated: the caching allocator's rounding and fragmentation


@dataclass(frozen=True)
class Setting:
    precision: str  # "fp8", "fp8f", "fp8c" (FP8_SETTINGS), a dtype name ("bf16", "fp16", "fp32"), or "model"
    blocks: int  # kohya-style blocks_to_swap
    # The blocks per list a preset swaps where its family's own keys set them directly (FLUX's
    # double_blocks_to_swap / single_blocks_to_swap): then these are swapped, not ``blocks``' split.
    counts: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        return f"{self.precision}:{'+'.join(map(str, self.counts))}" if self.counts is not None else \
            f"{self.precision}:{self.blocks}"


@dataclass(frozen=True)
class Term:
    key: str
    label: str
    bytes: int
    where: str  # "device" or "host"


@dataclass
class SettingPlan:
    setting: Setting
    terms: list[Term]
    device_peak: int
    host_peak: int
    peak_phase: str  # "backward" or "optimizer step": where the device peak falls
    measured_seconds: float | None = None  # from a bench.json, when given
    predicted: Any = None  # plan_time.Estimate: seconds per update on the plan's device
    time_note: str = ""  # why there is no prediction

    def term(self, key: str) -> int:
        return sum(t.bytes for t in self.terms if t.key == key)

    def fits(self, vram: int | None, host_ram: int | None, device_kind: str) -> bool:
        if vram is not None and device_kind == "cuda" and needed_vram(self.device_peak) > vram:
            return False
        return host_ram is None or self.host_peak <= host_ram

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting.name, "precision": self.setting.precision,
                "blocks_to_swap": self.setting.blocks,
                **({"blocks_per_list": list(self.setting.counts)} if self.setting.counts is not None else {}),
                "device_peak_bytes": self.device_peak,
                "host_peak_bytes": self.host_peak, "peak_phase": self.peak_phase,
                "terms": {t.key: t.bytes for t in self.terms},
                "term_labels": {t.key: t.label for t in self.terms},
                "term_where": {t.key: t.where for t in self.terms},
                "measured_seconds_per_update": self.measured_seconds,
                "predicted_seconds_per_update": self.predicted.seconds if self.predicted else None,
                "predicted_parts": self.predicted.parts if self.predicted else None, "time_note": self.time_note or None}


def precision_of(cfg: "Config") -> str:
    """The plan and bench setting name of ``cfg``'s own precision (fp8, fp8f, fp8c or model)."""
    m = cfg.memory
    return ("fp8c" if m.fp8_compute else "fp8f" if m.fp8_fused else "fp8") if m.fp8 else "model"


def own_setting(cfg: "Config", family: Any, swap: "SwapLayout") -> Setting:
    """The preset's own setting, with ``swap`` (the layout its run resolves): where the preset sets
    the blocks per list itself, the setting carries those counts (kohya's count alone names another
    layout)."""
    from ..memory.wrap import resolve_swap

    s = Setting(precision_of(cfg), cfg.memory.blocks_to_swap)
    if not swap.lists:
        return s
    kohya = resolve_swap(family, family.with_blocks_to_swap(cfg, s.blocks), lengths=list(swap.lengths))
    return s if kohya == swap else Setting(s.precision, s.blocks, swap.counts)


def needed_vram(device_peak: int) -> int:
    """What a card must have for a run whose allocated peak is ``device_peak``."""
    return int(device_peak * ALLOCATOR_MARGIN) + CUDA_CONTEXT


@dataclass
class Plan:
    family: str
    device_kind: str
    resolution: int
    tokens_note: str
    settings: list[SettingPlan]
    notes: list[str] = field(default_factory=list)
    fastest_fit: str | None = None
    time_device: Any = None  # plan_time.Device the seconds are predicted for

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "device": self.device_kind, "resolution": self.resolution,
                "time_device": self.time_device.name if self.time_device else None,
                "settings": [s.to_dict() for s in self.settings], "fastest_fit": self.fastest_fit,
                "notes": self.notes, "cuda_context_bytes": CUDA_CONTEXT, "allocator_margin": ALLOCATOR_MARGIN}


# ----------------------------------------------------------------------------------------------
# Activations: one micro-batch's forward and backward on the meta device


@dataclass(frozen=True)
class Profile:
    """What the meta run measured, and the model facts the weight terms need."""

    saved: int  # live after the forward: what backward needs (checkpoint boundaries, the loss)
    peak: int  # the run's peak (recompute + backward working set on top of ``saved``, grads so far)
    grads: int  # LoRA gradients at the end of backward
    checkpoint_inputs: list[int]  # bytes of each checkpointed block's large inputs (what offloading moves)
    batch: int  # the micro-batch's tensors
    lora_params: list[tuple[str, int, tuple[int, ...]]]  # (name, numel, shape) of the trainable tensors
    model: torch.nn.Module  # the meta model with LoRA (for the weight terms)
    dtype: torch.dtype
    text_encoders: int = 0  # frozen bytes of the text encoders trained with the adapter (lora.text_encoder)
    tally: Any = None  # the step's kernels (memory.op_count.OpTally), for the time prediction


def profile(family: Any, src: "ModelSource | None", cfg: "Config", dtype: torch.dtype,
            autocast: torch.dtype | None, resolution: int, count_ops: bool = True) -> Profile:
    """The meta run; ``count_ops`` also records its kernels (for the time prediction)."""
    from ..adapters import preservation

    trainable = preservation.wrap(family.meta_trainable(src, cfg, dtype), cfg)  # its extra forwards counted too
    model = trainable.model
    lora.inject(model, family, cfg.lora, cfg.train.seed)
    encoders = getattr(trainable, "text_encoders", None) or {}  # lora.text_encoder: trained beside the model
    if encoders:
        lora.inject_text_encoders(encoders, family, cfg.lora, cfg.train.seed)
    for module in (model, *encoders.values()):
        for p in lora.trainable_parameters(module):
            p.data = p.data.float()  # as loop.adapt: LoRA trains in fp32
    if autocast is not None:
        for module in (model, *encoders.values()):
            lora.keep_input_dtype(module)  # as loop.build_session under autocast
        if cfg.memory.norms_in_model_dtype:
            from ..memory import norms

            norms.install(model)
    model.train()
    batch = preservation.synthetic(family.synthetic_batch(trainable, resolution, cfg, torch.device("meta")), cfg)
    batch_bytes = held_bytes(list(batch.values()))
    from ..family import Swappable, supports
    from .op_count import OpCounter

    containers = list(family.swappable_blocks) if supports(family, Swappable) else []
    counter = OpCounter(model, containers, recompute_tags=cfg.memory.gradient_checkpointing) if count_ops else None
    with Autocast(autocast) as ac, LiveBytes() as meter, counter or contextlib.nullcontext():
        loss = trainable.loss(batch, torch.Generator().manual_seed(0))
        ac.end_forward()
        meter.mark("forward")
        loss.backward()
        del loss
    modules = {"": model, **{f"{part}.": e for part, e in encoders.items()}}
    params = [(prefix + n, p.numel(), tuple(p.shape)) for prefix, m in modules.items()
              for n, p in m.named_parameters() if p.requires_grad]
    grads = sum(p.grad.numel() * p.grad.element_size() for m in modules.values() for p in m.parameters()
                if p.grad is not None)
    for m in modules.values():
        for p in m.parameters():
            p.grad = None
    return Profile(saved=meter.marks["forward"], peak=meter.peak, grads=grads, batch=batch_bytes,
                   lora_params=params, model=model, dtype=dtype, checkpoint_inputs=list(ac.checkpoint_inputs),
                   text_encoders=sum(frozen_bytes(e, set()) for e in encoders.values()), tally=counter.tally if counter else None)


# ----------------------------------------------------------------------------------------------
# Weights: where each frozen tensor lives, in what layout


def frozen_bytes(module: torch.nn.Module, quantized: set[str], prefix: str = "", pad: bool = False) -> int:
    """Bytes of ``module``'s frozen parameters and buffers, fp8 layers as quanto stores them
    (1-byte data + one scale per row + input/output scale scalars). ``pad``: each tensor rounded up
    as the swap engine lays it out in a slot or host buffer."""
    def size(n: int) -> int:
        return -(-n // ALIGN) * ALIGN if pad else n

    total = 0
    for name, mod in module.named_modules():
        full = prefix + name
        for pname, p in mod.named_parameters(recurse=False):
            if p.requires_grad:
                continue
            eb = p.element_size()
            if pname == "weight" and full in quantized:
                total += size(p.numel()) + size(p.shape[0] * eb) + 2 * size(eb)
            else:
                total += size(p.numel() * eb)
        for b in mod.buffers(recurse=False):
            total += size(b.numel() * b.element_size())
    return total


def optimizer_bytes(cfg: "Config", params: list[tuple[str, int, tuple[int, ...]]], cuda: bool) -> tuple[int, int, str]:
    """(state bytes, step temporaries, what was assumed) for the preset's optimizer over ``params``."""
    n = sum(k for _, k, _ in params)
    largest = max((k for _, k, _ in params), default=0)
    name = cfg.train.optimizer
    if name == "adamw":
        # exp_avg + exp_avg_sq in fp32; on CUDA the foreach path makes one param-sized temporary
        # (the sqrt of exp_avg_sq), on the CPU the per-tensor path one tensor at a time.
        return 8 * n, (4 * n if cuda else 8 * largest), "AdamW: 2 fp32 states"
    if name in ("adamw8bit", "paged_adamw8bit", "lion8bit"):
        # bitsandbytes: 1-byte states with an fp32 absmax per 256 values for tensors of >= 4096
        # values, fp32 states below that; AdamW two states, Lion one.
        k_states = 1 if name == "lion8bit" else 2
        state = sum(k_states * (k + 4 * math.ceil(k / 256)) if k >= 4096 else 4 * k_states * k for _, k, _ in params)
        return state, 8 * largest, f"{name} (bitsandbytes): {k_states} 8-bit state{'s' * (k_states > 1)}"
    if name == "adafactor":
        # factored second moment (a row and a column vector) for matrices, no first moment.
        state = sum(4 * (s[0] + math.prod(s[1:])) if len(s) >= 2 else 4 * k for _, k, s in params)
        return state, 8 * largest, "Adafactor: factored second moment, no momentum"
    if name == "prodigy":  # exp_avg, exp_avg_sq, and its step-size estimate's s and p0 (slice_p 1)
        return 16 * n, 4 * n, "Prodigy: 4 fp32 states"
    if name == "schedulefree_adamw":  # z and exp_avg_sq
        return 8 * n, 4 * n, "schedule-free AdamW: 2 fp32 states"
    return 8 * n, 4 * n, f"{name}: assumed like AdamW (2 fp32 states)"


# ----------------------------------------------------------------------------------------------
# The plan


def predict(cfg: "Config", family: "Family", settings: list[Setting], *, device_kind: str,
            src: "ModelSource | None", resolution: int | None = None, vram: int | None = None,
            host_ram: int | None = None, bench: dict[str, Any] | None = None,
            process_rss: int = 0, profiles: dict[Any, Profile] | None = None, processes: int = 1,
            time_device: Any = None) -> Plan:
    """The plan for each of ``settings`` on a ``device_kind`` ("cuda" or "cpu") machine; seconds per
    update predicted on ``time_device`` (a ``plan_time.Device``) when given."""
    from ..util import devices
    from ..family import supports
    from ..memory.wrap import resolve_swap

    from ..family import Benchable, Plannable, Swappable

    if not (supports(family, Plannable) and supports(family, Benchable)):
        raise ImgloraError(f"imglora plan does not know the {family.name} family's architecture yet")
    resolution = resolution or cfg.data.max_resolution
    cuda = device_kind == "cuda"
    # a process that has not initialised CUDA has not measured its libraries' host memory
    cuda_host = CUDA_HOST_ESTIMATE if cuda and not torch.cuda.is_initialized() else 0
    mp = cfg.train.mixed_precision
    autocast_on = cuda and mp != "no"
    plans: list[SettingPlan] = []
    profiles = {} if profiles is None else profiles  # meta runs, reusable across calls with the same key
    notes: list[str] = []
    for s in settings:
        if s.precision in (*FP8_SETTINGS, "model"):
            dtype = devices.DTYPES[cfg.model.dtype] if cuda else torch.float32
        else:
            dtype = devices.DTYPES[s.precision]
        autocast = (torch.float16 if mp == "fp16" else torch.bfloat16) if autocast_on else None
        key = (dtype, autocast, resolution, repr(cfg.lora), cfg.train.batch_size, cfg.cache.text_max_length,
               cfg.memory.gradient_checkpointing, cfg.memory.norms_in_model_dtype, repr(cfg.family),
               time_device is not None)
        if key not in profiles:
            profiles[key] = profile(family, src, cfg, dtype, autocast, resolution, count_ops=time_device is not None)
        prof = profiles[key]
        model = prof.model
        quantized = set(would_quantize(model, family.quantize_exclude)) if s.precision in FP8_SETTINGS else set()

        swap_cfg = family.with_blocks_to_swap(cfg, s.blocks) if supports(family, Swappable) and s.counts is None \
            else cfg  # (a setting with its own counts is the preset's: cfg swaps exactly those)
        layout = resolve_swap(family, swap_cfg, model=model)
        if s.counts is not None and layout.counts != s.counts:
            raise RuntimeError(f"{s.name}: the preset swaps {layout.counts} blocks per list on this model")
        plan_ = layout.masks()
        if s.blocks and not plan_:
            raise ImgloraError(f"the {family.name} family has no swappable blocks; use 0 blocks")
        resident = swapped = 0
        per_block: dict[str, int] = {}  # swapped block -> the bytes it brings over the link
        pools: dict[Any, list[int]] = {}
        in_blocks = 0
        for name, mask in plan_:
            for i, (blk, sw) in enumerate(zip(model.get_submodule(name), mask)):
                prefix = f"{name}.{i}."
                plain = frozen_bytes(blk, quantized, prefix)
                in_blocks += plain
                if sw:
                    padded = frozen_bytes(blk, quantized, prefix, pad=True)
                    swapped += padded
                    per_block[f"{name}.{i}"] = padded
                    sig = tuple((k, tuple(v.shape), v.dtype) for k, v in blk.state_dict().items())
                    pools.setdefault(sig, []).append(padded)
                else:
                    resident += plain
        slots_per_shape = max(1, cfg.memory.swap_prefetch) + 1
        slots = sum(min(slots_per_shape, len(sizes)) * max(sizes) for sizes in pools.values())
        non_block = frozen_bytes(model, quantized) - in_blocks
        lora_bytes = 4 * sum(k for _, k, _ in prof.lora_params)
        ema_device = lora_bytes if cfg.train.ema and not (cuda and cfg.memory.ema_on_cpu) else 0
        state, temps, opt_note = optimizer_bytes(cfg, prof.lora_params, cuda)
        state += ema_device
        dequant = 0
        if quantized:
            # quanto's matmul (CPU, and CUDA for fp8 weights) makes the weight in the compute dtype,
            # then that times its scales: two copies of the largest layer for a moment; the fused
            # path (memory.fp8_fused) makes one; so does fp8 compute where a shape falls back to it
            # (FLUX's modulation layers, the largest, see one row per sample), and its fp8 kernels
            # need less (the weight laid out column-major in fp8, one byte per weight)
            dequant = (2 if s.precision == "fp8" else 1) * \
                max(model.get_submodule(n).weight.numel() for n in quantized) * (torch.finfo(prof.dtype).bits // 8)
        act_extra = prof.peak - prof.saved
        offloaded = offloaded_pinned = 0
        if cuda and cfg.memory.offload_checkpoints and cfg.memory.gradient_checkpointing and prof.checkpoint_inputs:
            # the boundaries go to host buffers of exactly their size (memory/offload.py); in backward
            # one block's come back for its recompute while the next block's are coming in
            offloaded = offloaded_pinned = sum(prof.checkpoint_inputs)
            act_extra += 2 * max(prof.checkpoint_inputs)
        saved = prof.saved - offloaded
        dev = "device" if cuda else "host"
        terms = [
            Term("weights_resident_blocks", "blocks kept on the device",
                 resident, dev),
            Term("swap_slots", f"swap slots ({slots_per_shape} per block shape"
                 + ("; auto prefetch adds more only where the card has room" if cuda and slots and
                    cfg.memory.swap_prefetch == 0 else "") + ")", slots, dev),
            Term("weights_non_block", "weights outside the blocks", non_block, dev),
            Term("text_encoders", "text encoders trained with the adapter (lora.text_encoder), frozen weights",
                 prof.text_encoders, dev),
            Term("lora", f"{cfg.lora.type} adapter weights (fp32)" + (", text encoders' included" if prof.text_encoders
                                                                       else ""), lora_bytes, dev),
            Term("optimizer_state", opt_note + (", + the adapter's moving average (train.ema)" if ema_device else ""),
                 state, dev),
            Term("batch", "the micro-batch (latents, embeddings)", prof.batch, dev),
            Term("activations_saved", "activations kept for backward (checkpoint boundaries)", saved, dev),
            Term("activations_working", "recompute + backward working set, and gradients so far", act_extra, dev),
            Term("fp8_dequant", "the largest fp8 weight dequantized for its matmul (fp8: 2 copies at once; fp8f, "
                 "and fp8c where a shape falls back: 1)", dequant, dev),
        ]
        if not cuda:
            terms.append(Term("swapped_blocks", "swapped blocks' host copies (no GPU: the same memory)", swapped,
                              "host"))
        static = resident + slots + non_block + prof.text_encoders + lora_bytes + state + prof.batch + \
            (0 if cuda else swapped)
        backward = static + saved + act_extra + dequant
        step = static + prof.grads + temps
        terms.append(Term("optimizer_step", "optimizer step: gradients + temporaries (if it is the peak)",
                          max(0, step - backward), dev))
        device_peak = max(backward, step)
        phase = "backward" if backward >= step else "optimizer step"
        if cuda:
            load_block = max((frozen_bytes(b, set()) for n, _ in plan_ for b in model.get_submodule(n)), default=0)
            streams = bool(option(family, "streams_blocks"))
            setup_note = ("the transformer read block by block (one block in its load dtype at a time)" if streams
                          else "the model read whole in its load dtype before it is quantized and placed")
            setup = load_block + swapped if streams else frozen_bytes(model, set())
            per = f" (x {processes} processes)" if processes > 1 else ""
            terms += [Term("host_swapped", f"swapped blocks in pinned host memory{per}", swapped * processes, "host"),
                      Term("host_checkpoints", f"checkpoint boundaries in page-locked host memory (registered, "
                           f"exactly their size){per}", offloaded_pinned * processes, "host"),
                      Term("host_setup", f"set-up peak on top: {setup_note}{per}",
                           max(0, setup - swapped - offloaded_pinned) * processes, "host"),
                      Term("host_process", f"this process (Python, torch, libraries; measured now){per}",
                           process_rss * processes, "host"),
                      Term("host_cuda", f"CUDA runtime and libraries in host memory (an estimate, not yet measured)"
                           f"{per}", cuda_host * processes, "host")]
            # each data-parallel process holds its own swapped blocks and boundaries, and reads its
            # own copy of the model at set-up
            host_peak = processes * (process_rss + cuda_host + max(setup, swapped + offloaded_pinned))
        else:
            host_peak = device_peak + process_rss
        sp = SettingPlan(s, terms, device_peak, host_peak, phase)
        if time_device is not None:
            _predict_time(sp, prof, time_device, cfg, quantized, per_block, prof.checkpoint_inputs if offloaded else [])
        plans.append(sp)
    _bench_times(plans, bench)
    plan = Plan(family.name, device_kind, resolution, "", plans, notes, time_device=time_device)
    plan.fastest_fit = fastest_fit(plans, vram, host_ram, device_kind)
    return plan


def _predict_time(sp: SettingPlan, prof: Profile, dev: Any, cfg: "Config", quantized: set[str],
                  swapped: dict[str, int], boundaries: list[int]) -> None:
    from . import timing as plan_time

    if sp.setting.precision == "fp8c" and not dev.has_fp8:
        sp.time_note = f"the {dev.name} has no fp8 tensor cores (compute capability 8.9 and newer)"
        return
    if prof.tally is None:
        return
    key = "optimizer_ops" if dev.asynchronous else "optimizer_ops_cpu"
    opt = prof.__dict__.get(key)
    if opt is None:
        opt = plan_time.optimizer_ops(prof.lora_params, cuda=dev.asynchronous, clip=bool(cfg.train.max_grad_norm))
        object.__setattr__(prof, key, opt)  # (the Profile is frozen; this is a cache)
    v = plan_time.Variant(frozenset(quantized), sp.setting.precision == "fp8c", swapped, tuple(boundaries),
                          max(1, cfg.memory.swap_prefetch), fused=sp.setting.precision == "fp8f")
    sp.predicted = plan_time.estimate(prof.tally, v, dev, opt)


def _dt(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def _bench_times(plans: list[SettingPlan], bench: dict[str, Any] | None) -> None:
    if not bench:
        return
    for r in bench.get("results", []):
        for p in plans:
            if r.get("setting") == p.setting.name and r.get("status") == "ok":
                p.measured_seconds = r["sec_per_update"]["median"]


def speed_rank(p: SettingPlan) -> tuple:
    """Faster first: measured seconds when known, then predicted seconds; without either, full
    precision before fp8 (dequantizing costs time), then fewer swapped blocks."""
    if p.measured_seconds is not None:
        return (0, p.measured_seconds)
    if p.predicted is not None:
        return (1, p.predicted.seconds)
    return (2, p.setting.precision in FP8_SETTINGS, p.setting.blocks)


def fastest_fit(plans: list[SettingPlan], vram: int | None, host_ram: int | None, device_kind: str) -> str | None:
    fitting = [p for p in plans if p.fits(vram, host_ram, device_kind)]
    if not fitting:
        return None
    return min(fitting, key=speed_rank).setting.name


# ----------------------------------------------------------------------------------------------
# Text


def fmt(n: int) -> str:
    return f"{n / GiB:.2f}"


def table(plan: Plan, vram: int | None = None, host_ram: int | None = None) -> str:
    """Terms as rows, settings as columns (GiB)."""
    names = [p.setting.name for p in plan.settings]
    keys: list[tuple[str, str, str]] = []
    for p in plan.settings:
        for t in p.terms:
            if (t.key, t.label, t.where) not in keys and not any(k[0] == t.key for k in keys):
                keys.append((t.key, t.label, t.where))
    where_label = "device" if plan.device_kind == "cuda" else "memory"
    lines = [f"| {where_label} (GiB) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key, label, where in keys:
        if where != "device" and plan.device_kind == "cuda":
            continue
        lines.append(f"| {label} | " + " | ".join(fmt(p.term(key)) for p in plan.settings) + " |")
    lines.append("| **peak allocated** | " + " | ".join(f"**{fmt(p.device_peak)}**" for p in plan.settings) + " |")
    if plan.device_kind == "cuda":
        lines.append("| card needed (×1.05 allocator margin + 0.5 GiB CUDA context) | " +
                     " | ".join(fmt(needed_vram(p.device_peak)) for p in plan.settings) + " |")
        lines += ["", "| host RAM (GiB) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for key, label, where in keys:
            if where == "host":
                lines.append(f"| {label} | " + " | ".join(fmt(p.term(key)) for p in plan.settings) + " |")
        lines.append("| **peak host RAM** | " + " | ".join(f"**{fmt(p.host_peak)}**" for p in plan.settings) + " |")
    if plan.time_device is not None:
        lines.append(f"| predicted s/update ({plan.time_device.name}) | " + " | ".join(
            f"{p.predicted.seconds:.3f}" if p.predicted else "-" for p in plan.settings) + " |")
    if any(p.measured_seconds is not None for p in plan.settings):
        lines.append("| measured s/update (bench.json) | " + " | ".join(
            f"{p.measured_seconds:.3f}" if p.measured_seconds is not None else "-" for p in plan.settings) + " |")
    if vram or host_ram:
        lines.append("| fits | " + " | ".join("yes" if p.fits(vram, host_ram, plan.device_kind) else "no"
                                              for p in plan.settings) + " |")
    return "\n".join(lines)


def one_line(p: SettingPlan, device_kind: str) -> str:
    """For ``imglora train``'s start: the preset's own setting, in a line."""
    if device_kind != "cuda":
        return f"memory plan: about {fmt(p.device_peak)} GiB of tensors at the peak ({p.peak_phase}) on the CPU"
    w = p.term("weights_resident_blocks") + p.term("swap_slots") + p.term("weights_non_block")
    a = p.term("activations_saved") + p.term("activations_working")
    t = p.term("lora") + p.term("optimizer_state")
    return (f"memory plan: peak allocated {fmt(p.device_peak)} GiB at the {p.peak_phase} (weights {fmt(w)}, "
            f"activations {fmt(a)}, LoRA + optimizer {fmt(t)}); card needed {fmt(needed_vram(p.device_peak))} GiB; "
            f"host RAM {fmt(p.host_peak)} GiB")
