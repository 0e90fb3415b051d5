"""One optimizer update, the same for training, ``bench-swap`` and the evaluation pass's loss.

``Session`` holds what an update needs (the model with LoRA and its memory features, the optimizer,
the schedule, mixed precision through accelerate); ``build_session`` makes it the same way wherever
it is used, and ``step`` runs one update: the family's loss on each micro-batch, backward, clipping,
the optimizer and the schedule. A step does the model's math and nothing else: no file I/O, and one
``.item()`` (a host-device sync): the gradient norm, read to skip an update whose gradients are not
finite before the optimizer writes them into the weights.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from ..util import devices, distributed
from ..adapters import inject as lora
from . import optimizers
from .ema import Ema, swapped
from ..memory.fp8 import to_device
from ..memory.wrap import MemorySetup, apply_memory

if TYPE_CHECKING:
    from ..config import Config
    from ..memory.swap import SwapLayout
    from ..family import Family, Trainable


@dataclass
class Session:
    accelerator: Any
    trainable: "Trainable"
    memory: MemorySetup
    lora_config: Any
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any | None
    accum: int
    max_grad_norm: float
    ema: Ema | None = None  # train.ema: the moving average of ``params``
    modes: bool = False  # the optimizer has train/eval modes (schedule-free): see eval_weights
    stage: str = "setup"  # what ``step`` is doing: "forward", "backward", "optimizer" (for failure reports)
    grad_norm: torch.Tensor | None = None  # the last update's gradient norm (before clipping), on the device
    on_stage: Callable[[str], None] | None = None  # told each stage as ``step`` enters it (bench's profile)
    direct: bool = False  # clip and step without accelerate's wrappers (see ``steps_directly``)
    names: list[str] | None = None  # the name of each of ``params`` (a skipped update names the first bad one)
    skipped: bool = False  # the last update was skipped: a gradient was NaN or infinite (see ``step``)
    bad_gradient: str | None = None  # then: the first parameter whose gradient was not finite
    update_loss: torch.Tensor | None = None  # the last update's loss (on the device; counted or not)

    def enter(self, stage: str) -> None:
        self.stage = stage
        if self.on_stage is not None:
            self.on_stage(stage)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.trainable.model)


def accelerator_for(cfg: "Config", trackers: list[Any] | None = None) -> Any:
    """accelerate's Accelerator with the preset's mixed precision (bf16 on CUDA, none on the CPU) and
    the experiment trackers given (``trackers.for_run``).

    Launched as several processes (``accelerate launch``, ``imglora train --gpus N``) it joins their
    process group -- gloo between CPU processes, which needs ``cpu=True`` -- with
    ``train.process_timeout`` as the collectives' timeout: a process that died makes the others
    fail after that long instead of waiting forever."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    device = devices.default_device()
    kwargs = [InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.train.process_timeout))]
    return Accelerator(mixed_precision=devices.mixed_precision(cfg, device), cpu=device.type == "cpu",
                       kwargs_handlers=kwargs, log_with=trackers or None)


def adapt(trainable: "Trainable", family: "Family", cfg: "Config", device: torch.device, swap: "SwapLayout",
          out: Callable[[str], None] = print) -> tuple[Any, MemorySetup]:
    """LoRA on the loaded model, then its memory features (``swap``: the layout it was loaded with);
    the same for training, bench and eval.

    Returns the peft config and the memory setup (its ``before_forward`` runs before each forward).
    """
    lora_config = lora.inject(trainable.model, family, cfg.lora, cfg.train.seed)
    encoders = text_encoders(trainable)
    if encoders:  # lora.text_encoder: the same adapter on them; they stay in their dtype, on the device
        trainable.text_configs = lora.inject_text_encoders(encoders, family, cfg.lora, cfg.train.seed)
        for encoder in encoders.values():
            to_device(encoder, device)
    for module in (trainable.model, *encoders.values()):
        for p in lora.trainable_parameters(module):
            p.data = p.data.float()  # LoRA weights and their optimizer state train in fp32
    return lora_config, apply_memory(trainable.model, family, cfg, device, swap, out)  # fp8, swap, device


def check_attention(cfg: "Config", device: torch.device) -> None:
    """Refuse a memory.attention_kernel that cannot run on ``device`` in the run's compute dtype (before
    any model is loaded, where the caller can)."""
    from ..memory import attention

    attention.check(cfg.memory.attention_kernel, device,
                    attention.compute_dtype(devices.weight_dtype(cfg, device), devices.mixed_precision(cfg, device)))


