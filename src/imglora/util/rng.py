"""Random draws for a training batch: one generator per sample.

The noise, noise level and timestep a sample gets depend only on (seed, update, its position in the
update's global batch), not on how the batch is cut: one process with batch 2 and two processes
with batch 1 draw the same numbers for the same samples, so data-parallel training computes the
same update as one process (up to the order of floating-point sums). Families draw through
:func:`draws`, which also takes a plain ``torch.Generator`` (one stream for the whole batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK = 2**63 - 1


def sample_seed(seed: int, step: int, position: int) -> int:
    """The seed of the sample at ``position`` of update ``step``'s global batch (all micro-batches,
    all processes: position = micro-batch within the update x global micro-batch size + index)."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + (position + 1) * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    return (x * 0xD6E8FEB86659FD93) & _MASK


class SampleRNG:
    """Draws whose first dimension is the batch: row ``i`` comes from sample ``i``'s generator."""

    def __init__(self, seeds: Sequence[int], device: torch.device | str) -> None:
        device = torch.device(device)
        gen_device = "cpu" if device.type in ("cpu", "meta") else device
        self.gens = [torch.Generator(device=gen_device).manual_seed(int(s)) for s in seeds]

    def __len__(self) -> int:
        return len(self.gens)

    def _check(self, shape: Sequence[int]) -> None:
        if not shape or shape[0] != len(self.gens):
            raise ValueError(f"a per-sample draw needs the batch ({len(self.gens)}) as its first dimension, got "
                             f"{tuple(shape)}")

    def randn(self, shape: Sequence[int], *, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
        self._check(shape)
        return torch.stack([torch.randn(tuple(shape[1:]), generator=g, device=device, dtype=dtype)
                            for g in self.gens])

    def rand(self, shape: Sequence[int], *, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
        self._check(shape)
        return torch.stack([torch.rand(tuple(shape[1:]), generator=g, device=device, dtype=dtype)
                            for g in self.gens])

    def randint(self, low: int, high: int, shape: Sequence[int], *, device: torch.device) -> torch.Tensor:
        self._check(shape)
        return torch.stack([torch.randint(low, high, tuple(shape[1:]), generator=g, device=device)
                            for g in self.gens])


class BatchRNG:
    """One generator for the whole batch (tests and tools that hand a ``torch.Generator``)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.g = generator

    def randn(self, shape: Sequence[int], *, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=self.g, device=device, dtype=dtype)

    def rand(self, shape: Sequence[int], *, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.rand(tuple(shape), generator=self.g, device=device, dtype=dtype)

    def randint(self, low: int, high: int, shape: Sequence[int], *, device: torch.device) -> torch.Tensor:
        return torch.randint(low, high, tuple(shape), generator=self.g, device=device)


def seed_global(seed: int) -> None:
    """What ``torch.manual_seed`` does for the devices training uses: the CPU generator, and CUDA's
    once CUDA is initialized (training on a GPU initializes it before the loop). Without CUDA,
    ``torch.manual_seed`` also queues a lazy seeding for each accelerator torch knows (CUDA, XPU,
    MTIA), each recording the caller's stack: host time the loop spends once per update for nothing."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def draws(rng: "SampleRNG | BatchRNG | torch.Generator") -> "SampleRNG | BatchRNG":
    return BatchRNG(rng) if isinstance(rng, torch.Generator) else rng
