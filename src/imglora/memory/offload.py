"""Gradient-checkpoint boundaries kept in host memory (kohya's ``--cpu_offload_checkpointing``).

With gradient checkpointing a model keeps, for backward, only each checkpointed block's inputs --
for FLUX.1 at 1024x1024 the image and text hidden states, 27 MiB per block, 57 blocks: about
1.5 GiB, the largest activation term left. :class:`OffloadingCheckpoint` is a checkpoint function
(diffusers' ``enable_gradient_checkpointing(gradient_checkpointing_func=...)``) that copies each
large input to page-locked host memory as the block runs forward and back to the device when
backward recomputes the block, so the device holds a block's inputs (and the next one's, coming
in) instead of all of them.

On CUDA every copy runs on a side stream, ordered by events, so none waits for compute and compute
never waits for a copy it does not need yet:

* **Forward.** The block runs on the original device tensor. An event recorded on the compute
  stream when the block is called orders the device-to-host copy after whatever produced the
  tensor; ``record_stream`` keeps the allocator from handing the tensor's memory to later compute
  before the side stream has read it.
* **Backward.** Recomputing block *k* brings *k*'s inputs in (already there when they were
  prefetched) and queues the copy of the next block to be recomputed (*k - 1*: backward runs in
  reverse), so that copy overlaps with block *k*'s recompute and backward. The device tensor is
  allocated on the compute stream, the side stream waits for an event recorded after that
  allocation before writing it, and the compute stream waits for the copy's event before the
  block reads it.
* **Host memory, exactly.** Each boundary gets a host buffer of exactly its size, page-locked with
  ``cudaHostRegister`` (as the swap engine's blocks are): PyTorch's caching host allocator, behind
  ``.to("cpu", non_blocking=True)``, rounds each up to a power of two (FLUX.1's 24 MiB boundaries
  would take 32 MiB each, 2.0 GiB instead of 1.5). Where registering fails the allocator's pinned
  memory, then pageable memory, are the fallbacks; :attr:`OffloadingCheckpoint.facts` says which
  was used and how much. Buffers are reused from update to update (every use of them is on the
  side stream, so each reuse is ordered after the last).

Gradients flow as without offloading: the forward graph is built on the device tensors the blocks
were called with, and the recomputed graph reads the copies. Only tensors of at least ``min_bytes``
on the accelerator move; small ones (the timestep embedding, shared rotary tables) stay. Off CUDA
nothing moves.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from ..util.devices import is_cuda
from .swap_storage import alloc_host, pinned_bytes, unpin_all

MIN_BYTES = 1 << 20

__all__ = ["MIN_BYTES", "OffloadingCheckpoint", "install", "pinned_bytes"]


class _Boundary:
    """One checkpointed call's large inputs while the graph lives: host buffers, events, and the
    device copies once brought back."""

    __slots__ = ("bufs", "host", "shapes", "grads", "saved", "back", "ready", "__weakref__")

    def __init__(self) -> None:
        self.bufs: list[torch.Tensor] = []  # uint8 host buffers (returned to the pool when done)
        self.host: list[torch.Tensor] = []  # the same, viewed as the tensors they hold
        self.grads: list[bool] = []
        self.saved: Any = None  # the event after the device-to-host copies
        self.back: list[torch.Tensor] | None = None  # device copies, once queued
        self.ready: Any = None  # the event after the host-to-device copies


class OffloadingCheckpoint:
    def __init__(self, device: torch.device | str = "cpu", min_bytes: int | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = is_cuda(self.device)
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self.offloaded_bytes = 0  # bytes copied to the host so far (a counter for reports and tests)
        self.calls = 0
        # for the run record: whether boundaries move, and host memory held by kind (bytes)
        self.facts: dict[str, Any] = {"moves": self.cuda, "host_memory": {}}
        self._free: dict[int, list[torch.Tensor]] = {}  # nbytes -> idle host buffers
        self._registered: list[torch.Tensor] = []  # registered buffers (unregistered by the finalizer)
        self._pending: list[_Boundary] = []  # forward order; recomputes take them from the end
        self._stream: Any = None
        if self.cuda:  # unregisters the buffers when this goes (the finalizer keeps them until then)
            self._finalizer = weakref.finalize(self, unpin_all, self._registered)

    # ---------------------------------------------------------------------------------- host buffers

    def _buffer(self, nbytes: int) -> torch.Tensor:
        idle = self._free.get(nbytes)
        if idle:
            return idle.pop()
        buf, kind, _why = alloc_host(nbytes, True, self._registered)
        held = self.facts["host_memory"]
        held[kind] = held.get(kind, 0) + (pinned_bytes(nbytes) if kind == "pinned" else nbytes)
        return buf

    def _release(self, entry: _Boundary) -> None:
        for buf in entry.bufs:
            self._free.setdefault(buf.numel(), []).append(buf)
        entry.bufs, entry.host, entry.back = [], [], None
        if entry in self._pending:
            self._pending.remove(entry)

    # ----------------------------------------------------------------------------------- the copies

    def _side(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def _offload(self, tensors: list[torch.Tensor], entry: _Boundary) -> None:
        compute, side = torch.cuda.current_stream(self.device), self._side()
        produced = torch.cuda.Event()
        produced.record(compute)
        with torch.no_grad(), torch.cuda.stream(side):
            side.wait_event(produced)
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                buf = self._buffer(nbytes)
                host = buf[:nbytes].view(t.dtype).view(t.shape)
                host.copy_(t, non_blocking=True)
                t.record_stream(side)  # its memory is not reused before the side stream has read it
                entry.bufs.append(buf)
                entry.host.append(host)
                entry.grads.append(t.requires_grad)
            entry.saved = torch.cuda.Event()
            entry.saved.record(side)

    def _bring_back(self, entry: _Boundary) -> None:
        if entry.back is not None or not entry.host:
            return
        compute, side = torch.cuda.current_stream(self.device), self._side()
        with torch.no_grad():
            back = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in entry.host]
        allocated = torch.cuda.Event()
        allocated.record(compute)  # whatever last used this memory on the compute stream is before it
        with torch.no_grad(), torch.cuda.stream(side):
            side.wait_event(allocated)
            for d, h in zip(back, entry.host):
                d.copy_(h, non_blocking=True)
                d.record_stream(side)  # if dropped before the compute stream waits, not reused early
            entry.ready = torch.cuda.Event()
            entry.ready.record(side)
        entry.back = [d.requires_grad_(g) for d, g in zip(back, entry.grads)]

    def _recompute_inputs(self, entry: _Boundary) -> list[torch.Tensor]:
        self._bring_back(entry)
        back = entry.back
        if back is None:
            raise RuntimeError("memory.offload_checkpoints: a block's saved inputs were already given back; a "
                               "second backward through the same graph is not supported with offloaded "
                               "checkpoints (set memory.offload_checkpoints = false)")
        if entry in self._pending:
            self._pending.remove(entry)
        if self._pending:  # the next block backward recomputes: its copy overlaps with this block
            self._bring_back(self._pending[-1])
        torch.cuda.current_stream(self.device).wait_event(entry.ready)
        self._release(entry)  # later uses of the buffers are on the side stream: ordered after these
        return back

    # ------------------------------------------------------------------------------ the checkpoint

    def _moves(self, a: Any) -> bool:
        return (self.cuda and isinstance(a, torch.Tensor) and a.device.type == self.device.type
                and a.numel() * a.element_size() >= self.min_bytes)

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        moved = [self._moves(a) for a in args]
        if not any(moved):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)
        originals = list(args)
        entry = _Boundary()
        self._offload([a for a, m in zip(args, moved) if m], entry)
        self.offloaded_bytes += sum(a.numel() * a.element_size() for a, m in zip(args, moved) if m)
        self._pending.append(entry)
        host = iter(entry.host)
        stand_ins = tuple(next(host) if m else a for a, m in zip(args, moved))
        first = [True]

        def run(*a: Any, **k: Any) -> Any:
            if first[0]:  # the forward pass: the device tensors are still here, use them
                first[0] = False
                a = tuple(o if m else x for o, x, m in zip(originals, a, moved))
                originals.clear()  # do not keep them alive for backward
            else:  # recompute in backward: bring the inputs back
                back = iter(self._recompute_inputs(entry))
                a = tuple(next(back) if m else x for x, m in zip(a, moved))
            return function(*a, **k)

        # A graph dropped without backward (an exception, an evaluation with gradients on) gives
        # its buffers back when the checkpoint's function goes.
        weakref.finalize(run, self._release, entry)
        return checkpoint(run, *stand_ins, use_reentrant=False, **kwargs)


def install(model: torch.nn.Module, device: torch.device | str = "cpu") -> OffloadingCheckpoint | None:
    """Use an :class:`OffloadingCheckpoint` for ``model``'s gradient checkpointing, when the model
    takes a checkpoint function (diffusers models do); None otherwise."""
    enable = getattr(model, "enable_gradient_checkpointing", None)
    if enable is None or not getattr(model, "is_gradient_checkpointing", False):
        return None
    import inspect

    if "gradient_checkpointing_func" not in inspect.signature(enable).parameters:
        return None
    fn = OffloadingCheckpoint(device)
    enable(gradient_checkpointing_func=fn)
    return fn