def text_encoders(trainable: "Trainable") -> dict[str, torch.nn.Module]:
    """The text encoders trained with the denoiser (lora.text_encoder), by component; {} without."""
    return getattr(trainable, "text_encoders", None) or {}


def text_adapters(trainable: "Trainable") -> dict[str, tuple[torch.nn.Module, Any]]:
    """{component: (text encoder, its peft config)}, for Family.save_adapter."""
    return {part: (encoder, trainable.text_configs[part]) for part, encoder in text_encoders(trainable).items()}


def load_adapter(model: torch.nn.Module, trainable: "Trainable", family: "Family", folder: Any) -> None:
    """A saved adapter's weights into ``model`` (the denoiser) and the text encoders trained with it."""
    lora.load_adapter_state(model, family.read_adapter(folder))
    for part, encoder in text_encoders(trainable).items():
        lora.load_adapter_state(encoder, family.read_adapter(folder, part))


def build_session(cfg: "Config", family: "Family", trainable: "Trainable", accelerator: Any, *, swap: "SwapLayout",
                  total: int | None, out: Callable[[str], None] = print) -> Session:
    """LoRA, memory features (``swap``: the layout the model was loaded with), optimizer and (with
    ``total`` updates) the learning-rate schedule."""
    lora_config, memory = adapt(trainable, family, cfg, accelerator.device, swap, out)
    encoders = text_encoders(trainable)
    if accelerator.mixed_precision in ("bf16", "fp16"):  # every forward of a session runs under autocast
        for module in (trainable.model, *encoders.values()):
            lora.keep_input_dtype(module)
        if cfg.memory.norms_in_model_dtype:
            from ..memory import norms

            memory.facts["norms_in_model_dtype"] = norms.install(trainable.model)
    trainable.model.train()
    params = lora.trainable_parameters(trainable.model)
    plus = cfg.lora.loraplus_lr_ratio  # LoRA+: the B matrices in groups of their own
    per_block = lora.block_multipliers(trainable.model, family, cfg.lora)  # lora.block_lr: groups per multiplier
    groups: list[Any] = params if not (plus or per_block) else lora.parameter_groups(
        trainable.model, cfg.train.learning_rate, plus, per_block)
    if encoders:  # their adapter in a parameter group of its own, at train.text_encoder_lr
        for encoder in encoders.values():
            encoder.train()
        text_params = [p for e in encoders.values() for p in lora.trainable_parameters(e)]
        text_lr = cfg.train.text_encoder_lr or cfg.train.learning_rate
        groups = [{"params": params}, {"params": text_params, "lr": text_lr}] if not (plus or per_block) else [
            *lora.parameter_groups(trainable.model, cfg.train.learning_rate, plus, per_block),
            *(g for e in encoders.values() for g in lora.parameter_groups(e, text_lr, plus))]
        params = params + text_params
    optimizer = make_optimizer(cfg, groups)
    modes = optimizers.has_modes(optimizer)
    scheduler = make_scheduler(cfg, optimizer, total) if total is not None else None
    ema = None
    if cfg.train.ema:
        ema = Ema(params, cfg.train.ema_decay, "cpu" if cfg.memory.ema_on_cpu else None)
    if accelerator.num_processes > 1:
        # Not wrapped in DDP: the processes sum their LoRA gradients in ``step`` (see distributed),
        # and the model keeps its own attributes (apply_memory already placed it).
        optimizer = accelerator.prepare(optimizer)
    else:
        # The swap engine places the model's tensors itself; accelerate must not move them again.
        trainable.model, optimizer = accelerator.prepare(trainable.model, optimizer,
                                                         device_placement=[memory.swapper is None, True])
    return Session(accelerator, trainable, memory, lora_config, params, optimizer, scheduler, cfg.train.grad_accum,
                   cfg.train.max_grad_norm, ema, modes,
                   direct=steps_directly(accelerator) and _takes_set_to_none(optimizer),
                   names=parameter_names(params, {"": trainable.model, **encoders}))


def parameter_names(params: list[torch.nn.Parameter], modules: dict[str, torch.nn.Module]) -> list[str]:
    """Each parameter's name in its module (``text_encoder:`` before a text encoder's)."""
    names = {id(p): f"{part}:{n}" if part else n for part, m in modules.items() for n, p in m.named_parameters()}
    return [names.get(id(p), f"parameter {i}") for i, p in enumerate(params)]


