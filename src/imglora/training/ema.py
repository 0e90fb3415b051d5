"""An exponential moving average of the adapter weights (``train.ema``).

Every ``train.ema_every`` updates: ``ema ← ema + (1 − decay)·(weights − ema)``, i.e.
``decay·ema + (1 − decay)·weights``, starting from the weights before the first update. The average
lives beside the weights, or in host memory with ``memory.ema_on_cpu`` (then each update copies the
adapter to the host once, a device sync). It is saved as a second adapter (``adapter_ema/``) in
every checkpoint and at the end, so export and evaluation can take either.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch


class Ema:
    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float, device: torch.device | str | None = None):
        self.decay = decay
        self.shadow = [p.detach().to(device if device is not None else p.device, copy=True) for p in params]

    @torch.no_grad()
    def update(self, params: Sequence[torch.nn.Parameter]) -> None:
        current = [p.detach().to(s.device) for p, s in zip(params, self.shadow)]
        torch._foreach_lerp_(self.shadow, current, 1.0 - self.decay)

    @torch.no_grad()
    def load(self, values: Sequence[torch.Tensor]) -> None:
        for s, v in zip(self.shadow, values, strict=True):
            s.copy_(v)


@contextlib.contextmanager
def swapped(params: Sequence[torch.nn.Parameter], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """``params`` hold ``values`` for the duration (to save or evaluate them with the model's own
    code); their own values are put back bit for bit afterwards."""
    kept = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p, v in zip(params, values, strict=True):
                p.copy_(v)
        yield
    finally:
        with torch.no_grad():
            for p, k in zip(params, kept):
                p.copy_(k)
