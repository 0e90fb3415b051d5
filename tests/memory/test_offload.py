"""memory.offload: checkpoint boundaries in host memory, with the gradients of plain checkpointing."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from imglora.memory.offload import OffloadingCheckpoint


class Stack(nn.Module):
    def __init__(self, ckpt) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(4))
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = self.ckpt(b, x) * scale
        return x


def grads(device: str, ckpt) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = Stack(ckpt).to(device)
    x = torch.randn(1024, 512, device=device, requires_grad=True)
    scale = torch.tensor(0.5, device=device, requires_grad=True)
    model(x, scale).pow(2).sum().backward()
    return x.grad, [p.grad for p in model.parameters()] + [scale.grad]


def plain(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def test_on_the_cpu_nothing_moves_and_nothing_changes() -> None:
    off = OffloadingCheckpoint()
    a, b = grads("cpu", plain), grads("cpu", off)
    assert torch.equal(a[0], b[0]) and all(torch.equal(p, q) for p, q in zip(a[1], b[1]))
    assert off.calls == 4 and off.offloaded_bytes == 0


@pytest.mark.gpu
def test_on_cuda_the_boundaries_leave_the_device_and_the_gradients_stay() -> None:
    off = OffloadingCheckpoint("cuda")
    a = grads("cuda", plain)
    torch.cuda.reset_peak_memory_stats()
    b = grads("cuda", off)
    assert off.offloaded_bytes == 4 * 1024 * 512 * 4
    # exactly their size, page-locked (registered, or the allocator's pinned memory where that fails)
    held = off.facts["host_memory"]
    assert sum(held.values()) >= off.offloaded_bytes and set(held) <= {"registered", "pinned"}, held
    assert torch.allclose(a[0], b[0]) and all(torch.allclose(p, q) for p, q in zip(a[1], b[1]))
