"""Out-of-memory failures explained by the stage they happen in.

Which stage ran out decides the fix: a model that does not fit while loading needs fp8 or more
swapped blocks; a first forward or backward that does not fit needs less activation memory; an
optimizer step needs smaller state; a failure many updates in points at a larger bucket or a
fragmented allocator. ``imglora train`` tracks its stage (:class:`Stages`), and an out-of-memory
error -- CUDA's, or the host's -- becomes one :class:`OutOfMemory` message with the stage, the
plan's prediction for it, the peak measured so far and the changes to make. The run record keeps
it; nothing is written over a checkpoint.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from ..errors import ImgloraError

GiB = 2**30

# stage -> (what it needs memory for, changes for a GPU out-of-memory, changes for the host's)
ADVICE: dict[str, tuple[str, str, str]] = {
    "caching": (
        "the VAE and text encoders, loaded once to fill the cache",
        'cache.encoder_dtype = "bf16"; or fill the cache once on a larger card (`imglora cache-latents`) and copy '
        "cache.dir here",
        "the text encoders are read whole (T5-XXL is 9.5 GB in bf16): a machine with more RAM for `imglora "
        "cache-latents`, then train from the filled cache"),
    "loading": (
        "the base model's weights",
        "memory.fp8 = true, or more memory.blocks_to_swap (`imglora plan` shows what each adds)",
        "fewer memory.blocks_to_swap (swapped blocks live in host RAM), the single-file or fp8 release of the model, "
        "or a machine with more RAM"),
    "quantizing": (
        "LoRA, fp8 quantization and placing the model",
        "memory.fp8 = true with more memory.blocks_to_swap",
        "fewer memory.blocks_to_swap, or a machine with more RAM"),
    "first forward": (
        "activations of the first micro-batch",
        "memory.gradient_checkpointing = true, memory.offload_checkpoints = true, train.batch_size = 1, a lower "
        "data.resolution, or more memory.blocks_to_swap",
        "memory.offload_checkpoints = false (its buffers are in host RAM), or a machine with more RAM"),
    "first backward": (
        "gradients and the recomputed activations",
        "memory.gradient_checkpointing = true, memory.offload_checkpoints = true, a lower data.resolution, a smaller "
        "lora.rank, or more memory.blocks_to_swap",
        "memory.offload_checkpoints = false, or a machine with more RAM"),
    "optimizer first step": (
        "the optimizer's state, created at its first step",
        'train.optimizer = "adamw8bit" or "adafactor", or a smaller lora.rank',
        'train.optimizer = "adamw8bit", or a smaller lora.rank'),
    "forward": (
        "activations of a later micro-batch (a larger bucket than before, or a fragmented allocator)",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, a lower data.max_bucket_side, or more "
        "memory.blocks_to_swap",
        "a machine with more RAM"),
    "backward": (
        "gradients of a later micro-batch (a larger bucket than before, or a fragmented allocator)",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, a lower data.max_bucket_side, or more "
        "memory.blocks_to_swap",
        "a machine with more RAM"),
    "optimizer step": (
        "the optimizer step",
        'PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or train.optimizer = "adamw8bit"',
        "a machine with more RAM"),
    "checkpoint saving": (
        "copies of the adapter and optimizer state written to disk",
        "train.keep_checkpoints and a smaller lora.rank; the checkpoint is copied to the host as it is written",
        "a smaller lora.rank or optimizer state (adamw8bit), or a machine with more RAM"),
    "evaluation": (
        "the held-out loss during training",
        "eval.every = 0 (run `imglora evaluate` after training instead), or fewer held-out images",
        "eval.every = 0, or fewer held-out images"),
}


class OutOfMemory(ImgloraError):
    exit_code = 5  # (3 is the budget guard's stop)

    def __init__(self, message: str, stage: str, kind: str):
        super().__init__(message)
        self.stage, self.kind = stage, kind


def kind_of(exc: BaseException) -> str | None:
    """"device" for a GPU out-of-memory error, "host" for the host's, None for anything else."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "device"
    if isinstance(exc, MemoryError):
        return "host"
    if isinstance(exc, RuntimeError):
        text = str(exc)
        if "DefaultCPUAllocator: can't allocate memory" in text or "not enough memory: you tried to allocate" in text:
            return "host"
        if "CUDA out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text:
            return "device"
    return None


