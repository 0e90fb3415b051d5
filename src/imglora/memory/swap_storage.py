"""The storage side of block swapping (see :mod:`.swap` for the engine and its design): how a
block's frozen tensors are laid out in one buffer, the host copies (page-locked where possible) and
the device slots they are copied into, and saved tensors remembered by their place in a slot."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


# Offsets of tensors inside a block buffer: the CUDA caching allocator's granularity, so every view
# is as aligned as a tensor of its own (vectorised and fp8/Marlin-style kernels assume >= 16 bytes).
ALIGN = 256


# ------------------------------------------------------------------------------ what the engine reports


class SwapEvent(NamedTuple):
    kind: str  # "load" (copy into a slot issued), "run" (block about to compute), "evict"
    block: int  # index into the ``blocks`` given to BlockSwapper
    phase: str  # "forward", "recompute" or "backward"


@dataclass(frozen=True)
class PoolStats:
    n_blocks: int
    """Swapped blocks sharing this tensor layout."""
    n_slots: int
    """Device buffers for them (``min(slots_per_shape, n_blocks)``)."""
    block_bytes: int
    """Bytes of one block's frozen tensors as laid out in a slot (with alignment padding)."""


@dataclass(frozen=True)
class SwapStats:
    n_swapped: int
    slots: int
    """Device buffers in all pools; grows after :meth:`BlockSwapper.install` only when the prefetch tuner deepens."""
    device_buffer_bytes: int
    h2d_bytes: int
    """Bytes copied host-to-device by the schedule since install."""
    d2h_bytes: int
    """Bytes copied device-to-host by the schedule since install (always 0: nothing is copied back)."""
    loads: int
    """Block copies issued since install."""
    demand_loads: int
    """Of those, copies issued when the block was already needed (not prefetched): stalls."""
    buffer_allocations: int
    """Device buffers allocated since install (== ``slots``: no allocation per step)."""
    pinned: bool
    """Whether the host copies are page-locked (only with CUDA)."""
    pools: tuple[PoolStats, ...]
    events: tuple[SwapEvent, ...] = ()
    host_memory: tuple[tuple[str, int], ...] = ()
    """Bytes of the host copies by kind -- "registered" (cudaHostRegister: exact), "pinned" (PyTorch's
    allocator, rounded up to powers of two), "pageable" (no CUDA, or page-locking failed)."""


# ------------------------------------------------------------------------------- layout of a block


class Leaf(NamedTuple):
    """A plain tensor's place in a block buffer."""

    offset: int  # bytes from the start of the block buffer
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return span(self.size, self.stride) * self.dtype.itemsize


@dataclass
class Entry:
    """One frozen parameter/buffer of a block (possibly registered under several names)."""

    name: str  # first "module.attr" name within the block
    targets: list[tuple[nn.Module, str, bool]]  # (module, attribute, is_parameter)
    tensor: torch.Tensor  # the object found at install (plain entries keep it and swap .data)
    wrapped: bool  # a tensor subclass: swapped by re-assigning the module attribute


