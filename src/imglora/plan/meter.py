"""Counting tensor memory as it is allocated and freed, on any device (the meta device included).

:class:`LiveBytes` is a ``TorchDispatchMode``: every storage an op produces counts from its creation
until it is freed, whichever Python objects (tensors, views, Parameters) keep it alive meanwhile.
On the meta device the "storage" has a size but no memory, so the same meter runs a whole training
step of a model that was never loaded and reports what it would hold (``imglora plan``); on the CPU
it measures a real step (the tests that check the plan).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive (created while the mode is on and not yet freed), their peak,
    and named marks (``mark(name)`` records the live bytes at that moment)."""

    def __init__(self, count_meta: bool = True) -> None:
        super().__init__()
        self.count_meta = count_meta  # False: what a real device holds (a module moved to "meta" frees it)
        self.live = self.peak = 0
        self.marks: dict[str, int] = {}
        self.peaks: dict[str, int] = {}  # the peak reached by each mark's time
        self._sizes: dict[int, int] = {}

    def _track(self, t: object) -> None:
        if not isinstance(t, torch.Tensor) or (not self.count_meta and t.device.type == "meta"):
            return
        if is_traceable_wrapper_subclass(t):  # e.g. a quanto tensor: its parts hold the memory
            names, _ = t.__tensor_flatten__()
            for n in names:
                self._track(getattr(t, n))
            return
        storage = t.untyped_storage()  # one Python object per storage, finalized when it is freed
        key = id(storage)
        if key not in self._sizes:
            n = storage.nbytes()
            self._sizes[key] = n
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def mark(self, name: str) -> int:
        self.marks[name] = self.live
        self.peaks[name] = self.peak
        return self.live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inner = _python_kernels().get(str(func))
        if inner is not None:
            # A custom op implemented in Python allocates inside itself, where a dispatch mode does
            # not look (it is off while it handles the op): run the implementation with it on.
            with self:
                out = inner(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage: nothing was allocated (and a
        # storage made before the meter started, such as a weight, must not be counted when an op
        # first returns a view of it).
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t) and \
                    id(t.untyped_storage()) in inputs:
                continue
            self._track(t)
        return out


_KERNELS: dict[str, Any] | None = None


def _python_kernels() -> dict[str, Any]:
    """Custom ops whose CPU implementation is Python: optimum-quanto's fp8/int8 matmul dequantizes
    the whole weight (two copies for a moment) inside the op."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = {}
        try:
            from optimum.quanto.library import qbytes_mm as q

            def fp8_mm(activations: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
                if weights.dtype.is_floating_point:  # the path quanto's CPU (and CUDA) kernel takes for fp8
                    return q.qbytes_mm(activations, weights, scales)
                return torch.ops.quanto.qbytes_mm(activations, weights, scales)

            _KERNELS["quanto.qbytes_mm.default"] = fp8_mm
        except (ImportError, AttributeError):
            pass
    return _KERNELS


def held_bytes(*objects: Any) -> int:
    """Bytes of the distinct storages behind ``objects`` (modules' parameters and buffers, optimizer
    state, tensors, lists of them): what is already allocated when a meter starts."""
    seen: set[tuple[str, int]] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            for n in names:
                add(getattr(t, n))
            return
        storage = t.untyped_storage()
        key = (t.device.type, storage.data_ptr() if t.device.type != "meta" else id(storage))
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()

    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for t in itertools.chain(obj.parameters(), obj.buffers()):
                add(t)
                if t.grad is not None:
                    add(t.grad)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        add(v)
        elif isinstance(obj, torch.Tensor):
            add(obj)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                if isinstance(x, torch.Tensor):
                    add(x)
    return total
