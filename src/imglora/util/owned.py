"""Tensors in memory this process owns, at the allocator's alignment: what makes "bit for bit" hold.

A safetensors file's data starts at ``8 + header length`` bytes, so a tensor read in place (memory
mapped, as diffusers' and transformers' ``from_pretrained`` and ``safetensors.torch.load_file``
leave it) sits at whatever offset the file gives it: 40 or 56 bytes past a 64-byte boundary, say.
CPU BLAS kernels (MKL, oneDNN) take other vector paths for unaligned operands on some processors
and round the last bits differently: the same weights then give a different loss depending on how
they were read. imglora's promises of identity -- a resumed run repeats the uninterrupted one, a
single file trains as its folder, the quantized-base cache reads back the model it saved -- hold
on every CPU because every tensor imglora computes with from a file is first put in memory torch
allocated itself (64-byte aligned): ``copy`` for tensors read, ``own_module`` for a module a
library loaded. The cost is one copy of weights that are copied anyway (to the GPU, or to pinned
memory for swapping); on a GPU the copy to the device is that copy and nothing is added.

``IMGLORA_TEST_UNALIGNED=1`` (tests only; ``.ci/run`` runs the suite once so) makes ``copy``
place tensors at a deliberately unaligned offset instead, as a memory-mapped read would: a path
that computes on a read tensor without going through ``own_module`` then shows on the
developer's machine, not on a user's.
"""

from __future__ import annotations

import os

import torch

UNALIGNED_ENV = "IMGLORA_TEST_UNALIGNED"
ALIGNMENT = 64  # bytes: a cache line, and what torch's CPU allocator guarantees
UNALIGNED_OFFSET = 40  # bytes past a 64-byte boundary, as tensors in a safetensors file often sit


def unaligned_reads() -> bool:
    """Whether the test switch is on (read each time: tests set it per process)."""
    return os.environ.get(UNALIGNED_ENV, "") not in ("", "0")


def is_aligned(t: torch.Tensor) -> bool:
    return t.device.type != "cpu" or t.numel() == 0 or t.data_ptr() % ALIGNMENT == 0


def aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in fresh memory torch allocated (64-byte aligned), never a view."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def unaligned_copy(t: torch.Tensor, offset: int = UNALIGNED_OFFSET) -> torch.Tensor:
    """A contiguous copy of ``t`` starting ``offset`` bytes past a 64-byte boundary (tests)."""
    nbytes = t.numel() * t.element_size()
    offset -= offset % t.element_size()  # a tensor's start is a multiple of its element size
    buf = torch.empty(nbytes + 2 * ALIGNMENT, dtype=torch.uint8, device=t.device)
    start = (-buf.data_ptr()) % ALIGNMENT + offset
    out = buf[start:start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def copy(t: torch.Tensor) -> torch.Tensor:
    """What the project's readers return for a tensor read from a file: a copy it owns (the file may
    be rewritten or deleted while the tensor is in use), aligned -- or, under the test switch, at
    an unaligned offset, as the memory-mapped tensor would have been."""
    if t.device.type == "cpu" and unaligned_reads() and t.numel():
        return unaligned_copy(t)
    return aligned_copy(t)


def own_module(module: torch.nn.Module) -> torch.nn.Module:
    """Move every CPU parameter and buffer of ``module`` that is not at an aligned address (a
    memory-mapped weight, a tensor the test switch misplaced) into aligned memory it owns, in place;
    quantized weights (optimum-quanto's tensor subclasses) have their inner tensors moved. Aligned
    tensors are left as they are, so a module loaded by imglora's own readers costs nothing."""
    with torch.no_grad():
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is None:
                    continue
                if type(p) in (torch.Tensor, torch.nn.Parameter):
                    if not is_aligned(p):
                        p.data = aligned_copy(p.data)
                else:  # a subclass (quanto): its inner tensors, on the parameter itself (.data is an alias)
                    _own(p)
            for name, b in list(sub._buffers.items()):
                if b is not None:
                    sub._buffers[name] = _own(b)
    return module


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its memory is aligned, else an aligned copy; a tensor subclass that wraps inner
    tensors (``__tensor_flatten__``) keeps its identity and has those replaced."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return t if is_aligned(t) else aligned_copy(t)
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:
        for attr in flatten()[0]:
            inner = getattr(t, attr)
            owned = _own(inner)
            if owned is not inner:
                setattr(t, attr, owned)
    return t


def read_file(path: "str | os.PathLike[str]") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors (each a ``copy``: owned, aligned) and its metadata. Errors are
    safetensors' own (SafetensorError, OSError): callers say which file and what to do."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as fh:
        meta = fh.metadata() or {}
        tensors = {k: copy(fh.get_tensor(k)) for k in fh.keys()}
    return tensors, meta


def load_file(path: "str | os.PathLike[str]") -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` with every tensor a ``copy`` (owned, aligned)."""
    return read_file(path)[0]