def span(size: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from the first to the last element of a strided tensor, inclusive."""
    if any(s == 0 for s in size):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride))


def dense_layout(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Size and stride to store ``t`` with: its own strides if they cover exactly ``numel`` elements
    (contiguous or a permutation, e.g. a transposed weight), else contiguous."""
    size, stride = tuple(t.shape), tuple(t.stride())
    if all(st >= 0 for st in stride) and span(size, stride) == t.numel():
        return size, stride
    return size, tuple(torch.empty(size, device="meta").stride())


def flatten(t: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
    """Structure and plain leaf tensors of ``t``; a subclass is opened with ``__tensor_flatten__``."""
    if not is_traceable_wrapper_subclass(t):
        return None, [t]
    names, meta = t.__tensor_flatten__()
    inner, leaves = [], []
    for n in names:
        sub, sub_leaves = flatten(getattr(t, n))
        inner.append((n, sub, len(sub_leaves)))
        leaves.extend(sub_leaves)
    return (type(t), meta, tuple(t.size()), tuple(t.stride()), tuple(inner)), leaves


def unflatten(struct: Any, leaves: Iterator[torch.Tensor]) -> torch.Tensor:
    if struct is None:
        return next(leaves)
    cls, meta, size, stride, inner = struct
    tensors = {n: unflatten(sub, leaves) for n, sub, _ in inner}
    return cls.__tensor_unflatten__(tensors, meta, size, stride)


def struct_key(struct: Any) -> Any:
    """Hashable, comparable form of a structure (the metadata of quanto is a dict of strings)."""
    if struct is None:
        return None
    cls, meta, size, stride, inner = struct
    meta_key = tuple(sorted((k, repr(v)) for k, v in meta.items())) if isinstance(meta, dict) else repr(meta)
    return (cls.__module__, cls.__qualname__, meta_key, size, stride, tuple((n, struct_key(s), k) for n, s, k in inner))


def view(buf: torch.Tensor, leaf: Leaf) -> torch.Tensor:
    """The tensor described by ``leaf`` inside the uint8 block buffer ``buf``."""
    return buf[leaf.offset : leaf.offset + leaf.nbytes].view(leaf.dtype).as_strided(leaf.size, leaf.stride)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from iter_tensors(o)
    elif hasattr(obj, "to_tuple"):  # diffusers/transformers ModelOutput
        yield from iter_tensors(obj.to_tuple())


# ---------------------------------------------------------------------------------- engine state


@dataclass(eq=False)
class Slot:
    buf: torch.Tensor  # uint8 device buffer, one block
    objs: list[torch.Tensor]  # per entry: a view (plain) or a Parameter wrapping views (subclass)
    ready: Any = None  # torch.cuda.Event, recorded on the copy stream after the copy into buf
    free: Any = None  # torch.cuda.Event, recorded on the compute stream before buf is overwritten
    occupant: int | None = None


@dataclass(eq=False)
class Pool:
    signature: Any
    entry_structs: list[Any]  # per entry: flatten structure (None for plain tensors)
    entry_leaves: list[tuple[int, int]]  # per entry: [start, stop) into leaves
    leaves: list[Leaf]
    block_bytes: int
    members: list[int] = field(default_factory=list)  # block indices, in order
    hosts: list[torch.Tensor] = field(default_factory=list)  # per member: uint8 host copy, block_bytes
    pinned: bool = False
    slots: list[Slot] = field(default_factory=list)
    host_memory: dict[str, int] = field(default_factory=dict)  # bytes of the host copies by kind


@dataclass(eq=False)
class Block:
    index: int
    module: nn.Module
    swapped: bool
    entries: list[Entry] = field(default_factory=list)
    pool: Pool | None = None
    pool_pos: int = 0
    host_objs: list[torch.Tensor] = field(default_factory=list)
    slot: Slot | None = None
    last_use: int = 0
    saved_hooks: Any = None  # the saved_tensors_hooks context pushed by the pre-hook, if any


class SlotAlias:
    """A saved tensor that lives in a slot, remembered by position so it can be rebuilt wherever its
    block is resident at unpack time (see the module docstring)."""

    __slots__ = ("spec",)

    def __init__(self, spec: Any) -> None:
        self.spec = spec


def graph_task_id() -> int:
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if fn is None else fn()


def outer_saved_tensor_hooks_active() -> bool:
    fn = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if fn is None:  # a torch without it: assume none (correct, but checkpoint then saves swapped blocks' activations)
        return False
    return fn(False) is not None


def set_targets(e: "Entry", obj: torch.Tensor) -> None:
    """Point every module attribute holding entry ``e`` at ``obj``."""
    for mod, attr, is_param in e.targets:
        (mod._parameters if is_param else mod._buffers)[attr] = obj


def collect_entries(blocks: list[Block]) -> None:
    """Find each swapped block's frozen tensors; refuse tensors shared between blocks."""
    owner: dict[int, int] = {}  # id(tensor) -> block index, for every tensor of every block
    for blk in blocks:
        seen: dict[int, Entry] = {}
        blk.entries = []
        for mod_name, mod in blk.module.named_modules():
            for is_param, registry in ((True, mod._parameters), (False, mod._buffers)):
                for attr, t in registry.items():
                    if t is None:
                        continue
                    other = owner.setdefault(id(t), blk.index)
                    if other != blk.index and (blk.swapped or blocks[other].swapped):
                        raise ValueError(
                            f"{mod_name}.{attr} of block {blk.index} is shared with block {other}; "
                            "a swapped block's tensors must be its own"
                        )
                    if not blk.swapped or (is_param and t.requires_grad):
                        continue
                    if id(t) in seen:  # tied inside the block: one copy, several names
                        seen[id(t)].targets.append((mod, attr, is_param))
                        continue
                    if t.is_meta:
                        raise ValueError(f"block {blk.index}: {mod_name}.{attr} is on the meta device")
                    e = Entry(
                        name=f"{mod_name}.{attr}" if mod_name else attr,
                        targets=[(mod, attr, is_param)],
                        tensor=t,
                        wrapped=is_traceable_wrapper_subclass(t),
                    )
                    seen[id(t)] = e
                    blk.entries.append(e)



def build_pools(blocks: list[Block], swapped: list[int]) -> list[Pool]:
    """Group the swapped blocks by tensor layout; each group shares slots."""
    pools: list[Pool] = []
    by_sig: dict[Any, Pool] = {}
    for i in swapped:
        blk = blocks[i]
        structs, spans, leaves, sig = [], [], [], []
        offset = 0
        for e in blk.entries:
            t = e.tensor
            if e.wrapped and t.device.type != "cpu":
                # Device-specific subclass layouts (quanto's Marlin) do not round-trip through
                # the host; the portable layout is rebuilt from host memory below.
                t = t.detach().to("cpu")
                e.tensor = t
            struct, plain = flatten(t)
            start = len(leaves)
            for p in plain:
                size, stride = dense_layout(p)
                leaf = Leaf(offset, p.dtype, size, stride)
                leaves.append(leaf)
                offset += -(-leaf.nbytes // ALIGN) * ALIGN
            structs.append(struct)
            spans.append((start, len(leaves)))
            sig.append((e.name, e.wrapped, struct_key(struct)))
        sig.append(tuple((lf.dtype, lf.size, lf.stride) for lf in leaves))
        key = tuple(sig)
        pool = by_sig.get(key)
        if pool is None:
            pool = Pool(key, structs, spans, leaves, max(offset, ALIGN))
            by_sig[key] = pool
            pools.append(pool)
        blk.pool, blk.pool_pos = pool, len(pool.members)
        pool.members.append(i)
    return pools


def stage_host(pool: Pool, blocks: list[Block], cuda: bool, alloc: Any) -> None:
    """Copy each member's frozen tensors into its own host buffer and point the block at it.

    One buffer per block, filled and re-pointed before the next is allocated: the original
    tensors are released block by block, so install needs one block of extra host memory,
    not a second copy of everything that is swapped.
    """
    pool.pinned = cuda
    with torch.no_grad():
        for i in pool.members:
            blk = blocks[i]
            host, how = alloc(pool.block_bytes)
            pool.pinned = pool.pinned and how != "pageable"
            # what the host really gives: PyTorch's pinned allocator rounds up to a power of two
            held = pinned_bytes(pool.block_bytes) if how == "pinned" else pool.block_bytes
            pool.host_memory[how] = pool.host_memory.get(how, 0) + held
            blk.host_objs = []
            for e, struct, (a, b) in zip(blk.entries, pool.entry_structs, pool.entry_leaves):
                _, plain = flatten(e.tensor)
                views = [view(host, lf) for lf in pool.leaves[a:b]]
                for v, p in zip(views, plain):
                    v.copy_(p.detach())
                if e.wrapped:
                    obj = nn.Parameter(unflatten(struct, iter(views)), requires_grad=False)
                    set_targets(e, obj)
                    e.tensor = obj
                else:
                    obj = views[0]
                    # Re-pointing .data (not replacing the Parameter) keeps the object that
                    # modules, peft and autograd hold; the old storage is freed here.
                    e.tensor.data = obj
                blk.host_objs.append(obj)
            pool.hosts.append(host)



def host_memory(pools: list[Pool]) -> tuple[tuple[str, int], ...]:
    """Bytes of the pools' host copies by kind, for the swap stats and the run record."""
    kinds: dict[str, int] = {}
    for pool in pools:
        for how, n in pool.host_memory.items():
            kinds[how] = kinds.get(how, 0) + n
    return tuple(sorted(kinds.items()))


def pinned_bytes(nbytes: int) -> int:
    """Host memory the caching host allocator takes for ``nbytes`` (behind ``pin_memory`` and
    ``.to("cpu", non_blocking=True)``): every block rounded up to a power of two."""
    return 1 << max(0, int(nbytes) - 1).bit_length() if nbytes > 0 else 0


def alloc_host(nbytes: int, cuda: bool, pinned: list[torch.Tensor]) -> tuple[torch.Tensor, str, Any]:
    """A host buffer for one block: "registered", "pinned" (allocator) or "pageable", and why not registered.

    ``pin_memory=True`` goes through PyTorch's caching host allocator, which rounds every
    allocation up to a power of two (a 283 MB bf16 FLUX single block would take 512 MB of RAM).
    Registering a plain buffer with cudaHostRegister pins exactly its pages (PyTorch's
    distributed-checkpoint stager does the same), so that comes first. It can fail where the
    locked-memory limit is low (containers); the allocator, then pageable memory (synchronous
    copies, still correct) are the fallbacks.
    """
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if not cuda:
        return buf, "pageable", None
    try:
        # flags=1 (cudaHostRegisterPortable), as torch.cuda._pin_memory_utils uses.
        rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 1))
    except Exception as exc:  # noqa: BLE001 - any failure only means "try the next way"
        rc = repr(exc)
    if rc == 0:
        pinned.append(buf)
        return buf, "registered", None
    # The failed call is also CUDA's "last error" until cudaGetLastError reads it, and PyTorch checks
    # that after every kernel launch: left set, the next kernel would fail with this unrelated error.
    clear_cuda_error()
    try:
        page_locked = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        page_locked = None
    # The third value says why page-locking failed (the engine warns once).
    if page_locked is not None:
        return page_locked, "pinned", rc
    return buf, "pageable", rc


def clear_cuda_error() -> bool:
    """Read (and so clear) the CUDA runtime's last error; False where no way to do it was found.

    ``torch.cuda.cudart()`` binds cudaHostRegister but not cudaGetLastError, so this calls the
    runtime library PyTorch loaded (found in the process's memory map) through ctypes."""
    fn = getattr(torch.cuda.cudart(), "cudaGetLastError", None) or _runtime_get_last_error()
    if fn is None:
        return False
    fn()
    return True


@functools.cache
def _runtime_get_last_error() -> Any:
    import ctypes

    try:
        with open("/proc/self/maps") as fh:
            paths = sorted({line.split()[-1] for line in fh if "libcudart" in line and "/" in line})
    except OSError:
        paths = []
    # Only a runtime already loaded: another copy of libcudart would keep an error state of its own.
    for path in paths:
        try:
            fn = ctypes.CDLL(path).cudaGetLastError  # an already-loaded library: the same instance
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return fn
    return None


def alias_spec(t: torch.Tensor, slot_by_ptr: dict[int, Slot]) -> Any:
    if is_traceable_wrapper_subclass(t):
        names, meta = t.__tensor_flatten__()
        inner = {n: alias_spec(getattr(t, n), slot_by_ptr) for n in names}
        if all(s is None for s in inner.values()):
            return None
        inner = {n: (s if s is not None else ("raw", getattr(t, n))) for n, s in inner.items()}
        return ("sub", type(t), meta, tuple(t.size()), tuple(t.stride()), inner)
    try:
        slot = slot_by_ptr.get(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage (other subclasses, functional tensors)
        return None
    if slot is None:
        return None
    return ("view", slot.occupant, t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())



def rebuild(spec: Any, blocks: list[Block]) -> torch.Tensor:
    kind = spec[0]
    if kind == "raw":
        return spec[1]
    if kind == "sub":
        _, cls, meta, size, stride, inner = spec
        return cls.__tensor_unflatten__({n: rebuild(s, blocks) for n, s in inner.items()}, meta, size, stride)
    _, index, dtype, size, stride, offset = spec
    slot = blocks[index].slot
    if slot is None:
        raise RuntimeError(f"block swap: block {index}'s weights were unpacked while not resident (internal error)")
    return slot.buf.view(dtype).as_strided(size, stride, offset)


def copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``t`` on ``device`` with its own storage (never a view of a swap buffer)."""
    if is_traceable_wrapper_subclass(t):
        names, meta = t.__tensor_flatten__()
        inner = {n: copy_to(getattr(t, n), device) for n in names}
        return type(t).__tensor_unflatten__(inner, meta, t.size(), t.stride())
    return t.to(device, copy=True)


def unpin_all(bufs: list[torch.Tensor]) -> None:
    for buf in bufs:
        try:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
    bufs.clear()
