"""``memory.norms_in_model_dtype``: LayerNorm and GroupNorm give the model's dtype under autocast.

CUDA autocast runs ``layer_norm`` and ``group_norm`` in fp32 and returns fp32. In FLUX every block
then modulates that fp32 output (``norm(x) * (1 + scale) + shift``: two more fp32 passes over the
activations, and their fp32 backward) and each Linear that reads it casts it back to bf16 on its
own (three casts for Q, K and V). None of this is in the model: run without autocast, as diffusers
runs it for inference in bf16, the norm kernel reads bf16, computes its statistics in fp32 inside
the kernel, and writes bf16. With this setting each ``nn.LayerNorm`` and ``nn.GroupNorm`` runs so
under autocast too: its input in the model dtype, the kernel's fp32 arithmetic inside, its output
in the model dtype; the modulation after it runs in bf16, and the Linear layers take it uncast.

Numerics: the normalisation itself is computed as before (in fp32 inside the kernel); its output is
rounded to bf16 where autocast kept it in fp32 until the next product (which rounds it to bf16
then), and the modulation rounds in bf16. A layer whose input is not in its own parameters' dtype
(a model loaded in fp32) keeps autocast's way. Off by default until measured on a GPU; the plan
predicts it (``imglora plan``).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator

import torch
from torch import nn

_state = threading.local()


def autocast_suspended() -> bool:
    """True inside :func:`no_autocast` (the plan's meta-device autocast honours it too)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def no_autocast(device_type: str) -> Iterator[None]:
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        if device_type in ("cuda", "cpu"):
            with torch.autocast(device_type, enabled=False):
                yield
        else:  # (the meta device: memory/meta_run.Autocast checks autocast_suspended)
            yield
    finally:
        _state.depth -= 1


def _forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    own = next((p.dtype for p in self.parameters(recurse=False)), input.dtype)
    if own != input.dtype or not input.is_floating_point():
        return type(self).forward(self, input)
    if torch.compiler.is_compiling():  # (a compiled block: no Python state for dynamo to trace)
        with torch.autocast(input.device.type, enabled=False):
            return type(self).forward(self, input)
    with no_autocast(input.device.type):
        return type(self).forward(self, input)


def install(model: nn.Module) -> int:
    """Every LayerNorm and GroupNorm of ``model`` keeps the input's dtype under autocast; the count."""
    n = 0
    for mod in model.modules():
        if type(mod) in (nn.LayerNorm, nn.GroupNorm):  # (exactly: a subclass may take other arguments)
            mod.forward = types.MethodType(_forward, mod)
            n += 1
    return n