def _takes_set_to_none(optimizer: Any) -> bool:
    """Whether the optimizer's ``zero_grad`` takes ``set_to_none`` (torch's all do; a user's own
    class may not: accelerate's wrapper then calls it without, and so does the session)."""
    import inspect

    inner = getattr(optimizer, "optimizer", optimizer)
    return "set_to_none" in inspect.signature(inner.zero_grad).parameters


def steps_directly(accelerator: Any) -> bool:
    """One process and no loss scaler (fp32 or bf16; fp16 has one): accelerate's clipping and
    optimizer wrappers would only call ``clip_grad_norm_`` and the optimizer's own ``step``, after
    per-update checks of their own (an importlib lookup for LOMO in every ``step``, a signature
    inspection in every ``zero_grad``, DTensor checks). ``step`` then calls torch directly: the same
    math, less host time per update (``benchmarks/overhead.py``)."""
    from accelerate.utils import DistributedType

    return (accelerator.num_processes == 1 and accelerator.scaler is None
            and accelerator.distributed_type == DistributedType.NO)


def forward_loss(trainable: "Trainable", memory: MemorySetup, batch: dict[str, torch.Tensor], generator: Any,
                 autocast: Callable[[], Any] = contextlib.nullcontext) -> torch.Tensor:
    """The family's loss on one micro-batch (block swapping's prefetch started first). ``generator``:
    one ``imglora.util.rng.SampleRNG`` (a generator per sample), or a ``torch.Generator``."""
    memory.before_forward()
    with autocast(), memory.kernel():
        return trainable.loss(batch, generator)


@dataclass
class Micro:
    """One micro-batch of an update, as this process sees it."""

    batch: dict[str, torch.Tensor] | None  # None: this process has no sample of this micro-batch
    rng: Any  # its samples' random draws (imglora.util.rng.SampleRNG) or a torch.Generator
    scale: float = 1.0  # this process's share of the micro-batch's loss (1 with one process)


def step(s: Session, micros: Iterable[Micro], loss_sum: torch.Tensor) -> None:
    """One optimizer update over ``micros`` (gradient accumulation); adds the update's loss to
    ``loss_sum``, a device tensor. With several processes the
    gradients are summed over them before the optimizer step (each loss carries its share).

    An update whose gradient norm is not finite is skipped (``s.skipped``; the first bad parameter in
    ``s.bad_gradient``): no optimizer step, no schedule step, its loss not added to ``loss_sum``."""
    update_loss = torch.zeros((), device=loss_sum.device)
    for m in micros:
        if m.batch is None:
            continue
        s.enter("forward")
        loss = forward_loss(s.trainable, s.memory, m.batch, m.rng, s.accelerator.autocast) / s.accum
        if m.scale != 1.0:
            loss = loss * m.scale
        s.enter("backward")
        with s.memory.kernel():  # the kernel forward_loss used: checkpointing recomputes the forward here
            s.accelerator.backward(loss)
        update_loss += loss.detach()
    s.enter("optimizer")
    if s.accelerator.num_processes > 1:
        distributed.sum_gradients(s.params)
    if s.accelerator.scaler is not None:  # fp16: the norm and the check read the unscaled gradients
        s.accelerator.unscale_gradients()
    inner = s.optimizer.optimizer if s.direct else s.optimizer  # (accelerate's AcceleratedOptimizer holds it)
    s.grad_norm = torch.nn.utils.get_total_norm([p.grad for p in s.params if p.grad is not None])
    # .item() is a host-device sync, the one of a step: a NaN or Inf gradient must never reach the
    # weights (one bad element makes every adapter weight NaN through the optimizer), and whether to
    # step is the host's decision. It waits for the backward, which the optimizer's step would anyway.
    s.skipped = not math.isfinite(s.grad_norm.item())
    if s.skipped:
        s.bad_gradient = first_non_finite(s)
        if s.accelerator.scaler is not None:
            s.optimizer.step()  # fp16's loss scaler skips the step itself and lowers its scale (or it never would)
    else:
        s.bad_gradient = None
        loss_sum += update_loss
        if s.max_grad_norm:  # (clip_grad_norm_'s own two halves; without clipping nothing is multiplied)
            torch.nn.utils.clip_grads_with_norm_(s.params, s.max_grad_norm, s.grad_norm)
        inner.step()
        if s.scheduler is not None:
            s.scheduler.step()
    s.update_loss = update_loss
    inner.zero_grad(set_to_none=True)
    s.enter("done")


