"""Deterministic bucketed batching: the order of an epoch is a pure function of (seed, epoch).

Because of that, resuming needs no saved iterator: micro-batch number ``m`` of a run is always
the same batch, whether the run was interrupted or not.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from .samples import Sample


@dataclass(frozen=True)
class BatchRef:
    epoch: int
    indices: tuple[int, ...]  # into the sample list
    variants: tuple[int, ...]  # which cached variant (e.g. flipped) of each sample


class Batcher:
    def __init__(self, samples: list[Sample], batch_size: int, seed: int,
                 collate: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]] | None = None):
        if not samples:
            raise ValueError("no training samples")
        self.samples = samples
        self.batch_size = batch_size
        self.seed = seed
        self.collate = collate or stack
        self.per_epoch = len(self._epoch(0))

    def _epoch(self, epoch: int) -> list[BatchRef]:
        rng = random.Random(f"{self.seed}/{epoch}")
        by_bucket: dict[tuple[int, int], list[int]] = {}
        for i, s in enumerate(self.samples):
            by_bucket.setdefault(s.bucket, []).extend([i] * s.repeats)
        batches = []
        for bucket in sorted(by_bucket):
            idx = by_bucket[bucket]
            rng.shuffle(idx)
            batches += [idx[j:j + self.batch_size] for j in range(0, len(idx), self.batch_size)]
        rng.shuffle(batches)
        refs = [BatchRef(epoch, tuple(b), tuple(rng.randrange(len(self.samples[i].variants)) for i in b))
                for b in batches]
        return refs

    def ref(self, micro_index: int) -> BatchRef:
        """The batch for the ``micro_index``-th micro-batch of the run (0-based)."""
        epoch, pos = divmod(micro_index, self.per_epoch)
        if getattr(self, "_cached_epoch", None) != epoch:
            self._cached, self._cached_epoch = self._epoch(epoch), epoch
        return self._cached[pos]

    def batch(self, micro_index: int, device: torch.device) -> dict[str, torch.Tensor]:
        ref = self.ref(micro_index)
        entries = [self.samples[i].variants[v] for i, v in zip(ref.indices, ref.variants)]
        batch = self.collate(entries)
        if device.type == "cuda":  # only a copy from page-locked memory is truly asynchronous
            batch = {k: t.pin_memory() for k, t in batch.items()}
        return {k: t.to(device, non_blocking=True) for k, t in batch.items()}


def stack(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batch same-shaped entries (one bucket) by stacking each tensor."""
    return {k: torch.stack([e[k] for e in entries]) for k in entries[0]}
