"""Block swapping: stream the frozen weights of some blocks from pinned host memory to the GPU.

A model too large for the GPU is trained by keeping the *frozen* tensors of some blocks (the
"swapped" blocks) in host memory and copying each one into a reusable device buffer (a "slot")
just before it runs: in forward, in the gradient-checkpoint recompute and in backward. Trainable
parameters (LoRA) and their optimizer state never move.

Design, against kohya sd-scripts' ``custom_offloading_utils`` (the reference users know):

* **Host-to-device only.** Each swapped block has one immutable copy of its frozen tensors in
  page-locked host memory. Bringing a block in is one ``cudaMemcpyAsync`` of one contiguous buffer;
  evicting it only re-points its parameters at the host copy. kohya copies the outgoing block back
  device-to-host on every swap, both ways through pageable memory, between ``synchronize`` calls.
* **Fixed slots.** Blocks with identical tensor layouts (all FLUX double blocks; all single blocks)
  share a pool of ``slots_per_shape`` device buffers allocated in :meth:`install` (and at most once
  more, when the prefetch tuner of :mod:`.swap_tune` deepens the prefetch). A step allocates nothing.
* **Ordered with events, no synchronize.** Copies run on a side stream. The compute stream waits on
  the slot's *ready* event before the block runs; the copy into a slot waits on a *free* event
  recorded on the compute stream when the slot is reclaimed, which is after every kernel reading
  the slot's previous block has been queued (see below for backward).
* **Lazy eviction.** A block stays resident until its slot is needed. At the forward/backward
  turn-around the last blocks are still resident and are not copied again, likewise at the
  backward/next-forward turn-around: a step copies ``2 * (m - k)`` blocks per pool of ``m`` swapped
  blocks and ``k`` slots, host-to-device only (kohya: ``2 * m`` blocks in each direction).

How the engine follows autograd:

* Forward (and checkpoint recompute): a forward pre-hook on every block loads it if needed, makes
  the compute stream wait on it, and prefetches the next swapped block(s) in the running direction.
  Recompute is recognised by running inside the autograd engine (graph task id != -1); the
  direction is then "backward". Non-reentrant checkpoint (diffusers' default) calls ``block.__call__``
  again, so module hooks fire in recompute; reentrant checkpoint also works (the recompute pre-hook
  loads on demand and prefetches).
* Backward: the forward hook registers a gradient hook on every output tensor of the block. It runs
  when the autograd engine is about to execute the block's last node -- before any recompute and
  before any of the block's backward kernels -- so it loads the block and prefetches the previous
  one. ``register_full_backward_pre_hook`` is not used: it wraps inputs/outputs in extra autograd
  Functions and does not mix well with checkpointing.
* When is a block's backward *finished* (so its slot may be reused)? The autograd engine executes
  ready nodes highest sequence number first (``CompareNodeTaskTime``), and every node of block ``i+1``
  was created after every node of block ``i``. So when block ``i``'s first gradient hook fires, all
  of block ``i+1``'s nodes have already been executed (their kernels are queued on the compute
  stream). The free event recorded at that moment therefore orders the slot's reuse after them.
* Without gradient checkpointing autograd keeps references to weights for backward. Plain leaf
  references follow ``param.data`` swaps (kohya relies on this), but *views* of a weight saved by an
  op -- ``F.linear`` saves ``weight.t()`` -- keep pointing at the buffer they were made from. That
  is harmless only if the block is back in that same buffer when its backward runs: kohya's fixed
  pairing (and a plain LRU over slots) ensure it for one forward followed by one backward, but any
  other pass in between (say a no-grad target computed with the same model) re-deals the buffers
  and the backward silently reads another block's weights. The engine therefore installs
  ``saved_tensors_hooks`` while a swapped block runs its (non-checkpointed) forward: a saved tensor
  that lives in a slot is stored as "this dtype/size/stride/offset in block ``b``'s layout" and
  rebuilt at unpack time on the slot the block occupies then (its backward hook made it resident).
  Under checkpointing (or any other saved-tensor hooks, e.g. ``save_on_cpu``) the engine does not
  install its hooks: the outer hooks decide, and checkpoint's recompute saves views that are used
  while the block is resident.

Tensor subclasses (quanto's fp8 weights) are opened with ``__tensor_flatten__``: their inner tensors
are laid out in the slot like any other, and the attribute points at a wrapper built once per slot.

Without CUDA the same schedule runs with host-to-host copies (order and invariants testable anywhere).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..util.devices import is_cuda
from .fp8 import to_device
from .swap_storage import (Block, Pool, PoolStats, Slot, SlotAlias, SwapEvent, SwapStats, alias_spec, alloc_host,
                           build_pools, collect_entries, copy_to, graph_task_id, host_memory, iter_tensors,
                           outer_saved_tensor_hooks_active, rebuild, set_targets, stage_host, unflatten, unpin_all, view)

__all__ = ["BlockSwapper", "PoolStats", "SwapEvent", "SwapStats", "swap_mask"]

log = logging.getLogger(__name__)

_warned_cpu = False


# --------------------------------------------------------------------------------------- public API


def swap_mask(n_blocks: int, n_swap: int) -> list[bool]:
    """Swap the *last* ``n_swap`` of ``n_blocks`` blocks, as kohya does (``ModelOffloader`` keeps
    ``blocks[:n - n_swap]`` on the GPU). The resident first blocks give the first swapped block's
    copy a whole stretch of compute to hide behind, and the last blocks, needed first by backward,
    are the ones still resident when forward ends."""
    if not 0 <= n_swap <= n_blocks:
        raise ValueError(f"cannot swap {n_swap} of {n_blocks} blocks: need 0 <= n_swap <= {n_blocks}")
    return [i >= n_blocks - n_swap for i in range(n_blocks)]


@dataclass(frozen=True)
class SwapLayout:
    """Which blocks of which lists a run keeps in host memory: computed once, where a command starts
    (:func:`imglora.memory.wrap.resolve_swap`, the one caller of the family's ``swap_counts``), and
    passed down as data to the loader (which places the blocks as it reads them) and to
    :func:`imglora.memory.wrap.apply_memory` (which swaps exactly those), so the two cannot disagree.
    ``lists``: the block lists' attribute paths in execution order; ``lengths``: blocks in each;
    ``counts``: the last ``counts[i]`` of list ``i`` are swapped (:func:`swap_mask`)."""

    lists: tuple[str, ...] = ()
    lengths: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.lists) == len(self.lengths) == len(self.counts):
            raise ValueError(f"a swap layout needs one length and one count per list: {self}")
        for name, length, n in zip(self.lists, self.lengths, self.counts):
            if not 0 <= n <= length:
                raise ValueError(f"cannot swap {n} of {length} blocks of {name}")

    @property
    def swapped(self) -> int:
        """Blocks kept in host memory, over all lists."""
        return sum(self.counts)

    def masks(self) -> list[tuple[str, list[bool]]]:
        """``(list, one bool per block: swapped)`` for each list."""
        return [(name, swap_mask(length, n)) for name, length, n in zip(self.lists, self.lengths, self.counts)]

    def modules(self) -> set[str]:
        """Module names of the swapped blocks (``"single_transformer_blocks.37"``)."""
        return {f"{name}.{i}" for name, mask in self.masks() for i, swapped in enumerate(mask) if swapped}

    def swaps(self, name: str, index: int) -> bool:
        """Whether block ``index`` of the list ``name`` is kept in host memory."""
        if name not in self.lists:
            return False
        i = self.lists.index(name)
        return index >= self.lengths[i] - self.counts[i]

    def check(self, model: nn.Module) -> None:
        """Refuse a model whose block lists are not the ones this layout was computed for (a layout
        is computed from the model's config before loading; the loaded model must agree)."""
        found = tuple(len(model.get_submodule(name)) for name in self.lists)
        if found != self.lengths:
            raise RuntimeError(f"the swap layout was computed for block lists {dict(zip(self.lists, self.lengths))}, "
                               f"but the model has {dict(zip(self.lists, found))}")


NO_SWAP = SwapLayout()


# ---------------------------------------------------------------------------------------- engine


class BlockSwapper:
    """Keeps the frozen tensors of the blocks selected by ``swap`` in host memory and streams them
    into ``slots_per_shape`` device buffers per tensor layout while the model runs.

    ``blocks``: the blocks in execution order (e.g. FLUX double blocks then single blocks).
    ``swap``: one bool per block, or a set of block indices.
    Call order: inject LoRA and quantize first, set ``requires_grad``; then :meth:`install`; then
    build the optimizer; then each step ``prepare_forward()``, forward, backward, optimizer step.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        swap: Sequence[bool] | set[int] | frozenset[int],
        device: torch.device | str,
        *,
        slots_per_shape: int = 2,
        record_events: bool = False,
        tuner: Any = None,
    ) -> None:
        blocks = list(blocks)
        if isinstance(swap, (set, frozenset)):
            bad = sorted(i for i in swap if not 0 <= i < len(blocks))
            if bad:
                raise ValueError(f"swap indices {bad} out of range for {len(blocks)} blocks")
            mask = [i in swap for i in range(len(blocks))]
        else:
            mask = [bool(s) for s in swap]
            if len(mask) != len(blocks):
                raise ValueError(f"swap mask has {len(mask)} entries for {len(blocks)} blocks")
        if len({id(b) for b in blocks}) != len(blocks):
            raise ValueError("the same module appears twice in blocks")
        if slots_per_shape < 1:
            raise ValueError(f"slots_per_shape must be >= 1, got {slots_per_shape}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.slots_per_shape = slots_per_shape
        # How many swapped blocks ahead to prefetch: all slots but the running block's.
        self.lookahead = slots_per_shape - 1
        self.record_events = record_events
        self.tuner = tuner  # swap_tune.PrefetchTuner (memory.swap_prefetch = 0): may grow the slots once
        self._blocks = [Block(i, b, s) for i, (b, s) in enumerate(zip(blocks, mask))]
        self._swapped = [b.index for b in self._blocks if b.swapped]
        self._pools: list[Pool] = []
        self._cuda = is_cuda(self.device)
        self._copy_stream: Any = None
        self._handles: list[Any] = []
        self._installed = False
        self._tick = itertools.count(1)
        self._current: int | None = None  # the block running now (forward/recompute) or in backward
        self._slot_by_ptr: dict[int, Slot] = {}
        self._events: list[SwapEvent] = []
        self._h2d = self._d2h = self._loads = self._demand = self._allocs = 0
        self._finalizer: Any = None
        self._pinned: list[torch.Tensor] = []
        self._warned_no_hooks = False
        self._warned_pin = False

    # ----------------------------------------------------------------------------- install/remove

    def install(self, root: nn.Module | None = None) -> None:
        """Move swapped blocks' frozen tensors to (pinned) host memory, allocate the slots and
        register the hooks. Everything else in ``blocks`` -- non-swapped blocks and all trainable
        parameters -- is moved to ``device``.

        ``root``: the model the blocks belong to. If given, every tensor of ``root`` outside the
        swapped blocks (embedders, final layers...) is moved to ``device`` too. Do not call
        ``root.to(...)`` after install: it would copy the host-resident weights to the device.
        """
        if self._installed:
            raise RuntimeError("BlockSwapper.install() called twice; call remove() first")
        global _warned_cpu
        if not self._cuda and self._swapped and not _warned_cpu:
            _warned_cpu = True
            log.warning(
                "block swap on %s: the swap schedule runs with host-to-host copies, no GPU memory is saved",
                self.device,
            )
        collect_entries(self._blocks)
        if root is not None:
            inside = {id(m) for i in self._swapped for m in self._blocks[i].module.modules()}
            for mod in root.modules():
                if id(mod) not in inside:
                    to_device(mod, self.device, recurse=False)
        self._events = []
        self._h2d = self._d2h = self._loads = self._demand = self._allocs = 0
        for blk in self._blocks:
            if not blk.swapped:
                to_device(blk.module, self.device)
                continue
            # Trainable parameters (LoRA) stay on the device for good; .data keeps their identity.
            for p in blk.module.parameters():
                if p.requires_grad and p.device != self.device:
                    p.data = p.data.to(self.device)
        self._pools = build_pools(self._blocks, self._swapped)
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        self._pinned = []
        # Unpins even if remove() is never called. The finalizer holds the buffers, so they are
        # unregistered before they can be freed (freeing registered memory is undefined in CUDA).
        self._finalizer = weakref.finalize(self, unpin_all, self._pinned)
        for pool in self._pools:
            stage_host(pool, self._blocks, self._cuda, self._alloc_host)
            self._alloc_slots(pool)
        self._register_hooks()
        self._installed = True

    def remove(self) -> None:
        """Remove the hooks and put every swapped block's frozen tensors back on ``device`` (for
        evaluation or export). Frees the slots and the host copies."""
        if not self._installed:
            return
        if self._cuda:
            # Prefetches may still be in flight; nothing may be freed or re-pointed under them.
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for blk in self._blocks:
            if blk.saved_hooks is not None:
                blk.saved_hooks.__exit__(None, None, None)
                blk.saved_hooks = None
            if not blk.swapped:
                continue
            for e, host_obj in zip(blk.entries, blk.host_objs):
                if e.wrapped:
                    dev = nn.Parameter(copy_to(host_obj.detach(), self.device), requires_grad=False)
                    set_targets(e, dev)
                else:
                    e.tensor.data = copy_to(host_obj, self.device)
            blk.slot = None
            blk.host_objs = []
        if self._cuda:
            torch.cuda.synchronize(self.device)  # the copies above read the host buffers we free now
        if self._finalizer is not None:
            self._finalizer()  # unpin (a no-op without CUDA: nothing was pinned)
            self._finalizer = None
        for pool in self._pools:
            pool.hosts = []
            pool.slots = []
        self._pools = []
        self._slot_by_ptr = {}
        self._copy_stream = None
        self._current = None
        self._installed = False

    def _alloc_host(self, nbytes: int) -> tuple[torch.Tensor, str]:
        buf, how, why = alloc_host(nbytes, self._cuda, self._pinned)
        if why is not None and not self._warned_pin:
            self._warned_pin = True
            log.warning("block swap: cudaHostRegister failed (%s); %s", why,
                        "using PyTorch's pinned allocator (rounds each block up to a power of two)"
                        if how == "pinned" else "host copies are not page-locked, transfers will be synchronous")
        return buf, how

    def _alloc_slots(self, pool: Pool) -> None:
        for _ in range(len(pool.slots), min(self.slots_per_shape, len(pool.members))):
            buf = torch.empty(pool.block_bytes, dtype=torch.uint8, device=self.device)
            self._allocs += 1
            objs = []
            for struct, (a, b) in zip(pool.entry_structs, pool.entry_leaves):
                views = [view(buf, lf) for lf in pool.leaves[a:b]]
                if struct is None:
                    objs.append(views[0])
                else:
                    objs.append(nn.Parameter(unflatten(struct, iter(views)), requires_grad=False))
            slot = Slot(buf, objs)
            if self._cuda:
                slot.ready, slot.free = torch.cuda.Event(), torch.cuda.Event()
            pool.slots.append(slot)
            self._slot_by_ptr[buf.untyped_storage().data_ptr()] = slot

    def _register_hooks(self) -> None:
        if not self._swapped:
            return
        # Hooks on every block, swapped or not: resident blocks trigger prefetches too, which is
        # what hides the first swapped block's copy behind the resident blocks' compute.
        for blk in self._blocks:
            m = blk.module
            self._handles.append(m.register_forward_pre_hook(functools.partial(self._pre_hook, blk.index)))
            # always_call: the saved-tensor hooks pushed by the pre-hook must be popped even if the
            # block raises (checkpoint's early stop raises out of a recompute on purpose).
            self._handles.append(
                m.register_forward_hook(functools.partial(self._post_hook, blk.index), always_call=True)
            )

    # ----------------------------------------------------------------------------------- per step

    def prepare_forward(self) -> None:
        """Call before each forward: starts copying the first swapped blocks (if not resident)."""
        if not self._installed or not self._swapped:
            return
        if self.tuner is not None:
            self.tuner.forward_starts(self)
        self._current = None
        window = self._swapped[: max(self.lookahead, 1)]
        protect = set(window)
        for j in window:
            if self._blocks[j].slot is None:
                self._load(j, "forward", protect, demand=False)

    @property
    def stats(self) -> SwapStats:
        slots = [s for p in self._pools for s in p.slots]
        return SwapStats(
            n_swapped=len(self._swapped),
            slots=len(slots),
            device_buffer_bytes=sum(s.buf.numel() for s in slots),
            h2d_bytes=self._h2d,
            d2h_bytes=self._d2h,
            loads=self._loads,
            demand_loads=self._demand,
            buffer_allocations=self._allocs,
            pinned=bool(self._pools) and all(p.pinned for p in self._pools),
            host_memory=host_memory(self._pools),
            pools=tuple(PoolStats(len(p.members), len(p.slots), p.block_bytes) for p in self._pools),
            events=tuple(self._events),
        )

    def grow(self, depth: int) -> None:
        """Prefetch ``depth`` swapped blocks ahead from now on: slots added up to ``depth + 1`` per pool."""
        self.slots_per_shape = depth + 1
        for pool in self._pools:
            self._alloc_slots(pool)
        self.lookahead = depth  # (after: out of memory above leaves the lookahead, and extra slots serve LRU)

    def layout(self) -> tuple[list[int | None], dict[int, int], dict[int, int]]:
        """(each block's pool or None, bytes of a block per pool, swapped blocks per pool): for the tuner."""
        return ([self._pools.index(b.pool) if b.swapped else None for b in self._blocks],
                dict(enumerate(p.block_bytes for p in self._pools)), dict(enumerate(len(p.members) for p in self._pools)))

    def _stream(self, copy: bool = False) -> Any:
        return (self._copy_stream if copy else torch.cuda.current_stream(self.device)) if self._cuda else None

    def resident(self) -> list[int]:
        """Swapped blocks currently in a slot."""
        return [i for i in self._swapped if self._blocks[i].slot is not None]

    # -------------------------------------------------------------------------------------- hooks

    def _pre_hook(self, index: int, module: nn.Module, args: Any) -> None:
        in_backward = graph_task_id() != -1
        phase, direction = ("recompute", -1) if in_backward else ("forward", 1)
        blk = self._blocks[index]
        self._current = index
        if blk.swapped:
            self._acquire(index, phase, direction)
            if phase == "forward" and torch.is_grad_enabled() and not outer_saved_tensor_hooks_active():
                hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                try:
                    hooks.__enter__()
                except RuntimeError:  # inside torch.autograd.graph.disable_saved_tensors_hooks()
                    if not self._warned_no_hooks:
                        self._warned_no_hooks = True
                        log.warning(
                            "block swap: saved-tensor hooks are disabled here, so weights saved for "
                            "backward are not protected; use gradient checkpointing with block swap"
                        )
                else:
                    blk.saved_hooks = hooks
        if self.tuner is not None and phase == "forward":
            self.tuner.block_starts(index, self._stream())
        self._prefetch(index, direction, phase)

    def _post_hook(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        blk = self._blocks[index]
        if blk.saved_hooks is not None:
            blk.saved_hooks.__exit__(None, None, None)
            blk.saved_hooks = None
        if self.tuner is not None and graph_task_id() == -1:
            self.tuner.block_ends(index, self._stream())
        if output is None or not torch.is_grad_enabled() or graph_task_id() != -1:
            return  # no backward will come (or this is a recompute, whose outputs are discarded)
        tensors = [t for t in iter_tensors(output) if t.requires_grad]
        if not tensors:
            return
        fired = [None]  # graph task that already handled this forward's outputs

        def on_grad(grad: torch.Tensor) -> None:
            task = graph_task_id()
            if fired[0] != task:
                fired[0] = task
                self._enter_backward(index)

        for t in tensors:
            t.register_hook(on_grad)

    def _enter_backward(self, index: int) -> None:
        """The autograd engine is about to run block ``index``'s last node."""
        blk = self._blocks[index]
        self._current = index
        if blk.swapped:
            self._acquire(index, "backward", -1)
        self._prefetch(index, -1, "backward")

    # ------------------------------------------------------------------------------- schedule core

    def _window(self, index: int, direction: int) -> list[int]:
        """The next ``lookahead`` swapped blocks after ``index`` in ``direction``."""
        if direction > 0:
            pos = bisect.bisect_right(self._swapped, index)
            return self._swapped[pos : pos + self.lookahead]
        pos = bisect.bisect_left(self._swapped, index)
        return self._swapped[max(pos - self.lookahead, 0) : pos][::-1]

    def _acquire(self, index: int, phase: str, direction: int) -> None:
        blk = self._blocks[index]
        if blk.slot is None:
            protect = {index, *self._window(index, direction)}
            if not self._load(index, phase, protect, demand=True):
                raise RuntimeError(f"block swap: no slot free for block {index} (internal error)")
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(blk.slot.ready)
        blk.last_use = next(self._tick)
        if self.record_events:
            self._events.append(SwapEvent("run", index, phase))

    def _prefetch(self, index: int, direction: int, phase: str) -> None:
        window = self._window(index, direction)
        protect = {index, *window}
        for j in window:
            if self._blocks[j].slot is None:
                self._load(j, phase, protect, demand=False)

    def _pick_slot(self, pool: Pool, protect: set[int]) -> Slot | None:
        best = None
        for s in pool.slots:
            if s.occupant is None:
                return s
            if s.occupant in protect or s.occupant == self._current:
                continue
            if best is None or self._blocks[s.occupant].last_use < self._blocks[best.occupant].last_use:
                best = s
        return best

    def _load(self, index: int, phase: str, protect: set[int], *, demand: bool) -> bool:
        blk = self._blocks[index]
        pool = blk.pool
        slot = self._pick_slot(pool, protect)
        if slot is None:
            return False  # every slot holds a block needed sooner; it will be loaded on demand
        if slot.occupant is not None:
            self._evict(slot, phase)
        src = pool.hosts[blk.pool_pos]
        mark = None
        if self._cuda:
            # Everything that reads the slot's previous block is already queued on the compute
            # stream (forward: that block returned; backward: see the module docstring), so an
            # event recorded now is the point after which the buffer may be overwritten.
            slot.free.record(torch.cuda.current_stream(self.device))
            self._copy_stream.wait_event(slot.free)
            if self.tuner is not None:  # timed from when the copy can start: after the wait
                mark = self.tuner.copy_marks(self._copy_stream)
            with torch.cuda.stream(self._copy_stream):
                slot.buf.copy_(src, non_blocking=pool.pinned)
                slot.ready.record(self._copy_stream)
        else:
            mark = self.tuner.copy_marks(None) if self.tuner is not None else None
            slot.buf.copy_(src)
        if mark is not None:
            self.tuner.copied(self._pools.index(pool), mark, self._stream(copy=True))
        for e, obj in zip(blk.entries, slot.objs):
            if e.wrapped:
                set_targets(e, obj)
            else:
                e.tensor.data = obj
        slot.occupant, blk.slot = index, slot
        self._h2d += pool.block_bytes
        self._loads += 1
        self._demand += demand
        if self.record_events:
            self._events.append(SwapEvent("load", index, phase))
        return True

    def _evict(self, slot: Slot, phase: str) -> None:
        blk = self._blocks[slot.occupant]
        # No copy back: the host copy is the weights (frozen), re-pointing is all eviction takes.
        for e, obj in zip(blk.entries, blk.host_objs):
            if e.wrapped:
                set_targets(e, obj)
            else:
                e.tensor.data = obj
        if self.record_events:
            self._events.append(SwapEvent("evict", blk.index, phase))
        slot.occupant, blk.slot = None, None

    # ------------------------------------------------------------- saved tensors without checkpoint

    def _pack(self, t: torch.Tensor) -> Any:
        spec = alias_spec(t, self._slot_by_ptr)
        return t if spec is None else SlotAlias(spec)

    def _unpack(self, packed: Any) -> torch.Tensor:
        return rebuild(packed.spec, self._blocks) if isinstance(packed, SlotAlias) else packed