def first_non_finite(s: Session) -> str | None:
    """The name of the first trainable parameter (in the model's order) whose gradient holds a NaN or
    Inf; read only when an update is skipped."""
    for i, p in enumerate(s.params):
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return s.names[i] if s.names else f"parameter {i}"
    return None


def simple_micros(batches: Iterable[dict[str, torch.Tensor]], generator: Any) -> list[Micro]:
    """Micro-batches for one process with one random stream (benchmarks and tests)."""
    return [Micro(b, generator) for b in batches]


@contextlib.contextmanager
def eval_weights(s: Session) -> Iterator[None]:
    """The weights to save or evaluate, in the model for the duration. Schedule-free optimizers step
    weights that are not the ones to use: their eval mode puts the averaged weights in; afterwards
    the weights they step are put back bit for bit (a train/eval round trip is not exact, and
    checkpoints and validation must not change the run). Other optimizers: the weights as they are."""
    if not s.modes:
        yield
        return
    with swapped(s.params, [p.detach().clone() for p in s.params]):  # put back the stepped weights after
        s.optimizer.eval()
        try:
            yield
        finally:
            s.optimizer.train()


def ema_weights(s: Session) -> contextlib.AbstractContextManager[None]:
    """train.ema's moving average in the model for the duration; the trained weights are put back after."""
    assert s.ema is not None
    return swapped(s.params, s.ema.shadow)


@torch.no_grad()
def validation_loss(trainable: "Trainable", memory: MemorySetup, samples: list[Any], collate: Callable,
                    device: torch.device, seed: int, autocast: Callable[[], Any] = contextlib.nullcontext) -> float:
    """Mean loss over held-out samples with fixed noise per sample: comparable across updates and runs."""
    from ..util.rng import SampleRNG

    modules = [trainable.model, *text_encoders(trainable).values()]
    was_training = [m.training for m in modules]
    for m in modules:
        m.eval()  # no dropout
    total = 0.0
    for i, sample in enumerate(samples):
        batch = {k: v.to(device) for k, v in collate([sample.variants[0]]).items()}
        total += float(forward_loss(trainable, memory, batch, SampleRNG([seed + 7919 * i], device), autocast))
    for m, mode in zip(modules, was_training):
        m.train(mode)
    return total / len(samples)


def step_seed(seed: int, step: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) % (2**63 - 1)


def make_optimizer(cfg: "Config", params: list[Any]) -> torch.optim.Optimizer:
    """``train.optimizer`` by name with ``train.optimizer_args`` (see :mod:`imglora.training.optimizers`)."""
    return optimizers.make(cfg, params)


def make_scheduler(cfg: "Config", optimizer: torch.optim.Optimizer, total: int) -> Any:
    """diffusers' learning-rate schedules (as kohya sd-scripts uses them), by ``train.scheduler``;
    "constant" with warmup steps is diffusers' "constant_with_warmup"."""
    from diffusers.optimization import get_scheduler

    t = cfg.train
    name = "constant_with_warmup" if t.scheduler == "constant" and t.warmup_steps else t.scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=total,
                         num_cycles=t.scheduler_cycles, power=t.scheduler_power)


def total_updates(cfg: "Config", micro_per_epoch: int) -> int:
    if cfg.train.max_steps:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.epochs * micro_per_epoch / cfg.train.grad_accum))


def measured_peak(session: Any, batch: dict[str, torch.Tensor], updates: int = 3) -> int:
    """What the plan predicts, measured: the peak tensor bytes of ``updates`` real training updates
    on the CPU (the first creates the optimizer state; later ones hold it throughout) -- what exists
    when the meter starts (weights, swap buffers, LoRA, optimizer state, the batch) plus the peak
    of what it sees made and freed. For the tests and ``benchmarks/plan_check.py``."""
    from ..plan.meter import LiveBytes, held_bytes  # (the plan's own meter: what it predicts, measured)

    buffers: list[torch.Tensor] = []
    if session.memory.swapper is not None:
        for pool in session.memory.swapper._pools:
            buffers += list(pool.hosts) + [s.buf for s in pool.slots]
    loss_sum = torch.zeros(())
    peak = 0
    for i in range(updates):
        base = held_bytes(session.model, *text_encoders(session.trainable).values(), session.optimizer,
                          list(batch.values()), buffers, loss_sum)
        with LiveBytes() as meter:
            step(session, simple_micros([batch], torch.Generator().manual_seed(i)), loss_sum)
        peak = max(peak, base + meter.peak)
    return peak
