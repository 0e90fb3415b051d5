"""Gradient-checkpoint boundaries kept in host memory (kohya's ``--cpu_offload_checkpointing``).

With gradient checkpointing a model keeps, for backward, only each checkpointed block's inputs --
for FLUX.1 at 1024x1024 the image and text hidden states, 27 MiB per block, 57 blocks: about
1.5 GiB, the largest activation term left. :class:`OffloadingCheckpoint` is a checkpoint function
(diffusers' ``enable_gradient_checkpointing(gradient_checkpointing_func=...)``) that copies each
large input to pinned host memory as the block runs forward and back to the device when backward
recomputes the block, so the device holds one block's inputs at a time instead of all of them.

* The forward pass runs on the original device tensor (no copy back), so forward costs one
  device-to-host copy per block, queued on the compute stream with ``non_blocking`` into pinned
  memory: it overlaps with the host and orders itself before anything that could reuse the tensor's
  memory (the caching allocator reuses it only for later work on the same stream).
* Recompute copies the host tensor back (host-to-device, stream-ordered, ``non_blocking``).
* Gradients flow as without offloading: the recomputed graph reads the copy, and the copy's
  backward hands the gradient to the device tensor the block was called with.
* Only tensors of at least ``min_bytes`` on an accelerator move; small ones (the timestep
  embedding, shared rotary tables passed as tuples) stay. On the CPU nothing moves.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

MIN_BYTES = 1 << 20


def pinned_bytes(nbytes: int) -> int:
    """Host memory a pinned copy of ``nbytes`` takes: PyTorch's caching host allocator (behind
    ``.to("cpu", non_blocking=True)`` and ``pin_memory``) rounds every block up to a power of two,
    so FLUX.1's 24 MiB boundaries at 1024 px take 32 MiB each."""
    return 1 << max(0, int(nbytes) - 1).bit_length() if nbytes > 0 else 0


class OffloadingCheckpoint:
    def __init__(self, min_bytes: int = MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self.offloaded_bytes = 0  # bytes copied to the host so far (a counter for reports and tests)
        self.calls = 0

    def _moves(self, a: Any) -> bool:
        return (isinstance(a, torch.Tensor) and a.device.type not in ("cpu", "meta")
                and a.numel() * a.element_size() >= self.min_bytes)

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        moved = [self._moves(a) for a in args]
        if not any(moved):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)
        originals = list(args)
        devices = [a.device if m else None for a, m in zip(args, moved)]
        host = tuple(a.to("cpu", non_blocking=True) if m else a for a, m in zip(args, moved))
        self.offloaded_bytes += sum(a.numel() * a.element_size() for a, m in zip(args, moved) if m)
        first = [True]

        def run(*a: Any, **k: Any) -> Any:
            if first[0]:  # the forward pass: the device tensors are still here, use them
                first[0] = False
                a = tuple(o if m else x for o, x, m in zip(originals, a, moved))
                originals.clear()  # do not keep them alive for backward
            else:  # recompute in backward: bring the inputs back
                a = tuple(x.to(d, non_blocking=True) if d is not None else x for x, d in zip(a, devices))
            return function(*a, **k)

        return checkpoint(run, *host, use_reentrant=False, **kwargs)


def install(model: torch.nn.Module) -> OffloadingCheckpoint | None:
    """Use an :class:`OffloadingCheckpoint` for ``model``'s gradient checkpointing, when the model
    takes a checkpoint function (diffusers models do); None otherwise."""
    enable = getattr(model, "enable_gradient_checkpointing", None)
    if enable is None or not getattr(model, "is_gradient_checkpointing", False):
        return None
    import inspect

    if "gradient_checkpointing_func" not in inspect.signature(enable).parameters:
        return None
    fn = OffloadingCheckpoint()
    enable(gradient_checkpointing_func=fn)
    return fn