class Stages:
    """The stage a run is in; ``with stages("loading"):`` around each one. In the training loop
    ``detail`` says which part of an update is running (see :func:`step_stage`)."""

    def __init__(self) -> None:
        self.name = "setup"
        self.detail: Callable[[], str] | None = None

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        before, self.name = self.name, name
        yield  # an exception leaves the name at the stage that failed, for the report
        self.name = before

    @property
    def current(self) -> str:
        return self.detail() if self.name == "training" and self.detail is not None else self.name


@contextmanager
def guard(stages: Stages, rec: Any, device: torch.device, memory_plan: Callable[[], dict[str, Any] | None],
          last_checkpoint: Callable[[], str | None]) -> Iterator[None]:
    """Turn an out-of-memory error inside into :class:`OutOfMemory`, kept in the run record."""
    from ..runs import telemetry

    try:
        yield
    except BaseException as exc:
        kind = kind_of(exc)
        if kind is None:
            raise
        stage = stages.current
        measured = telemetry.memory(device)
        err = report(exc, kind, stage, memory_plan(), measured, last_checkpoint())
        rec.set(failure={"kind": "out_of_memory", "memory": kind, "stage": stage, "error": str(exc)[:2000],
                         "message": str(err), "peak_memory": measured})
        if getattr(rec, "main", True):
            rec.write(status="out_of_memory")
        raise err from None


def step_stage(session_stage: str, first: bool) -> str:
    """The stage of an update from ``loop.Session.stage`` ("forward", "backward", "optimizer"; "done"
    once an update has finished)."""
    if session_stage == "done":
        return "between updates"
    name = {"optimizer": "optimizer step"}.get(session_stage, session_stage)
    if first:
        return {"optimizer step": "optimizer first step"}.get(name, f"first {name}")
    return name


def predicted_for(stage: str, memory_plan: dict[str, Any] | None) -> int | None:
    """The plan's bytes for what ``stage`` holds, when the run has a plan (a GPU run)."""
    if not memory_plan:
        return None
    t = memory_plan.get("terms", {})
    weights = sum(t.get(k, 0) for k in ("weights_resident_blocks", "swap_slots", "weights_non_block"))
    if stage in ("loading", "quantizing"):
        return weights + t.get("lora", 0)
    if stage in ("caching", "checkpoint saving"):
        return None
    return memory_plan.get("device_peak_bytes")


def report(exc: BaseException, kind: str, stage: str, memory_plan: dict[str, Any] | None, measured: dict[str, Any],
           last_checkpoint: str | None) -> OutOfMemory:
    what, device_fix, host_fix = ADVICE.get(stage, ("this stage", "more memory.blocks_to_swap or memory.fp8",
                                                    "a machine with more RAM"))
    where = "GPU" if kind == "device" else "host"
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    predicted = predicted_for(stage, memory_plan) if kind == "device" else None
    peak = measured.get("peak_allocated") if kind == "device" else measured.get("peak_rss")
    parts = [f"out of {where} memory during {stage} ({what}): {first}."]
    if predicted is not None:
        parts.append(f"`imglora plan` predicted {predicted / GiB:.2f} GiB allocated for this stage")
    if peak:
        parts.append(f"the peak measured before the failure was {peak / GiB:.2f} GiB"
                     + (" allocated" if kind == "device" else " of host RSS"))
    parts.append(f"To fit: {device_fix if kind == 'device' else host_fix}.")
    parts.append(f"The last good checkpoint is untouched: {last_checkpoint}." if last_checkpoint else
                 "No checkpoint had been written yet.")
    return OutOfMemory(" ".join(p if p.endswith(".") else p + "." for p in parts), stage, kind)
